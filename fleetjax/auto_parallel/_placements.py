"""Paddle's placements (`Shard`, `Replicate`, `Partial`) and the one rule that maps them onto
JAX: a list indexed by MESH dimension becomes a `PartitionSpec` indexed by TENSOR dimension.

Mesh dimension i with `Shard(d)` puts mesh axis i into the spec's entry for tensor dimension d;
several mesh dimensions on one tensor dimension (co-shard) go in `shard_order`, then mesh
order, major first, as Paddle lays them; `Replicate()` adds nothing; `Partial()` makes axis i
one of the spec's `unreduced` axes (JAX's pending sum, explicit mesh axes only).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from jax.sharding import PartitionSpec


class ReduceType(enum.IntEnum):
    """Paddle's `paddle.distributed.ReduceType`: the reduction a `Partial` placement waits for.

    JAX holds a pending sum only (an `unreduced` axis), so `Partial` of `kRedSum` and `kRedAvg`
    place (an average as the sum of each part over the number of parts); the others are
    refused where a tensor is placed.
    """

    kRedSum = 0
    kRedMax = 1
    kRedMin = 2
    kRedProd = 3
    kRedAvg = 4
    kRedAny = 5
    kRedAll = 6


HELD_REDUCTIONS = (ReduceType.kRedSum, ReduceType.kRedAvg)
_REDUCE_NAMES = {
    ReduceType.kRedSum: "SUM",
    ReduceType.kRedMax: "MAX",
    ReduceType.kRedMin: "MIN",
    ReduceType.kRedProd: "PROD",
    ReduceType.kRedAvg: "AVG",
    ReduceType.kRedAny: "ANY",
    ReduceType.kRedAll: "ALL",
}


class Placement:
    """Paddle's `paddle.distributed.Placement`: how a tensor lies along one mesh dimension."""

    __slots__ = ()

    def is_shard(self, dim: int | None = None) -> bool:
        """Whether this is a `Shard` (of tensor dimension `dim`, if given)."""
        return False

    def is_replicated(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


def _count(name: str, value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    return value


class Shard(Placement):
    """Paddle's `Shard(dim, *, split_factor=1)` / `Shard(dim, *, shard_order=0)`: tensor
    dimension `dim` split over this mesh dimension.

    Args:
      dim: the tensor dimension (negative counts from the last).
      split_factor: the number of blocks of a fused weight's `dim` (a qkv weight: 3), each split
        over this mesh dimension: each device holds its part of every block.
      shard_order: where this mesh dimension goes when several split `dim` (co-shard): lower
        orders are major; equal orders keep mesh order. Paddle takes either this or
        `split_factor`, not both.
    """

    __slots__ = ("_dim", "_shard_order", "_split_factor")

    def __init__(self, dim: int, *, split_factor: int = 1, shard_order: int = 0) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"Shard's dim must be an int, got {dim!r}")
        _count("Shard's split_factor", split_factor, 1)
        _count("Shard's shard_order", shard_order, 0)
        if split_factor != 1 and shard_order != 0:
            raise TypeError(
                f"Shard({dim}) takes split_factor or shard_order, not both (as Paddle's "
                f"constructors), got split_factor={split_factor}, shard_order={shard_order}"
            )
        self._dim, self._split_factor, self._shard_order = dim, split_factor, shard_order

    def get_dim(self) -> int:
        return self._dim

    def get_split_factor(self) -> int:
        return self._split_factor

    def get_co_shard_order(self) -> int:
        return self._shard_order

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self._dim

    def _key(self) -> tuple[int, int, int]:
        return self._dim, self._split_factor, self._shard_order

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shard) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(("Shard", *self._key()))

    def __repr__(self) -> str:
        extra = f", split_factor={self._split_factor}" if self._split_factor != 1 else ""
        extra += f", shard_order={self._shard_order}" if self._shard_order else ""
        return f"Shard(dim={self._dim}{extra})"


