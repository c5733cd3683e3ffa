"""Seed 002 (`paddle.distributed.Strategy`): the examples of its sections, `sharding`,
`gradient_merge`, `fused_passes` and `pipeline`, with fleetjax's imports, each trained for a
few steps on the digits MLP (the pipeline on the pipelined one).

    python examples/seeds/002_strategy_sections.py   # 8 simulated CPU devices
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # without an accelerator: 8 CPU devices

from models import train, train_pipeline

import fleetjax as dist  # import paddle.distributed as dist
import fleetjax as paddle  # import paddle
from fleetjax import fleet, optimizers


def trained_with(strategy):
    fleet.init(is_collective=True, strategy=strategy)
    report = paddle.applied_strategy(strategy)
    for setting in report.applied:
        print(f"  {setting.feature}: {setting.how}")
    for flag in report.xla_flags:
        print(f"  XLA flag {flag} ({flag.knob})")
    return fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01))


print("sharding")
strategy = dist.Strategy()
strategy.sharding.enable = True
strategy.sharding.stage = 2
strategy.sharding.degree = 2
train(trained_with(strategy))

print("gradient_merge")
strategy = dist.Strategy()
strategy.gradient_merge.enable = True
strategy.gradient_merge.k_steps = 2
strategy.gradient_merge.avg = True
train(trained_with(strategy), steps=4)

print("fused_passes")
strategy = dist.Strategy()
strategy.fused_passes.enable = True
# The seed writes "gemm_spilogue", a typo that Paddle stores and ignores; fleetjax refuses
# unknown keys (naming gemm_epilogue), so the example sets the key it means.
strategy.fused_passes.gemm_epilogue = True
strategy.fused_passes.dropout_add = True
train(trained_with(strategy))

print("pipeline")
strategy = dist.Strategy()
strategy.pipeline.enable = True
strategy.pipeline.micro_batch_size = 2
train_pipeline(trained_with(strategy), batch_size=16)
