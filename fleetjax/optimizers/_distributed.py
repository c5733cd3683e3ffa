"""`fleet.distributed_optimizer`: an optax transformation bound to the strategy it runs under."""

from __future__ import annotations

import dataclasses
from typing import Any

import optax
from jax.sharding import Mesh

from fleetjax.strategy import DistributedStrategy, Strategy


@dataclasses.dataclass(frozen=True)
class DistributedOptimizer:
    """An optax `GradientTransformation` together with its strategy (and mesh, if fixed).

    It has `init` and `update` like any optax transformation, so it chains with others;
    `make_train_step` reads `strategy` and `mesh` from it when they are not given.
    """

    inner: optax.GradientTransformation
    strategy: DistributedStrategy | Strategy
    mesh: Mesh | None = None

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
    """Bind `optimizer` (any optax transformation) to a copy of `strategy` (default: plain DP).

    Raises:
      TypeError: if `optimizer` is not an optax transformation or `strategy` not a strategy.
    """
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            "optimizer must be an optax GradientTransformation (with init and update), "
            f"got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, DistributedOptimizer):
        optimizer = optimizer.inner
    strategy = DistributedStrategy() if strategy is None else strategy
    if not isinstance(strategy, (DistributedStrategy, Strategy)):
        raise TypeError(
            "strategy must be a fleetjax.DistributedStrategy or fleetjax.Strategy, "
            f"got {type(strategy).__name__}"
        )
    return DistributedOptimizer(optimizer, strategy.__copy__(), mesh)
