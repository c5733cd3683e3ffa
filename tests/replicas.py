"""A shard_map harness for per-replica code on 8 simulated devices, and bytes from compiled HLO.

`per_replica(fn)` runs `fn` once per data-parallel replica inside `jax.shard_map` over the data
axes: every argument and result has a leading replica axis, and replica `i` sees slice `i`
(as the train step stores per-replica state stacked and sharded over the data axes).
"""

import math
import re

import jax
import numpy as np
from jax.sharding import PartitionSpec

from fleetjax.mesh import build_mesh, data_axes

REPLICAS = 8
AXES = ("dp", "sharding")


def per_replica(fn, mesh=None):
    """`fn(*local_args)` on each replica, jitted (`.lower` too); arguments and results stacked
    by replica."""
    mesh = mesh if mesh is not None else build_mesh(dp=REPLICAS)
    spec = PartitionSpec(data_axes(mesh))

    def body(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))

    def call(*args):
        # One step in flight at a time: with several queued, XLA's in-process CPU collectives
        # can wait forever on a machine with few cores (seen with 8 devices on 2 cores).
        return jax.block_until_ready(step(*args))

    call.lower = step.lower
    return call


def stacked(tree, replicas=REPLICAS):
    """`tree` copied for every replica, on a new leading axis."""
    return jax.tree.map(lambda x: np.stack([np.asarray(x)] * replicas), tree)


def replica(tree, i):
    """Replica `i`'s slice of a stacked tree, as numpy."""
    return jax.tree.map(lambda x: np.asarray(x[i]), tree)


_BYTES = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO result shape such as `f32[8,32]{1,0}` or a tuple of them."""
    return sum(
        _BYTES.get(dtype, 1) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(shape)
    )


def bus_bytes(op: str, shape: str, group_size: int) -> float:
    """Bytes each device sends for one collective under the ring algorithms NCCL uses: an
    all-reduce of S bytes sends 2 (n-1)/n S; an all-gather with an S-byte result (n-1)/n S."""
    share = (group_size - 1) / group_size * shape_bytes(shape)
    return 2 * share if op == "all-reduce" else share


_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) ")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{|true_computation=|false_computation=)([^}\s,]+(?:, %[^}\s,]+)*)"
)


def ops_outside_branches(hlo_text: str, op: str) -> list[str]:
    """The computations holding an `op` instruction that no conditional runs as a branch, i.e.
    where `op` runs on every step."""
    holders, branches, current = set(), set(), None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group(1)
        if f" {op}(" in line or f" {op}-start(" in line:
            holders.add(current)
        for m in _BRANCHES.finditer(line):
            branches.update(name.strip().lstrip("%") for name in m.group(1).split(","))
    return sorted(holders - branches)
