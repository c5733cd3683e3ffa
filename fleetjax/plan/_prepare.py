"""Reading a strategy for a process: its plan, and its XLA flags in effect before anything
starts JAX's backend (XLA reads `XLA_FLAGS` once, then)."""

from __future__ import annotations

from fleetjax import xla_flags
from fleetjax.plan._read import read_plan
from fleetjax.plan._values import Plan
from fleetjax.strategy import DistributedStrategy, Strategy


def prepare(strategy: DistributedStrategy | Strategy) -> tuple[Plan, tuple[xla_flags.Flag, ...]]:
    """(`read_plan(strategy)`, the flags of it now in effect): its XLA flags put into effect
    (`fleetjax.xla_flags.apply`; a flag that comes too late warns). Call it before building the
    mesh, which starts the backend: `fleet.init` and a step built without a mesh do."""
    plan = read_plan(strategy)
    return plan, xla_flags.apply(plan.xla_flags, plan.strategy)
