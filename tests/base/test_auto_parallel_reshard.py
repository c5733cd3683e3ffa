"""`reshard` costs what it must: each mesh dimension that changes compiles to its one
collective at its formula's bytes (Shard->Replicate an all-gather, Partial->Replicate an
all-reduce, Partial->Shard a reduce-scatter, Shard(i)->Shard(j) an all-to-all), to Shard or
Partial from Replicate to none, read from the compiled HLO; outside and inside jit."""

import jax
import numpy as np
import pytest
from hlo import collectives

import fleetjax.distributed as dist
from fleetjax.auto_parallel import COLLECTIVE, Layout, plan, tables

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
R, P, S = dist.Replicate(), dist.Partial(), dist.Shard
SHAPE = (8, 16)
FULL = np.arange(128, dtype=np.float32).reshape(SHAPE)
BYTES = FULL.nbytes  # 512

# (from, to, [(collective, devices in a group, result bytes on a device)])
TRANSITIONS = {
    "S->R": ([S(0), R], [R, R], [("all-gather", 2, BYTES)]),
    "P->R": ([P, R], [R, R], [("all-reduce", 2, BYTES)]),
    "P->S": ([P, R], [S(0), R], [("reduce-scatter", 2, BYTES // 2)]),
    "S(0)->S(1)": ([S(0), R], [S(1), R], [("all-to-all", 2, BYTES // 2)]),
    "R->S": ([R, R], [S(0), S(1)], []),
    "R->P": ([R, R], [P, R], []),
    "S->P": ([S(0), R], [P, R], []),
    "2-d S->R": ([S(0), S(1)], [R, R], [("all-gather", 2, BYTES // 4), ("all-gather", 4, BYTES)]),
    "2-d P,S->S,R": (
        [P, S(1)],
        [S(0), R],
        [("reduce-scatter", 2, BYTES // 8), ("all-gather", 4, BYTES // 2)],
    ),
    "mp S(1)->S(0) under dp S(0)": (
        [S(0), S(1)],
        [S(0), S(0)],
        [("all-to-all", 4, BYTES // 8)],
    ),
    "co-shard to one axis": ([S(0), S(0)], [S(0), R], [("all-gather", 4, BYTES // 2)]),
    # the sum first: gathering mp first would all-reduce the whole tensor, 4x the bytes
    "sums before gathers": (
        [P, S(1)],
        [R, R],
        [("all-reduce", 2, BYTES // 4), ("all-gather", 4, BYTES)],
    ),
}


def placed(places):
    return dist.shard_tensor(FULL, MESH, places)


def compiled(source, target):
    x = placed(source)
    return jax.jit(lambda a: dist.reshard(a, MESH, target)).lower(x).compile()


@pytest.mark.parametrize("name", TRANSITIONS)
def test_each_transition_compiles_to_its_collective_and_keeps_the_values(name):
    source, target, expected = TRANSITIONS[name]
    x, step = placed(source), compiled(source, target)
    assert [(c.op, c.group_size, c.result_bytes) for c in collectives(step.as_text())] == expected
    for y in (dist.reshard(x, MESH, target), step(x)):  # eagerly, and inside jit
        assert y.placements == placed(target).placements
        np.testing.assert_array_equal(np.asarray(dist.unshard_dtensor(y)), FULL)


def test_the_docs_table_is_what_xla_compiles():
    """docs/auto_parallel.md's reshard rows (fleetjax.auto_parallel.tables, from the plan) are
    transitions above, whose compiled collectives the first test reads."""
    rows = [(source, target) for source, target, _ in TRANSITIONS.values()]
    mesh = tuple(zip(MESH.dim_names, MESH.shape, strict=True))
    assert (SHAPE, mesh) == (tables.SHAPE, tables.MESH)
    for source, target in tables.RESHARDS:
        assert (source, target) in rows
    for source, target, expected in TRANSITIONS.values():
        assert [tuple(c) for c in tables.collectives(source, target)] == expected


def test_the_plan_names_one_collective_per_changed_axis():
    for source, target, expected in TRANSITIONS.values():
        spec = [dist.shard_tensor(FULL, MESH, p).sharding.spec for p in (source, target)]
        if any(p.is_partial() for p in source):  # an unreduced source: the spec of its layout
            spec[0] = placed(source).sharding.spec
        steps = plan(Layout.of(spec[0], 2), Layout.of(spec[1], 2))
        assert [COLLECTIVE[s.kind] for s in steps if COLLECTIVE[s.kind]] == [e[0] for e in expected]
        assert len({s.axis for s in steps}) == len(steps)  # each axis changes once


def test_placements_are_read_inside_jit():
    seen = []

    @jax.jit
    def step(a):
        seen.append((a.placements, a.process_mesh))
        b = dist.reshard(a, MESH, [R, S(0)])
        seen.append(b.placements)
        return b

    step(placed([S(1), R]))
    assert seen == [([S(1), R], MESH), [R, S(0)]]


def test_a_reshard_to_another_mesh_copies_the_values():
    other = dist.ProcessMesh([7, 6, 5, 4], dim_names=["z"])
    y = dist.reshard(placed([P, S(1)]), other, [S(0)])
    assert y.process_mesh == other and y.placements == [S(0)]
    np.testing.assert_array_equal(np.asarray(y), FULL)
    with pytest.raises(ValueError, match="moves within its mesh only"):
        jax.jit(lambda a: dist.reshard(a, other, [S(0)]))(placed([S(0), R]))
