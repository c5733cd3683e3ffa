"""Paddle's distributed tensors as `jax.Array`s: `shard_tensor`, `reshard`, `dtensor_from_fn`,
`dtensor_from_local` / `dtensor_to_local`, `unshard_dtensor`, and reading an array's placements
back (`placements_of`, `process_mesh_of`; Paddle's `t.placements` / `t.process_mesh`).

A distributed tensor is a `jax.Array` whose `NamedSharding` is its placements' `PartitionSpec`
on its `ProcessMesh`'s mesh: nothing else is recorded, so what `placements_of` reads is what
XLA holds, also for arrays a jitted function returns and, inside one, for traced values.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from fleetjax._warnings import warn_once
from fleetjax.auto_parallel._placements import (
    Placement,
    ReduceType,
    Replicate,
    check_placements,
    partition_spec,
    placements_of_spec,
    shard_axes,
)
from fleetjax.auto_parallel._process_mesh import ProcessMesh, known_mesh
from fleetjax.auto_parallel._reshard import Layout, compiled_transition, transition
from fleetjax.auto_parallel._views import view_of, views_of


def is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def sharding_of(x: Any) -> NamedSharding | None:
    """The `NamedSharding` that places `x`, where it says the placements (inside a traced
    function: an explicit mesh's, which the array's type records)."""
    if is_traced(x):
        sharding = jax.typeof(x).sharding
        explicit = isinstance(sharding, NamedSharding) and sharding.mesh.axis_names
        if explicit and all(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types):
            return sharding
        return None
    sharding = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
    return sharding if isinstance(sharding, NamedSharding) else None


def placements_of(x: Any) -> list[Placement] | None:
    """Paddle's `x.placements`: one placement per dimension of the array's mesh, read from its
    sharding (None for an array no mesh places)."""
    sharding = sharding_of(x)
    if sharding is None:
        return None
    view = view_of(sharding.mesh)
    if view is not None:  # a train step's array, read as the user placed it
        return placements_of_spec(view.to_user(sharding.spec), view.process_mesh.dim_names)
    return placements_of_spec(sharding.spec, list(sharding.mesh.axis_names))


def process_mesh_of(x: Any) -> ProcessMesh | None:
    """Paddle's `x.process_mesh`: the `ProcessMesh` of the devices that hold `x` (None for an
    array no mesh places). Inside a traced function the array's type names its mesh's axes,
    not its devices: the ProcessMesh made with those axes (an error if several were)."""
    sharding = sharding_of(x)
    if sharding is None:
        return None
    view = view_of(sharding.mesh)
    if view is not None:
        return view.process_mesh
    if isinstance(sharding.mesh, AbstractMesh):
        return known_mesh(sharding.mesh)
    return ProcessMesh.from_jax(sharding.mesh)


def _spec(mesh: ProcessMesh, placements: Sequence[Placement], shape: Sequence[int], what: str):
    if not isinstance(mesh, ProcessMesh):
        raise TypeError(f"{what}: mesh must be a ProcessMesh, got {mesh!r}")
    return partition_spec(placements, mesh.dim_names, mesh.shape, tuple(shape), what)


def whole_spec(spec: PartitionSpec) -> PartitionSpec:
    """`spec` with its pending sums done (each unreduced axis replicated)."""
    return PartitionSpec(*spec.partitions)


def average_parts(placements: Sequence[Placement], sizes: Sequence[int]) -> int:
    """How many parts a `Partial(kRedAvg)` averages: the sum of the parts over it is the
    average fleetjax holds."""
    n = 1
    for size, p in zip(sizes, placements, strict=True):
        if p.is_partial() and p.reduce_type() == ReduceType.kRedAvg:
            n *= size
    return n


def place_as(x: Any, target: Mesh | AbstractMesh, spec: PartitionSpec) -> jax.Array:
    """`x` (an array, traced or not, or host data) placed as `spec` on `target` (abstract
    inside a traced function only)."""
    source = sharding_of(x)
    rank = np.ndim(x)
    abstract = target if isinstance(target, AbstractMesh) else target.abstract_mesh
    same_mesh = source is not None and source.mesh in (target, abstract)
    if same_mesh and Layout.of(source.spec, rank) == Layout.of(spec, rank):
        return x
    if is_traced(x):
        if source is None and (constrained := _in_train_step(x, target, spec)) is not None:
            return constrained
        if source is not None and source.mesh != abstract:
            raise ValueError(
                f"inside a traced function an array moves within its mesh only: it is on "
                f"{dict(source.mesh.shape)}, the target on {dict(target.shape)} (move it "
                "outside the function)"
            )
        if source is None:
            x = jax.sharding.reshard(x, NamedSharding(target, PartitionSpec()))
        from_spec = source.spec if source is not None else PartitionSpec()
        return transition(target, from_spec, spec, rank)(x)
    if source is not None and source.mesh == target:
        return compiled_transition(target, source.spec, spec, rank)(x)
    if source is not None and source.spec.unreduced:  # sum the parts on their own mesh first
        x = compiled_transition(source.mesh, source.spec, whole_spec(source.spec), rank)(x)
    if spec.unreduced and not isinstance(x, jax.Array):
        return _pending_sum_from_host(np.asarray(x), target, spec)
    placed = jax.device_put(x, NamedSharding(target, whole_spec(spec)))
    if spec.unreduced:
        return compiled_transition(target, whole_spec(spec), spec, rank)(placed)
    return placed


def _pending_sum_from_host(x: np.ndarray, target: Mesh, spec: PartitionSpec) -> jax.Array:
    """Host data as a pending sum (Paddle's `Partial` from a whole tensor): the devices first
    along every unreduced axis hold their part, the others zeros; nothing is compiled."""
    sharding = NamedSharding(target, spec)
    index = NamedSharding(target, whole_spec(spec)).devices_indices_map(x.shape)
    axes = [target.axis_names.index(a) for a in spec.unreduced]
    first = {
        d for position, d in np.ndenumerate(target.devices) if all(position[a] == 0 for a in axes)
    }
    parts = [
        jax.device_put(x[index[d]] if d in first else np.zeros_like(x[index[d]]), d)
        for d in target.devices.flat
        if d.process_index == jax.process_index()
    ]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, parts)


def shard_tensor(
    data: Any,
    mesh: ProcessMesh,
    placements: Sequence[Placement],
    dtype: Any = None,
    place: Any = None,
    stop_gradient: bool | None = None,
) -> Any:
    """Paddle's `paddle.distributed.shard_tensor`: `data` placed on `mesh` as `placements`
    (one per mesh dimension), a `jax.Array` whose `NamedSharding` is their `PartitionSpec`.

    `data` may be host data, a `jax.Array` (on any devices; inside a traced function too), or
    an `nnx.Variable` (an `nnx.Param` stays one, its value placed), as Paddle's parameters stay
    parameters. Host data goes to each device's part directly. A `Partial` places the value on
    the first device along its mesh dimension and zeros on the others, as Paddle does.

    Args:
      data: the tensor.
      mesh: where it goes.
      placements: a `Shard(dim)`, `Replicate()` or `Partial()` per mesh dimension.
      dtype: a dtype to cast to first.
      place: Paddle's device; no JAX meaning (the mesh places the tensor), warns.
      stop_gradient: True warns: JAX takes gradients with respect to a function's arguments
        (`jax.grad`'s `argnums`, nnx's filters), not per tensor.

    Raises:
      TypeError, ValueError: for placements that do not fit the mesh or the tensor (naming
        the mesh dimension), or a layout no jax.Array holds (an uneven split, a
        `split_factor`), naming the dimension and sizes.
    """
    if isinstance(data, nnx.Variable):
        return data.replace(shard_tensor(data[...], mesh, placements, dtype, place, stop_gradient))
    if place is not None:
        warn_once(
            f"shard_tensor's place={place!r} has no JAX meaning (the mesh says which devices "
            "hold the tensor); ignored"
        )
    if stop_gradient:
        warn_once(
            "shard_tensor's stop_gradient=True has no JAX meaning: gradients are taken with "
            "respect to a function's arguments (jax.grad's argnums, nnx's filters); ignored"
        )
    x = data if isinstance(data, jax.Array) else np.asarray(data)
    if dtype is not None:
        x = x.astype(dtype)
    spec = _spec(mesh, placements, np.shape(x), "shard_tensor's data")
    return place_as(x, mesh.jax_mesh, spec)


def reshard(dist_tensor: Any, mesh: ProcessMesh, placements: Sequence[Placement]) -> jax.Array:
    """Paddle's `paddle.distributed.reshard`: `dist_tensor` placed anew, outside or inside a
    traced function.

    On its own mesh each mesh dimension that changes costs its one collective (`Shard`->
    `Replicate` an all-gather, `Partial`->`Replicate` an all-reduce, `Partial`->`Shard` a
    reduce-scatter, `Shard(i)`->`Shard(j)` an all-to-all; to `Shard` or to `Partial` from
    `Replicate` nothing), in one `jax.shard_map`; docs/auto_parallel.md has the table. To
    another mesh (outside a traced function) the values are copied over.
    """
    spec = _spec(mesh, placements, np.shape(dist_tensor), "reshard's dist_tensor")
    return place_as(dist_tensor, mesh.jax_mesh, spec)


def _in_train_step(x: Any, target: Mesh | AbstractMesh, spec: PartitionSpec) -> Any:
    """`x`, traced on a train step's `Auto` axes that view `target` (`MeshView`), laid out as
    `spec` says: a constraint, whose collectives XLA chooses, in a name scope that
    `fleetjax.explain` reads back; None where no view of `target` is being traced."""
    found = [
        v
        for v in views_of(jax.sharding.get_abstract_mesh())
        if target in (v.process_mesh.jax_mesh, v.process_mesh.jax_mesh.abstract_mesh)
    ]
    if not found:
        return None
    placements = placements_of_spec(spec, list(target.axis_names))
    if spec.unreduced:
        raise ValueError(
            f"a reshard to {placements} inside a train step: the step's axes are Auto, where "
            "a pending sum (Partial) is not a layout; reshard to Replicate() or Shard()"
        )
    with jax.named_scope(reshard_scope(placements)):
        return jax.lax.with_sharding_constraint(x, found[0].to_step(spec))


def reshard_scope(placements: Sequence[Placement]) -> str:
    """The name scope of a reshard to `placements` (`fleetjax.explain` reads it back)."""
    return "reshard->" + ",".join(map(repr, placements)).replace(" ", "")


def _dist_parts(x: Any, what: str) -> tuple[ProcessMesh, list[Placement]]:
    mesh, placements = process_mesh_of(x), placements_of(x)
    if mesh is None or placements is None:
        raise ValueError(
            f"{what} takes a distributed tensor (a jax.Array placed on a mesh), got "
            f"{type(x).__name__} {getattr(x, 'sharding', '')}".rstrip()
        )
    return mesh, placements


def unshard_dtensor(dist_tensor: Any) -> jax.Array:
    """Paddle's `paddle.distributed.unshard_dtensor`: the whole tensor, on every device of its
    mesh (Replicate on each mesh dimension)."""
    sharding = sharding_of(dist_tensor)
    if sharding is None:
        _dist_parts(dist_tensor, "unshard_dtensor")
    if is_traced(dist_tensor):
        rank = np.ndim(dist_tensor)
        spec = sharding.spec
        return transition(sharding.mesh, spec, PartitionSpec(*([None] * rank)), rank)(dist_tensor)
    mesh, placements = _dist_parts(dist_tensor, "unshard_dtensor")
    return reshard(dist_tensor, mesh, [Replicate()] * len(placements))


def dtensor_from_fn(
    fn: Callable[..., Any],
    mesh: ProcessMesh,
    placements: Sequence[Placement],
    *args: Any,
    **kwargs: Any,
) -> jax.Array:
    """Paddle's `paddle.distributed.dtensor_from_fn`: `fn(*args, **kwargs)` (e.g. `jnp.ones`,
    `shape=(4, 8)`) made where `placements` put it: each device computes its own part, the
    whole never lands on one device."""
    shape = jax.eval_shape(lambda: fn(*args, **kwargs))
    spec = _spec(mesh, placements, shape.shape, f"the value of {getattr(fn, '__name__', fn)}")
    if any(is_traced(a) for a in jax.tree.leaves((args, kwargs))):
        return place_as(fn(*args, **kwargs), mesh.jax_mesh, spec)
    whole = NamedSharding(mesh.jax_mesh, whole_spec(spec))
    made = jax.jit(lambda: fn(*args, **kwargs), out_shardings=whole)()
    return place_as(made, mesh.jax_mesh, spec) if spec.unreduced else made


def global_shape(
    placements: Sequence[Placement],
    names: Sequence[str],
    sizes: Sequence[int],
    local: Sequence[int],
    what: str,
) -> tuple[int, ...]:
    """The shape of a tensor whose parts have shape `local`, placed as `placements`."""
    placements = check_placements(placements, names, what)
    size_of = dict(zip(names, sizes, strict=True))
    return tuple(
        n * math.prod(size_of[a] for a in axes)
        for n, axes in zip(local, shard_axes(placements, names, local, what), strict=True)
    )


def _coordinates(mesh: ProcessMesh) -> list[tuple[int, ...]]:
    """Each process id's coordinates in the mesh, in mesh order."""
    return [tuple(int(c) for c in np.unravel_index(i, mesh.shape)) for i in range(mesh.size)]


