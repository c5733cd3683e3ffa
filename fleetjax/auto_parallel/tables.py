"""docs/auto_parallel.md's tables, made from the code that they describe: what placements
become (`partition_spec`) and what each reshard does (`plan`, one step per mesh axis).

    python -m fleetjax.auto_parallel.tables docs/auto_parallel.md   # rewrites the tables

A table follows its marker line, ``<!-- auto_parallel: placements -->`` or
``<!-- auto_parallel: reshard -->``; tests/base/test_auto_parallel_docs.py checks that the page
holds what this module writes, and tests/base/test_auto_parallel_reshard.py that XLA compiles
each reshard row to the collectives it names.
"""

from __future__ import annotations

import math
import pathlib
import re
import sys
from collections.abc import Sequence
from typing import NamedTuple

from fleetjax.auto_parallel._placements import (
    Partial,
    Placement,
    ReduceType,
    Replicate,
    Shard,
    partition_spec,
)
from fleetjax.auto_parallel._reshard import Layout, Step, plan

__all__ = ["MESH", "PLACEMENTS", "RESHARDS", "Collective", "collectives", "render"]

# The mesh and tensor of the examples: 2 x 4 devices, a float32 [8, 16] tensor (512 bytes).
MESH = (("dp", 2), ("mp", 4))
SHAPE, ITEMSIZE = (8, 16), 4

PLACEMENTS: list[list[Placement]] = [
    [Replicate(), Replicate()],
    [Shard(0), Replicate()],
    [Replicate(), Shard(1)],
    [Shard(1), Shard(0)],
    [Shard(0), Shard(0)],
    [Shard(0, shard_order=1), Shard(0, shard_order=0)],
    [Partial(), Shard(1)],
    [Partial(ReduceType.kRedAvg), Replicate()],
    [Partial(), Partial()],
]

RESHARDS: list[tuple[list[Placement], list[Placement]]] = [
    ([Shard(0), Replicate()], [Replicate(), Replicate()]),
    ([Partial(), Replicate()], [Replicate(), Replicate()]),
    ([Partial(), Replicate()], [Shard(0), Replicate()]),
    ([Shard(0), Replicate()], [Shard(1), Replicate()]),
    ([Replicate(), Replicate()], [Shard(0), Shard(1)]),
    ([Replicate(), Replicate()], [Partial(), Replicate()]),
    ([Shard(0), Replicate()], [Partial(), Replicate()]),
    ([Shard(0), Shard(1)], [Replicate(), Replicate()]),
    ([Partial(), Shard(1)], [Shard(0), Replicate()]),
    ([Partial(), Shard(1)], [Replicate(), Replicate()]),
    ([Shard(0), Shard(0)], [Shard(0), Replicate()]),
]


class Collective(NamedTuple):
    """A collective a reshard compiles to: its HLO name, the devices in each of its groups
    (the mesh axis's size) and the bytes of its result on each device."""

    op: str
    group_size: int
    result_bytes: int


def _spec(placements: Sequence[Placement], shape: Sequence[int] = SHAPE):
    names, sizes = zip(*MESH, strict=True)
    return partition_spec(placements, names, sizes, shape)


def _local(shape: Sequence[int], layout: Layout) -> list[int]:
    size = dict(MESH)
    return [
        n // math.prod(size[a] for a in axes) for n, axes in zip(shape, layout.dims, strict=True)
    ]


def _after(step: Step, local: list[int]) -> list[int]:
    """A device's block after `step`."""
    n, local = dict(MESH)[step.axis], list(local)
    if step.kind in ("gather", "scatter_partial"):
        local[step.dim] *= n
    elif step.kind in ("reduce_scatter", "slice"):
        local[step.dim] //= n
    elif step.kind == "all_to_all":
        local[step.dim] *= n
        local[step.to_dim] //= n
    return local


def steps(source: Sequence[Placement], target: Sequence[Placement]) -> tuple[Step, ...]:
    rank = len(SHAPE)
    return plan(Layout.of(_spec(source), rank), Layout.of(_spec(target), rank))


def collectives(source: Sequence[Placement], target: Sequence[Placement]) -> list[Collective]:
    """The collectives the reshard from `source` to `target` of the examples' tensor costs."""
    local = _local(SHAPE, Layout.of(_spec(source), len(SHAPE)))
    found = []
    for step in steps(source, target):
        local = _after(step, local)
        if step.collective:
            bytes_ = math.prod(local) * ITEMSIZE
            found.append(Collective(step.collective, dict(MESH)[step.axis], bytes_))
    return found


def _placements(placements: Sequence[Placement]) -> str:
    return "`[" + ", ".join(repr(p) for p in placements) + "]`"


def _spec_text(spec) -> str:
    """A spec as its repr, the pending sums' axes in mesh order (a set's repr is not)."""
    entries = ", ".join(repr(e) for e in spec.partitions)
    order = [name for name, _ in MESH]
    pending = ", ".join(repr(a) for a in sorted(spec.unreduced, key=order.index))
    return f"P({entries}, unreduced={{{pending}}})" if pending else f"P({entries})"


def placement_rows() -> list[str]:
    rows = [
        "| placements (`dp`, `mp`) | `PartitionSpec` | each device holds |",
        "| --- | --- | --- |",
    ]
    for placements in PLACEMENTS:
        spec = _spec(placements)
        local = _local(SHAPE, Layout.of(spec, len(SHAPE)))
        order = [name for name, _ in MESH]
        pending = ", ".join(sorted(spec.unreduced, key=order.index))
        held = f"`{tuple(local)}`" + (f", a part of a sum over {pending}" if pending else "")
        if any(p.is_partial() and p.reduce_type() == ReduceType.kRedAvg for p in placements):
            held += " (an average, held as the sum of the parts over their number)"
        rows.append(f"| {_placements(placements)} | `{_spec_text(spec)}` | {held} |")
    return rows


def reshard_rows() -> list[str]:
    rows = ["| from | to | steps | collectives (devices per group, bytes on a device) |"]
    rows.append("| --- | --- | --- | --- |")
    for source, target in RESHARDS:
        done = ", ".join(f"{s.kind} `{s.axis}`" for s in steps(source, target))
        costs = ", ".join(
            f"{c.op} ({c.group_size}, {c.result_bytes} B)" for c in collectives(source, target)
        )
        rows.append(
            f"| {_placements(source)} | {_placements(target)} | {done} | {costs or 'none'} |"
        )
    return rows


_MARKER = re.compile(r"^<!-- auto_parallel: (?P<table>\w+) -->$")
_TABLES = {"placements": placement_rows, "reshard": reshard_rows}


def render(markdown: str) -> str:
    """`markdown` with the table below each marker made anew.

    Raises:
      ValueError: for a marker naming no table.
    """
    out, skip = [], False
    for line in markdown.splitlines():
        if skip and line.startswith("|"):
            continue
        skip = False
        out.append(line)
        if m := _MARKER.match(line):
            if m["table"] not in _TABLES:
                raise ValueError(f"{line}: the table must be one of {', '.join(_TABLES)}")
            out += _TABLES[m["table"]]()
            skip = True
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    page = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "docs/auto_parallel.md")
    page.write_text(render(page.read_text()))
