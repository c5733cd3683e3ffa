"""`fleet.distributed_optimizer`: the optimizer a strategy trains with, bound to its plan and
mesh."""

from __future__ import annotations

import dataclasses
from typing import Any

import optax
from jax.sharding import Mesh

from fleetjax.mesh import data_axes, data_parallel_size
from fleetjax.optimizers import rebuild
from fleetjax.plan import Plan, check_mesh, mesh_for, prepare, read_plan
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.transforms import gradient_merge

__all__ = ["DistributedOptimizer", "assemble", "bind", "distributed_optimizer"]


@dataclasses.dataclass(frozen=True)
class DistributedOptimizer:
    """An optax transformation bound to the strategy and mesh it runs under.

    Attributes:
      rebuilt: the optimizer that trains: the user's as the strategy rebuilds it (`assemble`):
        Paddle's rebuild of it (LARS from a Momentum, LAMB from an Adam, DGC, LocalSGD,
        Geo-SGD) or the user's itself, under gradient merge across calls stepping on every
        k-th call. It has `init` and `update` like any optax transformation, and is what a
        train step of it trains with.
      strategy: a copy of the strategy.
      mesh: the device mesh.
      user: the optimizer the user gave.
      plan: the strategy's plan.
    """

    rebuilt: optax.GradientTransformation
    strategy: DistributedStrategy | Strategy
    mesh: Mesh
    user: optax.GradientTransformation
    plan: Plan

    @property
    def init(self) -> Any:
        return self.rebuilt.init

    @property
    def update(self) -> Any:
        return self.rebuilt.update

    @classmethod
    def _elsewhere(cls, name: str) -> str | None:
        """Where to find the method `name` that this class lacks and a subclass adds (None: no
        subclass adds it); a subclass that adds methods says where to find it."""
        return None

    def __getattr__(self, name: str) -> Any:
        for subclass in type(self).__subclasses__():
            if (where := subclass._elsewhere(name)) is not None:
                raise AttributeError(f"{type(self).__name__} has no {name}(): {where}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def bind(
    optimizer: optax.GradientTransformation,
    strategy: DistributedStrategy | Strategy | None = None,
    mesh: Mesh | None = None,
) -> DistributedOptimizer:
    """`optimizer` bound to `strategy` and `mesh`; a `DistributedOptimizer` given keeps what it
    was bound to where those are not given, and is rebuilt only if they differ."""
    if isinstance(optimizer, DistributedOptimizer):
        strategy = optimizer.strategy if strategy is None else strategy
        mesh = optimizer.mesh if mesh is None else mesh
        if strategy == optimizer.strategy and mesh == optimizer.mesh:
            return optimizer
        optimizer = optimizer.user
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            "optimizer must be an optax GradientTransformation (with init and update), "
            f"got {type(optimizer).__name__}"
        )
    strategy = DistributedStrategy() if strategy is None else strategy
    if mesh is None:  # the process's mesh: its flags first (fleet.init did both already)
        plan, _ = prepare(strategy)
        mesh = mesh_for(plan)
    else:  # the backend started already: a given mesh leaves XLA_FLAGS alone
        plan = read_plan(strategy)
        check_mesh(plan, mesh)
    return DistributedOptimizer(
        assemble(optimizer, plan, mesh), strategy.__copy__(), mesh, optimizer, plan
    )


def assemble(
    optimizer: optax.GradientTransformation, plan: Plan, mesh: Mesh
) -> optax.GradientTransformation:
    """The optimizer that trains under `plan` on `mesh`: the optimizer switch's rebuild (or
    wrapper) of the user's `optimizer` (`fleetjax.optimizers.rebuild`), and around it gradient
    merge across calls (`gradient_merge.across_calls`), which steps it on every k-th call."""
    if plan.optimizer is not None:
        switch = plan.optimizer
        dp, axes = data_parallel_size(mesh), data_axes(mesh)
        optimizer = rebuild(optimizer, switch.name, switch.configs, dp, axes)
    merge = plan.gradient_merge
    if merge is not None and not merge.in_step:
        optimizer = gradient_merge.across_calls(optimizer, merge.k_steps, merge.avg)
    return optimizer


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
    return bind(optimizer, strategy, mesh)
