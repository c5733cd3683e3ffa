"""Seed 001 (`fleet.DistributedStrategy`, the full reference), part 4: AMP and fp16 all-reduce,
with fleetjax's imports, each trained for a few steps on the digits MLP.

    python examples/seeds/001_amp_fp16_allreduce.py   # 8 simulated CPU devices
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # without an accelerator: 8 CPU devices

from models import train

import fleetjax.fleet as fleet  # import paddle.distributed.fleet as fleet
from fleetjax import optimizers

print("amp")
strategy = fleet.DistributedStrategy()
strategy.amp = True  # by default this is false
strategy = fleet.DistributedStrategy()
strategy.amp = True
strategy.amp_configs = {"init_loss_scaling": 32768, "custom_white_list": ["conv2d"]}
fleet.init(is_collective=True, strategy=strategy)
train(fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01)))

print("fp16_allreduce")
strategy = fleet.DistributedStrategy()
strategy.fp16_allreduce = True  # by default this is false
fleet.init(is_collective=True, strategy=strategy)
train(fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01)))
