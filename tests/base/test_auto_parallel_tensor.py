"""Distributed tensors as jax.Arrays: the placements as Paddle's values, `shard_tensor` from
any data (an nnx.Param stays one), `dtensor_from_fn`, `dtensor_from_local` /
`dtensor_to_local`, `unshard_dtensor`, `local_map` (Paddle's own example), and the errors that
name the tensor and the mesh dimension."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fleetjax
import fleetjax.distributed as dist

MESH = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
R, P, S = dist.Replicate(), dist.Partial(), dist.Shard
W = np.arange(32, dtype=np.float32).reshape(4, 8)


def test_placements_are_paddles_values():
    assert S(1) == S(1, shard_order=0) and S(1) != S(1, split_factor=2) and S(1) != S(0)
    assert [repr(p) for p in (S(1), S(1, split_factor=3), S(0, shard_order=1), R)] == [
        "Shard(dim=1)",
        "Shard(dim=1, split_factor=3)",
        "Shard(dim=0, shard_order=1)",
        "Replicate()",
    ]
    average = dist.Partial(dist.ReduceType.kRedAvg)
    assert repr(P) == "Partial(reduce_type=SUM)" and average != P
    assert dist.Partial(dist.ReduceType.kRedAvg).reduce_type() == dist.ReduceType.kRedAvg
    assert S(1).is_shard() and S(1).is_shard(1) and not S(1).is_shard(0) and not R.is_shard()
    assert R.is_replicated() and P.is_partial() and len({S(1), S(1), R, R, P}) == 3
    assert all(isinstance(p, dist.Placement) for p in (S(0), R, P))


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: S(1, split_factor=2, shard_order=1), TypeError, "split_factor or shard_order"),
        (lambda: S(True), TypeError, "dim must be an int"),
        (lambda: S(0, split_factor=0), ValueError, "split_factor must be an int >= 1"),
        (lambda: dist.Partial(9), ValueError, "reduce_type must be one of ReduceType.kRedSum"),
    ],
)
def test_bad_placements_are_refused(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_shard_tensor_places_any_data():
    for data in (W, W.tolist(), jnp.asarray(W), jax.device_put(W, jax.devices()[5])):
        x = dist.shard_tensor(data, MESH, [S(0), S(1)])
        assert isinstance(x, jax.Array) and x.placements == [S(0), S(1)] and x.process_mesh == MESH
        assert x.addressable_shards[0].data.shape == (2, 2)
        np.testing.assert_array_equal(np.asarray(x), W)
    assert dist.shard_tensor(W, MESH, [R, R], dtype=jnp.bfloat16).dtype == jnp.bfloat16
    assert jnp.asarray(W).placements is None and dist.placements_of(W) is None


def test_a_parameter_stays_a_parameter():
    param = nnx.Param(jnp.asarray(W))
    placed = dist.shard_tensor(param, MESH, [R, S(1)])
    assert isinstance(placed, nnx.Param) and placed[...].placements == [R, S(1)]
    assert placed.placements == [R, S(1)]  # read through the Variable, as a Paddle parameter


def test_paddles_device_and_gradient_arguments_warn():
    with pytest.warns(fleetjax.StrategyWarning, match="place='gpu:0' has no JAX meaning"):
        dist.shard_tensor(W, MESH, [R, R], place="gpu:0")
    with pytest.warns(fleetjax.StrategyWarning, match="stop_gradient=True has no JAX meaning"):
        dist.shard_tensor(W, MESH, [R, R], stop_gradient=True)


@pytest.mark.parametrize(
    ("placements", "error", "message"),
    [
        (
            [S(0)],
            ValueError,
            r"of shape \(4, 8\): 1 placements .* mesh of 2 dimensions \['dp', 'mp'\]",
        ),
        ([R, R, R], ValueError, r"3 placements .* mesh of 2 dimensions"),
        (
            [R, S(2)],
            ValueError,
            r"mesh dim 1 \('mp'\) has Shard\(dim=2\), but the tensor has 2 dimensions",
        ),
        ([S(-3), R], ValueError, r"mesh dim 0 \('dp'\) has Shard\(dim=-3\)"),
        (
            [dist.Partial(dist.ReduceType.kRedMax), R],
            ValueError,
            r"mesh dim 0 \('dp'\) has Partial\(reduce_type=MAX\): a jax.Array holds a pending sum",
        ),
        ([R, "S(0)"], TypeError, r"mesh dim 1 \('mp'\) has 'S\(0\)'"),
        (S(0), TypeError, "a list with one Placement per mesh dimension"),
        ([R, S(1, split_factor=2)], ValueError, r"reshaped to \(4, 2, 4\) with Shard\(2\) on 'mp'"),
    ],
)
def test_bad_placements_name_the_tensor_and_mesh_dimension(placements, error, message):
    with pytest.raises(error, match=message):
        dist.shard_tensor(W, MESH, placements)


def test_uneven_splits_name_the_dimension_and_sizes():
    message = (
        r"its dim 1 of size 6 is split over mesh dims 'dp' \(2\) x 'mp' \(4\): .* 6 is not a "
        r"multiple of 8 \(Paddle would hold 1 \+ 1 \+ 1 \+ 0 \+ 1 \+ 1 \+ 1 \+ 0\)"
    )
    with pytest.raises(ValueError, match=message):
        dist.shard_tensor(np.ones((4, 6)), MESH, [S(1), S(1)])


def test_negative_dims_count_from_the_last():
    assert dist.shard_tensor(W, MESH, [S(-1), R]).placements == [S(1), R]


def test_dtensor_from_fn_makes_each_part_where_it_lives():
    x = dist.dtensor_from_fn(jnp.ones, MESH, [S(0), R], shape=(4, 8))
    assert x.placements == [S(0), R] and x.shape == (4, 8)
    assert dist.dtensor_from_fn(jnp.full, MESH, [P, R], (4, 8), 2.0).placements == [P, R]
    np.testing.assert_array_equal(
        np.asarray(dist.unshard_dtensor(dist.dtensor_from_fn(jnp.full, MESH, [P, R], (4, 8), 2.0))),
        np.full((4, 8), 2.0),
    )


def test_local_tensors_round_trip():
    x = dist.shard_tensor(W, MESH, [P, S(1)])
    parts = dist.dtensor_to_local(x, MESH, [P, S(1)])
    assert len(parts) == 8 and parts[0].shape == (4, 2) and not np.asarray(parts[4]).any()
    y = dist.dtensor_from_local(parts, MESH, [P, S(1)])
    assert y.placements == [P, S(1)] and y.shape == (4, 8)
    np.testing.assert_array_equal(np.asarray(dist.unshard_dtensor(y)), W)
    with pytest.raises(ValueError, match="not on .* as .*; reshard it first"):
        dist.dtensor_to_local(x, MESH, [R, S(1)])


def test_local_tensors_of_an_average():
    parts = [np.full((2,), float(i)) for i in range(8)]  # process i holds i
    y = dist.dtensor_from_local(parts, MESH, [dist.Partial(dist.ReduceType.kRedAvg), S(0)])
    assert y.shape == (8,)
    expected = [np.mean([i, i + 4]) for i in range(4) for _ in range(2)]
    np.testing.assert_allclose(np.asarray(dist.unshard_dtensor(y)), expected)


def test_bad_local_tensors_are_refused():
    with pytest.raises(ValueError, match="3 local tensors for a mesh of 8 processes"):
        dist.dtensor_from_local([W] * 3, MESH, [R, R])
    with pytest.raises(
        ValueError, match=r"processes 0 and 4 hold different parts, but .* replicate them"
    ):
        dist.dtensor_from_local([W + i for i in range(8)], MESH, [R, S(0)])
    with pytest.raises(ValueError, match="several shapes"):
        dist.dtensor_from_local([W] * 7 + [W[:2]], MESH, [S(0), R])
    with pytest.raises(ValueError, match="needs a float dtype"):
        dist.dtensor_from_local(
            np.ones(2, np.int32), MESH, [dist.Partial(dist.ReduceType.kRedAvg), R]
        )


def test_unshard_takes_a_distributed_tensor():
    with pytest.raises(ValueError, match="takes a distributed tensor"):
        dist.unshard_dtensor(jnp.ones(3))


def test_paddles_local_map_example():
    """Paddle's docstring example on a mesh of 2: rank r holds arange(10) + r, masks its own
    rows and returns its masked mean as a pending sum: 1.5 + 6.0 = 7.5."""
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    parts = [np.arange(10, dtype=np.float32) + rank for rank in range(2)]
    x = dist.dtensor_from_local(parts, mesh, [S(0)])

    def masked_mean(local):
        rows = jnp.arange(10)
        first = jax.lax.axis_index("x") == 0
        mask = jnp.where(first, (rows >= 1) & (rows < 3), (rows >= 4) & (rows < 7))
        return jnp.sum(local * mask) / mask.sum()

    mean = dist.local_map(
        masked_mean, out_placements=[[P]], in_placements=[[S(0)]], process_mesh=mesh
    )
    out = mean(x)
    assert out.placements == [P]
    assert [float(p) for p in dist.dtensor_to_local(out, mesh, [P])] == [1.5, 6.0]
    assert float(dist.unshard_dtensor(out)) == 7.5


def test_local_map_places_its_inputs_and_outputs():
    x = dist.shard_tensor(W, MESH, [S(0), R])
    row_sums = dist.local_map(
        lambda t, k: t.sum(1) * k, [[S(0), dist.Partial(dist.ReduceType.kRedAvg)]]
    )
    with pytest.raises(
        ValueError,
        match=r"input 0 is placed as \[Shard\(dim=0\), Replicate\(\)\], the function takes it as",
    ):
        dist.local_map(lambda t: t, [[R, S(1)]], in_placements=[[R, S(1)], None])(x, 2)
    out = jax.jit(row_sums, static_argnums=1)(x, 2)  # inside jit too; 2 stays a Python int
    assert out.placements == [S(0), P]
    np.testing.assert_allclose(np.asarray(dist.unshard_dtensor(out)), W.sum(1) * 2)
    resharded = dist.local_map(
        lambda t: t, [[R, S(1)]], in_placements=[[R, S(1)]], reshard_inputs=True
    )
    np.testing.assert_array_equal(np.asarray(resharded(x)), W)


def test_local_map_needs_a_mesh():
    with pytest.raises(ValueError, match="no input is a distributed tensor and no process_mesh"):
        dist.local_map(lambda t: t, [[R]])(np.ones(2))
    dist.set_mesh(dist.ProcessMesh([0, 1], dim_names=["x"]))
    try:
        assert dist.local_map(lambda t: t * 2, [[S(0)]])(np.ones(2)).placements == [S(0)]
    finally:
        dist.set_mesh(None)


def test_conflicting_operands_are_an_error_not_a_silent_reshard():
    x = dist.shard_tensor(W, MESH, [S(0), R])
    w = dist.shard_tensor(np.ones((8, 8), np.float32), MESH, [S(1), R])
    with pytest.raises(Exception, match="illegally sharded result"):
        jax.jit(lambda a, b: a @ b)(x, w)


def test_local_map_takes_arrays_on_one_device_and_co_shards_as_they_are():
    on_device_3 = jax.device_put(W, jax.devices()[3])
    doubled = dist.local_map(lambda t: t * 2, [[R, R]], process_mesh=MESH)(on_device_3)
    np.testing.assert_array_equal(np.asarray(doubled), W * 2)
    co_sharded = dist.shard_tensor(W, MESH, [S(1), S(1)])  # reads back with its shard_orders
    same = dist.local_map(lambda t: t, [[S(1), S(1)]], in_placements=[[S(1), S(1)]])
    assert same(co_sharded).placements == co_sharded.placements
