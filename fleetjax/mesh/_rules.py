"""Placement rules on the mesh: the batch over the data axes, ZeRO's split, layout constraints."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from fleetjax.vocabulary import DATA_AXES


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The data-parallel axes that `mesh` has."""
    return tuple(a for a in DATA_AXES if a in mesh.axis_names)


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch is split: the product of the data axes' sizes."""
    return math.prod(mesh.shape[a] for a in data_axes(mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The batch's leading dimension split over the data axes."""
    return NamedSharding(mesh, PartitionSpec(data_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device."""
    return NamedSharding(mesh, PartitionSpec())


def constrain(tree: Any, shardings: Any) -> Any:
    """Every array in `tree` laid out as `shardings` says: one `NamedSharding` (or a
    `PartitionSpec` over the context mesh: inside `shard_map` or `jax.set_mesh`) for all, or a
    pytree of them shaped like `tree`.

    On `Auto` axes this is `jax.lax.with_sharding_constraint`, a layout the compiler then
    follows; on `Explicit` axes the layout is part of the array's type (there a sharding
    constraint only asserts it), so it is `jax.sharding.reshard`.
    """
    context = jax.sharding.get_abstract_mesh()

    def one(x: jax.Array, sharding: NamedSharding | PartitionSpec) -> jax.Array:
        spec = sharding.spec if isinstance(sharding, NamedSharding) else sharding
        # Under a context mesh (set_mesh, shard_map's manual axes, auto_axes) the layout is
        # named by its spec, which the context resolves with its own axis types.
        mesh, target = (sharding.mesh, sharding) if context.empty else (context, spec)
        types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        if any(types[a] == AxisType.Explicit for a in spec_axes(spec)):
            return jax.sharding.reshard(x, target)
        return jax.lax.with_sharding_constraint(x, target)

    if isinstance(shardings, NamedSharding | PartitionSpec):
        return jax.tree.map(lambda x: one(x, shardings), tree)
    return jax.tree.map(one, tree, shardings)


def spec_axes(spec: PartitionSpec) -> tuple[str, ...]:
    """The mesh axes `spec` splits over."""
    return tuple(a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))


# Tensors smaller than this stay whole under ZeRO: their shards would save less memory than the
# collectives to rebuild them cost (biases, norms, scalars).
ZERO_MIN_ELEMENTS = 4096


def zero_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """`spec` with its largest dimension that splits evenly also split over the `sharding`
    axis (ZeRO's placement rule).

    A dimension no other axis splits is preferred; failing that, one already split (by `mp`)
    whose size divides by both. Tensors under `ZERO_MIN_ELEMENTS` elements, or with no
    dimension that divides, keep `spec`.
    """
    degree = mesh.shape.get("sharding", 1)
    if degree == 1 or math.prod(shape) < ZERO_MIN_ELEMENTS:
        return spec
    entries = [*spec, *[None] * (len(shape) - len(spec))]
    largest_first = sorted(range(len(shape)), key=lambda d: -shape[d])

    def axes(entry: Any) -> tuple[str, ...]:
        return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)

    for already_split in (False, True):
        for d in largest_first:
            existing = axes(entries[d])
            if bool(existing) != already_split:
                continue
            ways = math.prod(mesh.shape[a] for a in existing) * degree
            if shape[d] % ways == 0:
                entries[d] = (*existing, "sharding") if existing else "sharding"
                return PartitionSpec(*entries)
    return spec


def manual_axes(mesh: Mesh, axes: Iterable[str]) -> frozenset[str]:
    """The axes a `shard_map` over `axes` takes in hand (its `axis_names`): `axes`, and every
    axis of size 1, which has nothing to partition. Keeping those manual too keeps XLA:CPU
    compiling bfloat16 all-reduces (jaxlib 0.10.2 aborts in AllReducePromotion on a bf16 psum
    inside a partially manual shard_map)."""
    return frozenset(axes) | {a for a in mesh.axis_names if mesh.shape[a] == 1}


def restrict(spec: PartitionSpec, axes: tuple[str, ...]) -> PartitionSpec:
    """`spec` with only the entries for mesh `axes` (what a `shard_map` over them sees)."""

    def entry(e: Any) -> Any:
        kept = tuple(a for a in spec_axes(PartitionSpec(e)) if a in axes)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return PartitionSpec(*(entry(e) for e in spec))
