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
from fleetjax.vocabulary import AXES, MESH_ORDER, PADDLE_EXPERT_ORDER, PADDLE_ORDER, REQUIRED_AXES

# The degrees hybrid_configs reads as they are: each one a mesh axis's size (`cp` and `ep` are
# carved out of the sharding group, below).
_PLAIN = ("dp", "sharding", "pp", "sep", "mp")


def strategy_degrees(strategy: DistributedStrategy | Strategy) -> Degrees:
    """The mesh degrees a strategy asks for (`dp` may be -1: all devices left).

    `DistributedStrategy` reads `hybrid_configs`, or `sharding_configs` when `sharding` is on,
    or `tensor_parallel_configs` when `tensor_parallel` is on; a degree set in two of them to
    different values is an error. `Strategy` reads `sharding.degree` and `pipeline.pp_degree`
    of the enabled sections.

    As in Paddle, the context-parallel group is carved out of the sharding group:
    `sharding_degree` = `cp_sharding_degree` x `cp_degree`, and the mesh's `sharding` axis has
    `cp_sharding_degree` devices. So is the expert group (`_expert_parallel`): the mesh's `ep`
    axis has `sharding_degree / moe_sharding_degree` devices and `sharding` keeps
    `moe_sharding_degree`.
    """
    if isinstance(strategy, Strategy):
        return Degrees(
            sharding=strategy.sharding.degree if strategy.sharding.enable else 1,
            pp=strategy.pipeline.pp_degree if strategy.pipeline.enable else 1,
        )
    hybrid = strategy.hybrid_configs
    keys = {a: f"{a}_degree" for a in _PLAIN}
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
    degrees["sharding"], degrees["ep"] = _expert_parallel(hybrid, degrees)
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


def _expert_parallel(hybrid: Any, degrees: dict[str, int]) -> tuple[int, int]:
    """(the mesh's sharding axis, its ep axis) from Paddle's `ep_degree` and
    `moe_sharding_degree`, with Paddle's conditions (`EPHybridCommunicateGroup`).

    Paddle's expert group folds over the sharding x mp ranks: `ep_degree` x
    `moe_sharding_degree` = `sharding_degree` x `mp_degree`, the experts spanning the
    fastest-varying `dense_sharding` (= `sharding_degree / moe_sharding_degree`) x `mp` ranks.
    So the mesh's `ep` axis is `dense_sharding` (the experts split over `ep` x `mp`:
    `fleetjax.vocabulary.EXPERT_AXES`) and its `sharding` axis `moe_sharding` (the experts'
    ZeRO group).

    Raises:
      ValueError: with Paddle's messages, where sep_degree or cp_degree is above 1 with
        ep_degree (Paddle: "sep_degree ... must be 1 in MoE"; cp's group is carved out of the
        sharding group too), where moe_sharding_degree does not divide the sharding degree or
        the expert group does not fill the sharding x mp ranks (Paddle: "Mismatch
        world_size"), and where moe_sharding_degree is above 1 without ep_degree (Paddle
        ignores it).
    """
    ep, moe, sharding = hybrid["ep_degree"], hybrid["moe_sharding_degree"], degrees["sharding"]
    if ep == 1:
        if moe != 1:
            raise ValueError(
                f"hybrid_configs.moe_sharding_degree={moe} needs ep_degree > 1: it is the "
                "experts' sharding group, carved out of the sharding group with the expert "
                "group (Paddle ignores it without ep_degree)"
            )
        return sharding, 1
    if degrees["sep"] != 1 or degrees["cp"] != 1:
        raise ValueError(
            f"sep_degree {degrees['sep']} and dp_degree {max(degrees['dp'], 1)} must be 1 in "
            f"MoE. (Paddle's condition for ep_degree={ep}; fleetjax lifts it for dp_degree, "
            f"not for sep_degree, nor for cp_degree={degrees['cp']}, whose group is carved "
            "out of the sharding group as the expert group is)"
        )
    mp, dense = degrees["mp"], sharding // moe if sharding % moe == 0 else 0
    if dense * mp != ep:
        dense_world, moe_world = degrees["pp"] * sharding * mp, degrees["pp"] * moe * ep
        raise ValueError(
            f"Mismatch world_size:{dense_world}, moe_world_size:{moe_world}. "
            f"(hybrid_configs.ep_degree={ep} x moe_sharding_degree={moe} must equal "
            f"sharding_degree x mp_degree = {sharding} x {mp} = {sharding * mp}, with "
            f"moe_sharding_degree dividing sharding_degree: as in Paddle, the expert group "
            f"folds over the sharding x mp ranks of a replica, ep_degree = sharding_degree / "
            f"moe_sharding_degree x mp_degree)"
        )
    return moe, dense


def set_degrees(strategy: DistributedStrategy | Strategy) -> tuple[str, ...]:
    """The axes whose degree `hybrid_configs` sets explicitly (`dp=-1` counts as unset; `ep`
    where `ep_degree` is set)."""
    if isinstance(strategy, Strategy):
        return ()
    hybrid = strategy.hybrid_configs
    return tuple(
        a
        for a in AXES
        if hybrid.is_set(f"{a}_degree") and not (a == "dp" and hybrid[f"{a}_degree"] == -1)
    )


def strategy_order(strategy: DistributedStrategy | Strategy) -> tuple[str, ...]:
    """The mesh axis order, slowest-varying first, from Paddle's `hybrid_configs["order"]`, with
    the optional axes (`ep`, `sep`, `cp`) whose degree is above 1.

    With `ep_degree > 1` Paddle's order must name all eight of its axes (Paddle builds its
    expert topology only then, and silently ignores `ep_degree` otherwise): the mesh takes
    `moe_sharding`'s place for its `sharding` axis and `ep`'s for its `ep` axis (Paddle's
    `sharding` group is `sharding` x `ep`, no axis of its own).

    Raises:
      ValueError: for an order without the expert names where `ep_degree > 1`.
    """
    if not isinstance(strategy, DistributedStrategy):
        return check_order(PADDLE_ORDER)
    degrees, hybrid = strategy_degrees(strategy), strategy.hybrid_configs
    order = list(hybrid["order"])
    if hybrid["ep_degree"] > 1:
        names = (*PADDLE_ORDER, *PADDLE_EXPERT_ORDER)
        if sorted(order) != sorted(names):
            raise ValueError(
                f"hybrid_configs.order must name all of {list(names)} with "
                f"ep_degree={hybrid['ep_degree']} (Paddle builds its expert topology only from "
                f"such an order, and ignores ep_degree otherwise), got {order}; e.g. Paddle's "
                f"{['sharding', 'moe_sharding', 'pp', 'sep', 'cp', 'dp', 'ep', 'mp']}"
            )
        mesh = [{"moe_sharding": "sharding"}.get(a, a) for a in order if a != "sharding"]
    else:
        mesh = [a for a in order if a not in PADDLE_EXPERT_ORDER]
    optional = tuple(a for a in MESH_ORDER if a not in REQUIRED_AXES and getattr(degrees, a) > 1)
    return check_order(mesh, optional)


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
        d.dp,
        d.sharding,
        d.pp,
        d.mp,
        order=plan.order,
        devices=devices,
        sep=d.sep,
        cp=d.cp,
        ep=d.ep,
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
