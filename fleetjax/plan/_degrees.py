"""The mesh a strategy asks for: its degrees and axis order, and the mesh built from them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from fleetjax._warnings import warn_once
from fleetjax.mesh import build_mesh, check_order
from fleetjax.plan._values import Degrees, Plan
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.vocabulary import AXES, PADDLE_ORDER, SEQUENCE_AXES

# hybrid_configs degrees of axes fleetjax's mesh does not have yet.
_NO_AXIS = ("ep_degree", "moe_sharding_degree")


def strategy_degrees(strategy: DistributedStrategy | Strategy) -> Degrees:
    """The mesh degrees a strategy asks for (`dp` may be -1: all devices left).

    `DistributedStrategy` reads `hybrid_configs`, or `sharding_configs` when `sharding` is on,
    or `tensor_parallel_configs` when `tensor_parallel` is on; a degree set in two of them to
    different values is an error. `Strategy` reads `sharding.degree` and `pipeline.pp_degree`
    of the enabled sections.

    As in Paddle, the context-parallel group is carved out of the sharding group:
    `sharding_degree` = `cp_sharding_degree` x `cp_degree`, and the mesh's `sharding` axis has
    `cp_sharding_degree` devices.
    """
    if isinstance(strategy, Strategy):
        return Degrees(
            sharding=strategy.sharding.degree if strategy.sharding.enable else 1,
            pp=strategy.pipeline.pp_degree if strategy.pipeline.enable else 1,
        )
    hybrid = strategy.hybrid_configs
    for name in _NO_AXIS:
        if hybrid[name] != 1:
            raise NotImplementedError(
                f"hybrid_configs.{name}={hybrid[name]}: fleetjax's mesh has no such axis yet; "
                f"its axes are {', '.join(AXES)}"
            )
    keys = {a: f"{a}_degree" for a in AXES if a != "cp"}
    sources = [("hybrid_configs", hybrid, keys)]
    if strategy.sharding:
        keys = {a: k for a, k in keys.items() if a != "sep"}  # sharding_configs has no sep
        sources.append(("sharding_configs", strategy.sharding_configs, keys))
    if strategy.tensor_parallel:
        keys = {"mp": "tensor_parallel_degree"}
        sources.append(("tensor_parallel_configs", strategy.tensor_parallel_configs, keys))
    degrees = Degrees()._asdict()
    where: dict[str, str] = {}
    for label, config, keys in sources:
        for axis, key in keys.items():
            if not config.is_set(key):
                continue
            value = config[key]
            if axis in where and value != degrees[axis]:
                raise ValueError(
                    f"the {axis} degree is set twice: {where[axis]}={degrees[axis]} "
                    f"but {label}.{key}={value}"
                )
            degrees[axis], where[axis] = value, f"{label}.{key}"
    if strategy.sharding and "sharding" not in where:
        degrees["sharding"] = strategy.sharding_configs["sharding_degree"]  # Paddle's 8
    degrees["sharding"], degrees["cp"] = _context_parallel(hybrid, degrees["sharding"])
    return Degrees(**degrees)


def _context_parallel(hybrid: Any, sharding: int) -> tuple[int, int]:
    """(the mesh's sharding axis, its cp axis) from Paddle's sharding_degree and
    `hybrid_configs`' cp_degree and cp_sharding_degree.

    Raises:
      ValueError: if cp_degree does not divide sharding_degree, or cp_sharding_degree is set
        to another value than sharding_degree / cp_degree.
    """
    cp = hybrid["cp_degree"]
    if sharding % cp:
        raise ValueError(
            f"hybrid_configs.cp_degree={cp} must divide the sharding degree ({sharding}): as "
            "in Paddle, the context-parallel group is carved out of the sharding group "
            "(cp_sharding_degree = sharding_degree / cp_degree); set sharding_degree to a "
            f"multiple of {cp}"
        )
    if hybrid.is_set("cp_sharding_degree") and hybrid["cp_sharding_degree"] != sharding // cp:
        raise ValueError(
            f"hybrid_configs.cp_sharding_degree={hybrid['cp_sharding_degree']} must be "
            f"sharding_degree / cp_degree = {sharding} / {cp} = {sharding // cp}"
        )
    return sharding // cp, cp


def set_degrees(strategy: DistributedStrategy | Strategy) -> tuple[str, ...]:
    """The axes whose degree `hybrid_configs` sets explicitly (`dp=-1` counts as unset)."""
    if isinstance(strategy, Strategy):
        return ()
    hybrid = strategy.hybrid_configs
    return tuple(
        a
        for a in AXES
        if hybrid.is_set(f"{a}_degree") and not (a == "dp" and hybrid[f"{a}_degree"] == -1)
    )


def strategy_order(strategy: DistributedStrategy | Strategy) -> tuple[str, ...]:
    """The mesh axis order, slowest-varying first (Paddle's `hybrid_configs["order"]`), with
    the sequence axes whose degree is above 1."""
    if isinstance(strategy, DistributedStrategy):
        degrees = strategy_degrees(strategy)
        sequence = tuple(a for a in SEQUENCE_AXES if getattr(degrees, a) > 1)
        return check_order(strategy.hybrid_configs["order"], sequence)
    return check_order(PADDLE_ORDER)


def mesh_for(plan: Plan, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The mesh `plan` asks for, over `devices` (default: all, grouped by process). A pipeline
    of one stage (the pp degree left at 1) warns once, naming the field that sets it."""
    if plan.pipeline is not None and plan.degrees.pp == 1:
        field = (
            "Strategy.pipeline.pp_degree"
            if plan.strategy == "Strategy"
            else 'DistributedStrategy.hybrid_configs["pp_degree"]'
        )
        warn_once(
            f"the strategy turns the pipeline on, but {field} is 1 (not set): the pipeline has "
            "one stage, so it only cuts the batch into micro-batches. Set pp_degree to the "
            "number of stages, or pass a mesh with a pp axis (Paddle's auto-parallel takes "
            "the stages from the model's process meshes)"
        )
    d = plan.degrees
    return build_mesh(
        d.dp, d.sharding, d.pp, d.mp, order=plan.order, devices=devices, sep=d.sep, cp=d.cp
    )


def check_mesh(plan: Plan, mesh: Mesh) -> None:
    """`mesh` must use fleetjax's axis names and have the sizes `plan` asks for.

    Raises:
      ValueError: naming the axis, the degree asked for and the mesh's size.
    """
    unknown = [a for a in mesh.axis_names if a not in AXES]
    if unknown:
        raise ValueError(
            f"mesh axes {unknown} are not fleetjax axes; name mesh axes from {', '.join(AXES)}"
        )
    for axis, degree in plan.degrees._asdict().items():
        size = mesh.shape.get(axis, 1)
        asked = degree != (-1 if axis == "dp" else 1)
        if asked and degree != size:
            raise ValueError(
                f"the strategy asks for {axis} degree {degree}, but the mesh's {axis} axis "
                f"has size {size}"
            )