class Replicate(Placement):
    """Paddle's `Replicate()`: a full copy on every device along this mesh dimension."""

    __slots__ = ()

    def is_replicated(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Replicate)

    def __hash__(self) -> int:
        return hash("Replicate")

    def __repr__(self) -> str:
        return "Replicate()"


class Partial(Placement):
    """Paddle's `Partial(reduce_type=ReduceType.kRedSum)`: each device along this mesh dimension
    holds a part; the tensor is their reduction, still to be done. On JAX: an `unreduced` mesh
    axis (sums; an average as the sum of the parts over their number)."""

    __slots__ = ("_reduce_type",)

    def __init__(self, reduce_type: ReduceType = ReduceType.kRedSum) -> None:
        try:
            self._reduce_type = ReduceType(reduce_type)
        except ValueError:
            allowed = ", ".join(f"ReduceType.{r.name}" for r in ReduceType)
            raise ValueError(
                f"Partial's reduce_type must be one of {allowed}, got {reduce_type!r}"
            ) from None

    def reduce_type(self) -> ReduceType:
        return self._reduce_type

    def is_partial(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Partial) and self._reduce_type == other._reduce_type

    def __hash__(self) -> int:
        return hash(("Partial", self._reduce_type))

    def __repr__(self) -> str:
        return f"Partial(reduce_type={_REDUCE_NAMES[self._reduce_type]})"


# -- placements -> PartitionSpec ---------------------------------------------------------------
def paddle_parts(size: int, parts: Sequence[int]) -> list[int]:
    """The sizes Paddle gives the parts of a dimension of `size` split over mesh dimensions of
    `parts` devices, one after the other: each split in ceil-sized pieces, the last smaller."""
    sizes = [size]
    for n in parts:
        pieces = []
        for s in sizes:
            step = -(-s // n)
            pieces += [max(min(step, s - i * step), 0) for i in range(n)]
        sizes = pieces
    return sizes


def _where(tensor: str, names: Sequence[str], mesh_dim: int) -> str:
    return f"{tensor}: mesh dim {mesh_dim} ({names[mesh_dim]!r})"


def check_placements(
    placements: Sequence[Placement], names: Sequence[str], tensor: str = "the tensor"
) -> list[Placement]:
    """`placements` as a list, one `Placement` per mesh dimension of `names`, or an error that
    names the tensor and the mesh dimensions."""
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise TypeError(
            f"{tensor}: placements must be a list with one Placement per mesh dimension "
            f"{list(names)}, got {placements!r}"
        )
    placements = list(placements)
    if len(placements) != len(names):
        raise ValueError(
            f"{tensor}: {len(placements)} placements {placements} for a mesh of "
            f"{len(names)} dimensions {list(names)}: give one per mesh dimension (Replicate() "
            "where the tensor is whole)"
        )
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Placement):
            raise TypeError(
                f"{_where(tensor, names, mesh_dim)} has {p!r}; a placement is Shard(dim), "
                "Replicate() or Partial()"
            )
        if p.is_partial() and p.reduce_type() not in HELD_REDUCTIONS:
            raise ValueError(
                f"{_where(tensor, names, mesh_dim)} has {p!r}: a jax.Array holds a pending "
                "sum only (an unreduced mesh axis), so Partial takes ReduceType.kRedSum or "
                "kRedAvg; reduce with max, min or a product inside local_map (jax.lax.pmax, "
                "pmin) instead"
            )
    return placements


def shard_axes(
    placements: Sequence[Placement], names: Sequence[str], shape: Sequence[int], tensor: str
) -> list[tuple[str, ...]]:
    """The mesh axes that split each tensor dimension, major first (`shard_order`, then mesh
    order); raises for a `Shard(dim)` past the tensor's rank."""
    rank = len(shape)
    axes: list[list[tuple[int, int, str]]] = [[] for _ in range(rank)]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            dim = p.get_dim()
            if not -rank <= dim < rank:
                raise ValueError(
                    f"{_where(tensor, names, mesh_dim)} has {p!r}, but the tensor has {rank} "
                    f"dimension{'s' * (rank != 1)}: dim must be in "
                    f"[{-rank}, {rank})"
                )
            axes[dim % rank].append((p.get_co_shard_order(), mesh_dim, names[mesh_dim]))
    return [tuple(name for _, _, name in sorted(dim_axes)) for dim_axes in axes]