def dtensor_from_local(
    local_tensor: Any, mesh: ProcessMesh, placements: Sequence[Placement]
) -> jax.Array:
    """Paddle's `dtensor_from_local` (`paddle.distributed.auto_parallel.api`): the distributed
    tensor whose parts are the local tensors, outside a traced function (inside one,
    `local_map` gives functions local values).

    One process drives several devices (Paddle: one rank each), so `local_tensor` is a list
    of the local tensors of `mesh.process_ids`, in that order (as `dtensor_to_local` gives
    them), or one tensor every device holds. Parts along a `Replicate` mesh dimension must be
    equal. A `Partial(kRedAvg)` is held as the sum of each part over their number.

    Raises:
      ValueError: for the wrong number of parts, parts of several shapes, or unequal parts
        where the placements say replicated.
    """
    if is_traced(local_tensor):
        raise ValueError("dtensor_from_local runs outside traced functions; use local_map there")
    many = isinstance(local_tensor, list | tuple)
    parts = [np.asarray(p) for p in (local_tensor if many else [local_tensor] * mesh.size)]
    if len(parts) != mesh.size:
        raise ValueError(
            f"dtensor_from_local: {len(parts)} local tensors for a mesh of {mesh.size} "
            f"processes {mesh.process_ids}; give one per process id, in that order"
        )
    shapes = sorted({p.shape for p in parts})
    if len(shapes) > 1:
        raise ValueError(f"dtensor_from_local: the local tensors have several shapes {shapes}")
    what = "dtensor_from_local's local_tensor"
    placements = check_placements(placements, mesh.dim_names, what)
    shape = global_shape(placements, mesh.dim_names, mesh.shape, parts[0].shape, what)
    spec = _spec(mesh, placements, shape, what)
    scale = average_parts(placements, mesh.shape)
    if scale > 1 and parts[0].dtype.kind not in "fc":
        raise ValueError(
            f"{what}: Partial(ReduceType.kRedAvg) of {parts[0].dtype} parts: fleetjax holds an "
            "average as the sum of each part over their number, which needs a float dtype"
        )
    coordinates = _coordinates(mesh)
    replicated = [i for i, p in enumerate(placements) if p.is_replicated()]
    first: dict[tuple[int, ...], int] = {}
    for n, c in enumerate(coordinates):
        key = tuple(v for i, v in enumerate(c) if i not in replicated)
        m = first.setdefault(key, n)
        if not np.array_equal(parts[m], parts[n]):
            raise ValueError(
                f"dtensor_from_local: processes {mesh.process_ids[m]} and {mesh.process_ids[n]} "
                f"hold different parts, but the placements {placements} replicate them"
            )
    devices = list(mesh.jax_mesh.devices.flat)
    arrays = [
        jax.device_put(p / scale if scale > 1 else p, d)
        for p, d in zip(parts, devices, strict=True)
        if d.process_index == jax.process_index()
    ]
    return jax.make_array_from_single_device_arrays(
        tuple(shape), NamedSharding(mesh.jax_mesh, spec), arrays
    )


