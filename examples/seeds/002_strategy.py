"""Seed 002 (`paddle.distributed.Strategy`): the class's own example, ZeRO stage 2 over 2
devices, gradient merge over 2 steps (summed) and a 1F1B pipeline of micro-batches of 2, with
fleetjax's imports, trained for a few steps on the pipelined digits MLP over a mesh of
2 x 2 x 2 devices.

    python examples/seeds/002_strategy.py   # 8 simulated CPU devices
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # without an accelerator: 8 CPU devices

from models import train_pipeline

import fleetjax as dist  # import paddle.distributed as dist
import fleetjax as paddle  # import paddle
from fleetjax import optimizers

strategy = dist.Strategy()
strategy.sharding.enable = True
strategy.sharding.stage = 2
strategy.sharding.degree = 2
strategy.gradient_merge.enable = True
strategy.gradient_merge.k_steps = 2
strategy.gradient_merge.avg = False
strategy.pipeline.enable = True
strategy.pipeline.schedule_mode = "1F1B"  # default is "1F1B"
strategy.pipeline.micro_batch_size = 2

# Paddle's auto-parallel takes the pipeline's stages from the model's process meshes; here the
# mesh has a pp axis of 2 (and the sharding axis of strategy.sharding.degree).
mesh = paddle.build_mesh(dp=2, sharding=2, pp=2)
optimizer = paddle.distributed_optimizer(optimizers.Adam(learning_rate=0.01), strategy, mesh)
print(paddle.applied_strategy(strategy, mesh))
train_pipeline(optimizer, batch_size=16, steps=4)