def _check_split_factor(
    placements: Sequence[Placement],
    names: Sequence[str],
    sizes: Sequence[int],
    shape: Sequence[int],
    tensor: str,
) -> None:
    """Refuse a `split_factor` that changes the layout: no jax.Array of the tensor's shape
    holds it (each device holds one block of each dimension)."""
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard) and p.get_split_factor() > 1 and sizes[mesh_dim] > 1:
            k, dim = p.get_split_factor(), p.get_dim() % len(shape)
            view = [*shape[:dim], k, shape[dim] // k, *shape[dim + 1 :]]
            raise ValueError(
                f"{_where(tensor, names, mesh_dim)} has {p!r}: Paddle gives each of its "
                f"{sizes[mesh_dim]} devices one part of each of the {k} blocks of dim {dim}, "
                f"which no jax.Array of this shape holds (a device holds one block "
                f"of each dimension); place the tensor reshaped to {tuple(view)} with "
                f"Shard({dim + 1}) on {names[mesh_dim]!r} instead: each device then holds "
                "Paddle's part"
            )


def partition_spec(
    placements: Sequence[Placement],
    names: Sequence[str],
    sizes: Sequence[int],
    shape: Sequence[int],
    tensor: str = "the tensor",
) -> PartitionSpec:
    """The `PartitionSpec` (with `unreduced` axes for `Partial`) of a tensor of `shape` placed
    as `placements` on a mesh of axes `names` and `sizes`.

    Raises:
      TypeError, ValueError: for placements of the wrong length or kind, a `Shard(dim)` past
        the tensor's rank, a reduction JAX cannot hold, a dimension that does not split into
        equal parts, or a `split_factor` that changes the layout; each names the tensor and
        the mesh dimension.
    """
    tensor = f"{tensor} of shape {tuple(shape)}"
    placements = check_placements(placements, names, tensor)
    axes = shard_axes(placements, names, shape, tensor)
    _check_split_factor(placements, names, sizes, shape, tensor)
    size_of = dict(zip(names, sizes, strict=True))
    for dim, dim_axes in enumerate(axes):
        parts = [size_of[a] for a in dim_axes]
        if shape[dim] % math.prod(parts):
            over = " x ".join(f"{a!r} ({size_of[a]})" for a in dim_axes)
            paddle = " + ".join(str(s) for s in paddle_parts(shape[dim], parts))
            raise ValueError(
                f"{tensor}: its dim {dim} of size {shape[dim]} is split over "
                f"mesh dims {over}: a jax.Array splits a dimension into equal parts only, and "
                f"{shape[dim]} is not a multiple of {math.prod(parts)} (Paddle would hold "
                f"{paddle})"
            )
    entries = [None if not a else a[0] if len(a) == 1 else a for a in axes]
    unreduced = frozenset(n for n, p in zip(names, placements, strict=True) if p.is_partial())
    return PartitionSpec(*entries, unreduced=unreduced)


def placements_of_spec(spec: PartitionSpec, names: Sequence[str]) -> list[Placement]:
    """The placements (one per mesh axis of `names`) a `PartitionSpec` stands for."""
    found: list[Placement] = [Replicate() for _ in names]
    for dim, entry in enumerate(spec.partitions):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for order, axis in enumerate(axes):
            found[names.index(axis)] = Shard(dim, shard_order=order if len(axes) > 1 else 0)
    for axis in spec.unreduced:
        found[names.index(axis)] = Partial()
    return found