def dtensor_to_local(dist_tensor: Any, mesh: ProcessMesh, placements: Sequence[Placement]) -> list:
    """Paddle's `dtensor_to_local` (`paddle.distributed.auto_parallel.api`): the local tensors
    of this process's devices in `mesh` (all of them in a one-process job), in the order of
    `mesh.process_ids`; a `Partial`'s parts as they are, still to be summed.

    Raises:
      ValueError: if `dist_tensor` is not placed on `mesh` as `placements` (reshard it first),
        or inside a traced function (use `local_map` there).
    """
    if is_traced(dist_tensor):
        raise ValueError("dtensor_to_local runs outside traced functions; use local_map there")
    held_mesh, held = _dist_parts(dist_tensor, "dtensor_to_local")
    wanted = _spec(mesh, placements, dist_tensor.shape, "dtensor_to_local's dist_tensor")
    if held_mesh != mesh or placements_of_spec(wanted, mesh.dim_names) != held:
        raise ValueError(
            f"dtensor_to_local: the tensor is on {held_mesh} as {held}, not on {mesh} as "
            f"{list(placements)}; reshard it first"
        )
    by_device = {s.device: s.data for s in dist_tensor.addressable_shards}
    return [by_device[d] for d in mesh.jax_mesh.devices.flat if d in by_device]


def install_tensor_attributes() -> None:
    """Give `jax.Array` (and traced values) Paddle's read-only `placements` and
    `process_mesh` (`placements_of`, `process_mesh_of`), unless JAX has such names itself."""
    for cls in (jax.Array, jax.core.Tracer):
        for name, read in (("placements", placements_of), ("process_mesh", process_mesh_of)):
            if name not in vars(cls):
                setattr(cls, name, property(read, doc=read.__doc__))
