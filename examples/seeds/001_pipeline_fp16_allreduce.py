"""Seed 001 (`fleet.DistributedStrategy`, the full reference), its pipeline and fp16_allreduce
examples together: a pipeline over 2 stages whose data-parallel gradient reduction is in
float16, with fleetjax's imports, trained for a few steps on the pipelined digits MLP.

    python examples/seeds/001_pipeline_fp16_allreduce.py   # 8 simulated CPU devices
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # without an accelerator: 8 CPU devices

from models import train_pipeline

import fleetjax.fleet as fleet  # import paddle.distributed.fleet as fleet
from fleetjax import optimizers

strategy = fleet.DistributedStrategy()
strategy.pipeline = True
strategy.pipeline_configs = {"micro_batch_size": 12}
strategy.fp16_allreduce = True  # by default this is false
# Two pipeline stages, 4 data-parallel replicas (seed 001's hybrid degrees, for 8 devices).
strategy.hybrid_configs = {"dp_degree": 4, "pp_degree": 2}
fleet.init(is_collective=True, strategy=strategy)
optimizer = fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01))
print(fleet.applied_strategy())
train_pipeline(optimizer, batch_size=48)
