"""Seed 000 (`fleet.DistributedStrategy`, the early page): its examples of recompute, pipeline
and gradient merge, with fleetjax's imports, each trained for a few steps on the digits MLP.

    python examples/seeds/000_distributed_strategy.py   # 8 simulated CPU devices
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # without an accelerator: 8 CPU devices

from models import train, train_pipeline

import fleetjax.fleet as fleet  # import paddle.distributed.fleet as fleet
from fleetjax import optimizers

print("recompute")
strategy = fleet.DistributedStrategy()
strategy.recompute = True
# suppose x and y are names of checkpoint tensors for recomputation
strategy.recompute_configs = {"checkpoints": ["x", "y"]}
fleet.init(is_collective=True, strategy=strategy)
train(fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01)))

print("pipeline")
strategy = fleet.DistributedStrategy()
strategy.pipeline = True
# The seed's Paddle 2.0 key "micro_batch" (the number of micro-batches) is "accumulate_steps"
# since Paddle 2.1; fleetjax, as Paddle 3, refuses the old name (and says so).
strategy.pipeline_configs = {"accumulate_steps": 12}
fleet.init(is_collective=True, strategy=strategy)
train_pipeline(fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01)), batch_size=96)

print("gradient_merge")
strategy = fleet.DistributedStrategy()
strategy.gradient_merge = True
strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}
fleet.init(is_collective=True, strategy=strategy)
train(fleet.distributed_optimizer(optimizers.SGD(learning_rate=0.5)), steps=8)
