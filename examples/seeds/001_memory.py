"""Seed 001 (`fleet.DistributedStrategy`, the full reference), part 2: recompute with offload,
pipeline, gradient merge and sharding, with fleetjax's imports, each trained for a few steps on
the digits MLP. The sharding example is seed 001's "sharding-DP, 2 nodes with 8 gpus per node":
16 devices.

    python examples/seeds/001_memory.py   # 16 simulated CPU devices
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "16")  # without an accelerator: 16 CPU devices

from models import HIDDEN, train, train_pipeline

import fleetjax.fleet as fleet  # import paddle.distributed.fleet as fleet
from fleetjax import optimizers

print("recompute")
strategy = fleet.DistributedStrategy()
strategy.recompute = True
# suppose x and y are names of checkpoint tensors for recomputation
strategy.recompute_configs = {
    "checkpoints": ["x", "y"],
    "enable_offload": True,
    # The seed's [100, 512, 1024] is its model's; the MLP's x and y are [rows, HIDDEN], 4 rows
    # on each of the 16 devices.
    "checkpoint_shape": [4, HIDDEN],
}
fleet.init(is_collective=True, strategy=strategy)
train(fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01)))

print("pipeline")
strategy = fleet.DistributedStrategy()
strategy.pipeline = True
strategy.pipeline_configs = {"micro_batch_size": 12}
fleet.init(is_collective=True, strategy=strategy)
train_pipeline(fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01)), batch_size=192)

print("gradient_merge")
strategy = fleet.DistributedStrategy()
strategy.gradient_merge = True
strategy.gradient_merge_configs = {"k_steps": 4, "avg": True}
fleet.init(is_collective=True, strategy=strategy)
train(fleet.distributed_optimizer(optimizers.SGD(learning_rate=0.5)), steps=8)

print("sharding")
strategy = fleet.DistributedStrategy()
strategy.sharding = True

# sharding-DP, 2 nodes with 8 gpus per node
strategy = fleet.DistributedStrategy()
strategy.sharding = True
strategy.sharding_configs = {
    "sharding_segment_strategy": "segment_broadcast_MB",
    "segment_broadcast_MB": 32,
    "sharding_degree": 8,
    "dp_degree": 2,
    "gradient_merge_acc_step": 4,
}
fleet.init(is_collective=True, strategy=strategy)
print("  mesh", dict(fleet.mesh.shape))
train(fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01)), steps=4)
