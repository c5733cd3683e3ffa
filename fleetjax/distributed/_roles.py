"""What each dimension of a user's `ProcessMesh` does, read from how the user uses it, and the
train step's mesh that follows: the one translation from Paddle's auto-parallel request to
fleetjax's core inputs.

A `ProcessMesh`'s dimensions have the user's names; the train step's mesh names its axes by
role (`fleetjax.vocabulary`). A dimension's role is how it is used:

* the dimension `shard_dataloader` (or a batch placement `Shard(0)`) splits the batch over: a
  data axis, `sharding` if a `ShardingStage` names it, else `dp`;
* the dimension a `ShardingStage` names: `sharding` (ZeRO shards over it; the batch is split
  over it too);
* a dimension parameters are `Shard`ed over: `mp`;
* the dimension `pp_config`'s `split_spec` cuts: `pp`;
* none of these: a data axis; the batch is split over it (Paddle would compute the same on
  every device along it).

`roles` reads them and refuses a dimension with two roles; `step_mesh` builds the step's mesh
over the same devices in the same order (a `MeshView` of the `ProcessMesh`), and
`param_specs` turns each parameter's placements into its `PartitionSpec` on it, through
`partition_spec`, the one rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from fleetjax.auto_parallel import (
    MeshView,
    Placement,
    ProcessMesh,
    Replicate,
    partition_spec,
    placements_of,
    process_mesh_of,
    register_view,
)
from fleetjax.vocabulary import AXES, REQUIRED_AXES

__all__ = ["Roles", "Uses", "param_specs", "roles", "step_mesh", "tensor_placements"]


@dataclasses.dataclass(frozen=True)
class Uses:
    """How a training run uses the dimensions of its `ProcessMesh`, each with what uses it
    (for the messages).

    Attributes:
      data: dimension -> what splits the batch over it ("shard_dataloader", "the model's
        argument 0", ...).
      weights: dimension -> the first parameter `Shard`ed over it.
      sharding: the dimension a `ShardingStage` names (and who names it), or None.
      pipeline: the dimension `split_spec` cuts into stages, or None.
    """

    data: Mapping[str, str] = dataclasses.field(default_factory=dict)
    weights: Mapping[str, str] = dataclasses.field(default_factory=dict)
    sharding: tuple[str, str] | None = None
    pipeline: str | None = None


@dataclasses.dataclass(frozen=True)
class Roles:
    """Each mesh dimension's axis in the train step's mesh (`axes`, in dimension order)."""

    mesh: ProcessMesh
    axes: tuple[str, ...]

    def axis(self, dim: str) -> str:
        return self.axes[self.mesh.dim_names.index(dim)]


def roles(mesh: ProcessMesh, uses: Uses) -> Roles:
    """Each dimension's role (see the module's table), as the step's axis name.

    Raises:
      ValueError: naming the dimension and its two roles where one dimension is used twice, the
        dimensions where more dimensions than fleetjax's axes take one role (two `mp`, three
        data dimensions), or a dimension the uses name that `mesh` does not have.
    """
    names = mesh.dim_names
    for dim in (*uses.data, *uses.weights, *(u[0] for u in [uses.sharding] if u), uses.pipeline):
        if dim is not None and dim not in names:
            raise ValueError(f"{dim!r} is not a dimension of {mesh}: its dimensions are {names}")
    taken: dict[str, tuple[str, str]] = {}  # dim -> (role, why)

    def take(dim: str, role: str, why: str) -> None:
        if dim in taken and taken[dim][0] != role:
            raise ValueError(
                f"mesh dim {dim!r} is used in two roles: {taken[dim][0]} ({taken[dim][1]}) and "
                f"{role} ({why}); fleetjax gives each mesh dimension one role (a separate dim "
                "for each: e.g. ProcessMesh(..., dim_names=['dp', 'mp']))"
            )
        taken.setdefault(dim, (role, why))

    if uses.pipeline is not None:
        take(uses.pipeline, "pp", "pp_config's split_spec cuts the model into stages over it")
    for dim, tensor in uses.weights.items():
        take(dim, "mp", f"{tensor} is Shard()ed over it")
    if uses.sharding is not None:
        take(uses.sharding[0], "sharding", f"{uses.sharding[1]} shards the optimizer over it")
    for dim, what in uses.data.items():
        role = "sharding" if dim in taken and taken[dim][0] == "sharding" else "dp"
        take(dim, "data" if role == "dp" else role, f"{what} splits the batch")
    _check_one_each(taken, "mp", "tensor-parallel (mp) axis: parameters are Shard()ed over")
    for dim in names:  # a dimension no one uses: the batch is split over it
        if dim not in taken and mesh.get_dim_size(dim) > 1:
            taken[dim] = ("data", "nothing else uses it")
    data = [d for d in names if taken.get(d, ("",))[0] == "data"]
    free = [a for a in ("dp", "sharding") if a not in {r for r, _ in taken.values()}]
    if len(data) > len(free):
        raise ValueError(
            f"the batch is split over mesh dims {data} ({', '.join(taken[d][1] for d in data)}), "
            f"but fleetjax's data axes left are {free}: a mesh dimension is data-parallel, "
            "ZeRO's (ShardingStage), tensor-parallel (parameters Shard()ed over it) or a "
            "pipeline's; merge data-parallel dimensions into one"
        )
    axis = {d: free[data.index(d)] for d in data}
    axis |= {d: role for d, (role, _) in taken.items() if role != "data"}
    # Dimensions of one device that no one uses take fleetjax's axes left (they split nothing).
    spare = iter(a for a in AXES if a not in axis.values())
    return Roles(mesh, tuple(axis.get(d) or next(spare) for d in names))


def _check_one_each(taken: Mapping[str, tuple[str, str]], role: str, what: str) -> None:
    dims = [d for d, (r, _) in taken.items() if r == role]
    if len(dims) > 1:
        raise ValueError(
            f"mesh dims {dims} would each be fleetjax's {what} them ("
            + "; ".join(f"{d}: {taken[d][1]}" for d in dims)
            + "); fleetjax has one such axis: Shard() parameters over one mesh dimension"
        )


def step_mesh(roles: Roles) -> MeshView:
    """The train step's mesh for `roles`: the `ProcessMesh`'s devices in its order, each
    dimension named by its role, with fleetjax's other axes of one device; registered as a
    view of the `ProcessMesh` (arrays on it read as the user placed them)."""
    pm = roles.mesh
    others = [a for a in REQUIRED_AXES if a not in roles.axes]
    devices = np.asarray(pm.jax_mesh.devices).reshape((*pm.shape, *[1] * len(others)))
    names = (*roles.axes, *others)
    mesh = Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))
    return register_view(MeshView(pm, mesh, roles.axes))


def tensor_placements(x: Any, mesh: ProcessMesh, what: str) -> list[Placement]:
    """`x`'s placements on `mesh` (`Replicate()` everywhere for an array no mesh places).

    Raises:
      ValueError: if `x` is placed on another mesh (a pipeline stage's sub-mesh: fleetjax's
        pipeline is `parallelize`'s `split_spec`).
    """
    held = process_mesh_of(x) if isinstance(x, jax.Array) else None
    if held is None:
        return [Replicate() for _ in mesh.dim_names]
    if held != mesh or held.dim_names != mesh.dim_names:
        raise ValueError(
            f"{what} is on {held}, the training run on {mesh}: fleetjax trains on one "
            "ProcessMesh (its pipeline is one SPMD program, so layers placed on sub-meshes of "
            "a pp dimension are not read as stages); place every tensor on one mesh and cut "
            "the stages with dist.parallelize(model, config={'pp_config': {'split_spec': "
            "...}})"
        )
    return placements_of(x)


def param_specs(
    params: Mapping[str, Any], view: MeshView, placements: Mapping[str, Sequence[Placement]]
) -> dict[str, PartitionSpec]:
    """Each parameter's `PartitionSpec` on the step's mesh, from its placements (by dotted
    name), through `partition_spec`.

    Raises:
      ValueError: for a parameter that is a pending sum (`Partial`), naming it.
    """
    specs = {}
    for name, x in params.items():
        held = placements[name]
        if any(p.is_partial() for p in held):
            raise ValueError(
                f"parameter {name} is placed {held}: a parameter is a value, not a pending sum "
                "(Partial); place it with Shard() or Replicate()"
            )
        spec = partition_spec(held, view.axes, view.process_mesh.shape, np.shape(x), name)
        specs[name] = spec
    return specs
