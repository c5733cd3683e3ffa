"""Placements lay tensors out as Paddle does: on a grid of 396 cases that Paddle 3.3.1 wrote
(tests/data/paddle3.3.1_local_slices.json, by tests/data/write_placements_with_paddle.py: meshes
of up to 3 dimensions and 8 processes with ids in any order, shapes uneven too, co-shard with
`shard_order`, `split_factor`, `Partial`), each device of `shard_tensor`'s array holds the index
ranges and values Paddle's rank holds; where no jax.Array can hold Paddle's layout (an uneven
split, a `split_factor`), the error names the dimension and sizes, and the layout it proposes
instead holds Paddle's part."""

import json
import math
import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import fleetjax.distributed as dist
from fleetjax.auto_parallel import partition_spec

DATA = pathlib.Path(__file__).parents[1] / "data" / "paddle3.3.1_local_slices.json"
CASES = json.loads(DATA.read_text())["cases"]


def placement(p: list) -> dist.Placement:
    if p[0] == "R":
        return dist.Replicate()
    if p[0] == "P":
        return dist.Partial(getattr(dist.ReduceType, p[1]))
    order = {} if p[3] is None else {"shard_order": p[3]}
    return dist.Shard(p[1], split_factor=p[2], **order)


def ranges(index: tuple, shape: list[int]) -> list[list[list[int]]]:
    """A device's index (slices) as Paddle's data writes it: one [start, stop) run per dim."""
    return [[list(s.indices(n)[:2])] for s, n in zip(index, shape, strict=True)]


def split(case: dict) -> list[int]:
    """How many parts each tensor dimension is split into (split_factor aside)."""
    parts = [1] * len(case["shape"])
    for n, p in zip(np.shape(case["mesh"]), case["placements"], strict=True):
        if p[0] == "S":
            parts[p[1]] *= n
    return parts


def test_the_grid_is_the_issues():
    meshes = {tuple(np.shape(c["mesh"])) for c in CASES}
    assert len(CASES) >= 300 and max(len(m) for m in meshes) == 3
    assert max(math.prod(m) for m in meshes) == 8
    shuffled = [c for c in CASES if np.ravel(c["mesh"]).tolist() != sorted(np.ravel(c["mesh"]))]
    kinds = {
        "shuffled ids": shuffled,
        "uneven": [
            c for c in CASES if any(n % s for n, s in zip(c["shape"], split(c), strict=True))
        ],
        "co-shard order": [c for c in CASES if any(p[0] == "S" and p[3] for p in c["placements"])],
        "split_factor": [
            c for c in CASES if any(p[0] == "S" and p[2] > 1 for p in c["placements"])
        ],
        "partial": [c for c in CASES if any(p[0] == "P" for p in c["placements"])],
    }
    assert {k: len(v) >= 10 for k, v in kinds.items()} == dict.fromkeys(kinds, True)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_each_device_holds_what_paddle_holds(case):
    mesh = dist.ProcessMesh(case["mesh"], dim_names=[f"d{i}" for i in range(np.ndim(case["mesh"]))])
    places = [placement(p) for p in case["placements"]]
    full = np.arange(1, math.prod(case["shape"]) + 1).reshape(case["shape"])
    uneven = [d for d, (n, s) in enumerate(zip(full.shape, split(case), strict=True)) if n % s]
    fused = [
        p
        for p, n in zip(places, mesh.shape, strict=True)
        if p.is_shard() and p.get_split_factor() > 1 and n > 1
    ]
    if uneven:
        check_uneven_is_refused(case, mesh, places, full, uneven[0])
    elif fused:
        with pytest.raises(ValueError, match="split_factor.* reshaped to"):
            dist.shard_tensor(full, mesh, places)
        check_split_view(case, mesh, places, full)
    else:
        check_layout(case, mesh, places, full)


def check_uneven_is_refused(case, mesh, places, full, d):
    """The error names the dimension, its size and the parts; Paddle's parts there differ."""
    parts = split(case)[d]
    message = rf"dim {d} of size {full.shape[d]} is split over .* not a multiple of {parts}"
    with pytest.raises(ValueError, match=message):
        dist.shard_tensor(full, mesh, places)
    held = {r["slices"][d][1] - r["slices"][d][0] for r in case["ranks"].values()}
    assert len(held) > 1


def check_layout(case, mesh, places, full):
    """Each device's index ranges and values are its rank's in Paddle (shard_tensor's, and
    get_local_slices' where that reads the placements: without a shard_order)."""
    shape = list(full.shape)
    x = dist.shard_tensor(full, mesh, places)
    spec = partition_spec(places, mesh.dim_names, mesh.shape, shape)
    assert x.sharding.spec == spec
    assert partition_spec(x.placements, mesh.dim_names, mesh.shape, shape) == spec
    # a pending sum's devices all hold the same index range (shard.index refuses unreduced)
    whole = NamedSharding(mesh.jax_mesh, PartitionSpec(*spec.partitions))
    indices = whole.devices_indices_map(tuple(shape))
    ordered = any(p.is_shard() and p.get_co_shard_order() for p in places)
    by_id = {d: i for i, d in enumerate(jax.devices())}
    for shard in x.addressable_shards:
        paddle = case["ranks"][str(by_id[shard.device])]
        index = shard.index if not spec.unreduced else indices[shard.device]
        if paddle.get("zeros"):
            assert not np.asarray(shard.data).any()
            continue
        assert ranges(index, shape) == paddle["local"]
        if not ordered:
            assert ranges(index, shape) == [[s] for s in paddle["slices"]]
        np.testing.assert_array_equal(np.asarray(shard.data), full[index])


def check_split_view(case, mesh, places, full):
    """The layout the split_factor error proposes holds each rank's part of every block."""
    ((mesh_dim, fused),) = [
        (i, p) for i, p in enumerate(places) if p.is_shard() and p.get_split_factor() > 1
    ]
    dim, k = fused.get_dim(), fused.get_split_factor()
    view_shape = [*full.shape[:dim], k, full.shape[dim] // k, *full.shape[dim + 1 :]]
    view_places = [
        dist.Shard(p.get_dim() + (p.get_dim() > dim)) if p.is_shard() else p for p in places
    ]
    view_places[mesh_dim] = dist.Shard(dim + 1)
    x = dist.shard_tensor(full.reshape(view_shape), mesh, view_places)
    by_id = {d: i for i, d in enumerate(jax.devices())}
    for shard in x.addressable_shards:
        values = np.asarray(shard.data).ravel() - 1
        held = [sorted(set(w.tolist())) for w in np.unravel_index(values, full.shape)]
        paddle = case["ranks"][str(by_id[shard.device])]["local"]
        assert held == [[i for a, b in runs for i in range(a, b)] for runs in paddle]


def test_partition_spec_reads_mesh_dims_into_tensor_dims():
    spec = partition_spec(
        [dist.Shard(1), dist.Partial(), dist.Shard(1, shard_order=0)],
        ["a", "b", "c"],
        [2, 2, 2],
        (4, 8),
    )
    assert spec == PartitionSpec(None, ("a", "c"), unreduced={"b"})
    spec = partition_spec(
        [dist.Shard(0, shard_order=1), dist.Shard(0, shard_order=0)], ["a", "b"], [2, 4], (8,)
    )
    assert spec == PartitionSpec(("b", "a"))
