"""`fleet.distributed_optimizer`: the optimizer a strategy trains with, bound to that strategy."""

from __future__ import annotations

import dataclasses
from typing import Any

import optax
from jax.sharding import Mesh

from fleetjax.mesh import data_axes, data_parallel_size, mesh_from_strategy
from fleetjax.optimizers._strategy import optimizer_for_strategy
from fleetjax.strategy import DistributedStrategy, Strategy


@dataclasses.dataclass(frozen=True)
class DistributedOptimizer:
    """An optax transformation bound to the strategy and mesh it runs under.

    Attributes:
      inner: what the strategy trains with: the user's optimizer, or Paddle's rebuild of it
        (LARS from a Momentum, LAMB from an Adam, DGC, LocalSGD). It has `init` and `update`
        like any optax transformation.
      strategy: a copy of the strategy.
      mesh: the device mesh.
      user: the optimizer the user gave.
    """

    inner: optax.GradientTransformation
    strategy: DistributedStrategy | Strategy
    mesh: Mesh
    user: optax.GradientTransformation

    @property
    def init(self) -> Any:
        return self.inner.init

    @property
    def update(self) -> Any:
        return self.inner.update


def distributed_optimizer(
    optimizer: optax.GradientTransformation,
    strategy: DistributedStrategy | Strategy | None = None,
    mesh: Mesh | None = None,
) -> DistributedOptimizer:
    """Bind `optimizer` to a copy of `strategy` (default: plain data parallel) and `mesh`
    (default: built from the strategy over all devices), rebuilding it as the strategy says.

    Raises:
      TypeError: if `optimizer` is not an optax transformation, `strategy` not a strategy, or
        a switch that rebuilds the optimizer (lars, lamb, dgc) gets a plain optax one.
      ValueError: if a switch cannot apply (LARS on Adam, DGC with one replica, ...).
    """
    if isinstance(optimizer, DistributedOptimizer):
        optimizer = optimizer.user
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            "optimizer must be an optax GradientTransformation (with init and update), "
            f"got {type(optimizer).__name__}"
        )
    strategy = DistributedStrategy() if strategy is None else strategy
    if not isinstance(strategy, (DistributedStrategy, Strategy)):
        raise TypeError(
            "strategy must be a fleetjax.DistributedStrategy or fleetjax.Strategy, "
            f"got {type(strategy).__name__}"
        )
    mesh = mesh if mesh is not None else mesh_from_strategy(strategy)
    inner = optimizer_for_strategy(optimizer, strategy, data_parallel_size(mesh), data_axes(mesh))
    return DistributedOptimizer(inner, strategy.__copy__(), mesh, optimizer)
