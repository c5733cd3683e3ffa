"""Optimizers: optax transformations, and the binding of one to a distributed strategy."""

from fleetjax.optimizers._distributed import DistributedOptimizer, distributed_optimizer

__all__ = ["DistributedOptimizer", "distributed_optimizer"]
