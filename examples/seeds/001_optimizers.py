"""Seed 001 (`fleet.DistributedStrategy`, the full reference), part 3: LARS, LAMB, LocalSGD,
Adaptive LocalSGD and DGC, with fleetjax's imports, each rebuilding the optimizer it needs
(Momentum, Adam, SGD) and training a few steps of the digits MLP.

    python examples/seeds/001_optimizers.py   # 8 simulated CPU devices
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # without an accelerator: 8 CPU devices

from models import train

import fleetjax.fleet as fleet  # import paddle.distributed.fleet as fleet
from fleetjax import optimizers


def trained_with(optimizer):
    optimizer = fleet.distributed_optimizer(optimizer)
    if isinstance(optimizer.rebuilt, optimizers.PaddleOptimizer):  # LocalSGD wraps it instead
        print(f"  {optimizer.user!r} became {optimizer.rebuilt!r}")
    train(optimizer, steps=4)


print("lars")
strategy = fleet.DistributedStrategy()
strategy.lars = True
strategy.lars_configs = {
    "lars_coeff": 0.001,
    "lars_weight_decay": 0.0005,
    "epsilon": 0,
    "exclude_from_weight_decay": ["batch_norm", ".b"],
}
fleet.init(is_collective=True, strategy=strategy)
trained_with(optimizers.Momentum(learning_rate=0.1, momentum=0.9))

print("lamb")
strategy = fleet.DistributedStrategy()
strategy.lamb = True
strategy.lamb_configs = {
    "lamb_weight_decay": 0.01,
    "exclude_from_weight_decay": [],
}
fleet.init(is_collective=True, strategy=strategy)
trained_with(optimizers.Adam(learning_rate=0.01))

print("localsgd")
strategy = fleet.DistributedStrategy()
strategy.localsgd = True  # by default this is false
strategy = fleet.DistributedStrategy()
strategy.localsgd = True
strategy.localsgd_configs = {"k_steps": 4, "begin_step": 30}
fleet.init(is_collective=True, strategy=strategy)
trained_with(optimizers.SGD(learning_rate=0.5))

print("adaptive_localsgd")
strategy = fleet.DistributedStrategy()
strategy.adaptive_localsgd = True  # by default this is false
strategy = fleet.DistributedStrategy()
strategy.adaptive_localsgd = True
strategy.adaptive_localsgd_configs = {"init_k_steps": 1, "begin_step": 30}
fleet.init(is_collective=True, strategy=strategy)
trained_with(optimizers.SGD(learning_rate=0.5))

print("dgc")
strategy = fleet.DistributedStrategy()
strategy.dgc = True  # by default this is false
strategy = fleet.DistributedStrategy()
strategy.dgc = True
strategy.dgc_configs = {"rampup_begin_step": 1252}
fleet.init(is_collective=True, strategy=strategy)
trained_with(optimizers.Momentum(learning_rate=0.1, momentum=0.9))
