"""Reshard: from one `PartitionSpec` to another on the same mesh, one mesh axis at a time (as
Paddle's `nd_mesh` reshard), each axis's change one step of a `jax.shard_map`:

| step | from -> to on the axis | collective |
| --- | --- | --- |
| gather | Shard(i) -> Replicate | all-gather |
| reduce | Partial -> Replicate | all-reduce |
| reduce_scatter | Partial -> Shard(j) | reduce-scatter |
| all_to_all | Shard(i) -> Shard(j) | all-to-all |
| slice | Replicate -> Shard(j) | none (each device keeps its part) |
| keep_on_first | Replicate -> Partial | none (the others hold zeros) |
| scatter_partial | Shard(i) -> Partial | none (each device's part, zeros around it) |

A tensor dimension split over several axes holds its blocks with the first axis major, so an
axis leaves a dimension from the minor end and joins it there: `plan` orders the steps so (and
a co-shard reordered against that order costs a gather and a slice).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

# Each step's collective, as compiled HLO names it (None: no communication).
COLLECTIVE = {
    "gather": "all-gather",
    "reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "slice": None,
    "keep_on_first": None,
    "scatter_partial": None,
}


class Step(NamedTuple):
    """One mesh axis's change: `kind` (a key of `COLLECTIVE`) over `axis`, on tensor dimension
    `dim` (an all-to-all: from `dim` to `to_dim`)."""

    kind: str
    axis: str
    dim: int | None = None
    to_dim: int | None = None

    @property
    def collective(self) -> str | None:
        return COLLECTIVE[self.kind]


class Layout(NamedTuple):
    """Where a tensor lies: the axes splitting each dimension (major first), and the axes along
    which it is a pending sum."""

    dims: tuple[tuple[str, ...], ...]
    partial: frozenset[str]

    @classmethod
    def of(cls, spec: PartitionSpec, rank: int) -> Layout:
        entries = [*spec.partitions, *([None] * (rank - len(spec)))]
        dims = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)
        return cls(dims, frozenset(spec.unreduced))

    def spec(self) -> PartitionSpec:
        entries = [None if not d else d[0] if len(d) == 1 else d for d in self.dims]
        return PartitionSpec(*entries, unreduced=self.partial)


class _Planner:
    """The state of a plan being made: the layout so far and the steps that led there."""

    def __init__(self, source: Layout, target: Layout) -> None:
        self.dims = [list(d) for d in source.dims]
        self.partial = set(source.partial)
        self.target = target
        self.steps: list[Step] = []

    def owner(self, axis: str) -> int | None:
        """The dimension `axis` splits in the target, if any."""
        return next((j for j, d in enumerate(self.target.dims) if axis in d), None)

    def ready(self, axis: str, dim: int) -> bool:
        """Whether `axis` can join `dim` now: every axis before it in the target is there."""
        wanted = self.target.dims[dim]
        return tuple(self.dims[dim]) == wanted[: wanted.index(axis)]

    def unused(self, axis: str) -> bool:
        return axis not in self.partial and all(axis not in d for d in self.dims)

    def add(self, step: Step) -> None:
        self.steps.append(step)
        if step.kind in ("gather", "all_to_all", "scatter_partial"):
            self.dims[step.dim].pop()
        if step.kind in ("reduce", "reduce_scatter"):
            self.partial.discard(step.axis)
        if step.kind in ("slice", "all_to_all", "reduce_scatter"):
            self.dims[step.dim if step.to_dim is None else step.to_dim].append(step.axis)
        if step.kind in ("keep_on_first", "scatter_partial"):
            self.partial.add(step.axis)
        self.slice_free()

    def slice_free(self) -> None:
        """Slice every replicated axis that can join its target dimension now (no
        communication, and what follows moves fewer bytes)."""
        for j, wanted in enumerate(self.target.dims):
            held = self.dims[j]
            if tuple(held) == wanted[: len(held)] and len(held) < len(wanted):
                axis = wanted[len(held)]
                if self.unused(axis):
                    self.add(Step("slice", axis, j))
                    return

    def extra(self) -> list[int]:
        """The dimensions holding an axis the target does not have there (in that place)."""
        return [
            i for i, held in enumerate(self.dims) if tuple(held) != self.target.dims[i][: len(held)]
        ]

    def leave(self, dim: int, move_only: bool) -> bool:
        """Take the minor axis off `dim`, by an all-to-all where it can join its target dim at
        once; otherwise (unless `move_only`) by a gather, or into a pending sum."""
        axis = self.dims[dim][-1]
        to = self.owner(axis)
        if to is not None and to != dim and self.ready(axis, to):
            self.add(Step("all_to_all", axis, dim, to))
        elif move_only:
            return False
        elif axis in self.target.partial:
            self.add(Step("scatter_partial", axis, dim))
        else:
            self.add(Step("gather", axis, dim))
        return True

    def sum_pending(self, defer: bool) -> None:
        """Do the pending sums the target has not: a reduce-scatter where the axis can join
        its target dimension now, else an all-reduce (unless `defer`, when that dimension is
        still to be freed)."""
        for axis in sorted(self.partial - self.target.partial):
            to = self.owner(axis)
            if to is not None and self.ready(axis, to):
                self.add(Step("reduce_scatter", axis, to))
            elif to is None or not defer:
                self.add(Step("reduce", axis))


@functools.lru_cache(maxsize=1024)
def plan(source: Layout, target: Layout) -> tuple[Step, ...]:
    """The steps from `source` to `target`, one per mesh axis that changes (two where a
    co-shard's order forces a gather and a slice). Sums and all-to-alls come before gathers,
    which grow what the later steps move."""
    p = _Planner(source, target)
    p.slice_free()
    p.sum_pending(defer=True)
    while extra := p.extra():
        if not any(p.leave(dim, move_only=True) for dim in extra):
            p.leave(extra[0], move_only=False)
    p.sum_pending(defer=False)
    for axis in sorted(target.partial - p.partial):
        p.add(Step("keep_on_first", axis))
    reached = Layout(tuple(tuple(d) for d in p.dims), frozenset(p.partial))
    assert reached == target, (source, target, reached)  # the plan's own invariant
    return tuple(p.steps)


def _apply(step: Step, x: jax.Array, size: int) -> jax.Array:
    """One step on a device's local block (inside `shard_map`); `size` is the axis's size."""
    index = lax.axis_index(step.axis)
    if step.kind == "gather":
        return lax.all_gather(x, step.axis, axis=step.dim, tiled=True)
    if step.kind == "reduce":
        return lax.psum(x, step.axis)
    if step.kind == "reduce_scatter":
        return lax.psum_scatter(x, step.axis, scatter_dimension=step.dim, tiled=True)
    if step.kind == "all_to_all":
        return lax.all_to_all(x, step.axis, step.to_dim, step.dim, tiled=True)
    if step.kind == "slice":
        part = x.shape[step.dim] // size
        return lax.dynamic_slice_in_dim(x, index * part, part, step.dim)
    if step.kind == "keep_on_first":
        return jnp.where(index == 0, x, jnp.zeros_like(x))
    # scatter_partial: this device's part in place, zeros around it
    whole = list(x.shape)
    whole[step.dim] *= size
    zeros = jnp.zeros(whole, x.dtype)
    return lax.dynamic_update_slice_in_dim(zeros, x, index * x.shape[step.dim], step.dim)


@functools.lru_cache(maxsize=1024)
def transition(mesh: Mesh, source: PartitionSpec, target: PartitionSpec, rank: int) -> Callable:
    """A function moving an array of `rank` dimensions on `mesh` from `source` to `target`
    (a `jax.shard_map`: call it traced, or jit it)."""
    steps = plan(Layout.of(source, rank), Layout.of(target, rank))
    sizes = dict(mesh.shape)

    def local(x: jax.Array) -> jax.Array:
        for step in steps:
            x = _apply(step, x, sizes[step.axis])
        return x

    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=Layout.of(source, rank).spec(),
        out_specs=Layout.of(target, rank).spec(),
        check_vma=False,  # the plan, not the varying-axes types, says what is replicated
    )


@functools.lru_cache(maxsize=1024)
def compiled_transition(
    mesh: Mesh, source: PartitionSpec, target: PartitionSpec, rank: int
) -> Callable:
    """`transition`, jitted: for arrays outside a traced function."""
    return jax.jit(transition(mesh, source, target, rank))
