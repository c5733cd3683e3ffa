"""The plan: everything a strategy asks for, read once into plain values.

    strategy --read_plan--> Plan --> mesh, placement, gradient chain, optimizer, XLA flags

`prepare` reads a strategy for the process: the plan, then its XLA flags in effect, before the
mesh (`mesh_for`) starts JAX's backend.

`read_plan` is the only code in fleetjax that reads a strategy object; everything downstream
takes the `Plan` (or the plain values in it).
"""

from fleetjax.plan._degrees import check_mesh, mesh_for, strategy_degrees
from fleetjax.plan._knobs import XLA_FUSES
from fleetjax.plan._prepare import prepare
from fleetjax.plan._read import OPTIMIZER_SWITCHES, PLANNED_SWITCHES, read_plan
from fleetjax.plan._values import (
    Amp,
    Degrees,
    GradientMerge,
    Hierarchical,
    LossScaling,
    NoEffect,
    OptimizerSwitch,
    ParameterServer,
    Pipeline,
    Plan,
    Recompute,
    SparseRuleConfig,
    SparseTableConfig,
)

__all__ = [
    "OPTIMIZER_SWITCHES",
    "PLANNED_SWITCHES",
    "XLA_FUSES",
    "Amp",
    "Degrees",
    "GradientMerge",
    "Hierarchical",
    "LossScaling",
    "NoEffect",
    "OptimizerSwitch",
    "ParameterServer",
    "Pipeline",
    "Plan",
    "Recompute",
    "SparseRuleConfig",
    "SparseTableConfig",
    "check_mesh",
    "mesh_for",
    "prepare",
    "read_plan",
    "strategy_degrees",
]
