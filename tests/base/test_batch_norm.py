"""BatchNorm with sync_batch_norm: statistics over all replicas (sync) or each replica's rows
(local), against numpy references of Paddle's batch_norm, and what XLA compiled for each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hlo import collectives
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from fleetjax.layers import partition_specs
from fleetjax.layers.batch_norm import BatchNorm, convert_batch_norm
from fleetjax.mesh import batch_sharding, build_mesh

EPS, MOMENTUM = 1e-5, 0.9
REPLICAS = 8
rng = np.random.RandomState(0)
X = (rng.randn(16, 3, 5) * 2 + 1).astype(np.float32)  # [batch, length, channels]
SCALE = rng.rand(5).astype(np.float32) + 0.5
BIAS = rng.randn(5).astype(np.float32)


def paddle_batch_norm(x, mean0, var0, feature=-1):
    """Paddle's batch_norm in training: (y, running mean, running var) over all rows of x."""
    axes = tuple(d for d in range(x.ndim) if d != feature % x.ndim)
    mean, var = x.mean(axes), x.var(axes)  # biased variance
    shape = [1] * x.ndim
    shape[feature] = -1
    y = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + EPS)
    y = y * SCALE.reshape(shape) + BIAS.reshape(shape)
    return y, MOMENTUM * mean0 + (1 - MOMENTUM) * mean, MOMENTUM * var0 + (1 - MOMENTUM) * var


def make(sync, replicas=REPLICAS, **kwargs):
    bn = BatchNorm(5, sync=sync, replicas=replicas, **kwargs)
    bn.scale[...], bn.bias[...] = jnp.asarray(SCALE), jnp.asarray(BIAS)
    return bn


@pytest.fixture(scope="module")
def mesh():
    return build_mesh(dp=4, sharding=2)  # the batch split 8 ways over both data axes


def compiled_forward(bn, mesh, x):
    """jit of one training forward (output and new running statistics), its inputs placed on
    `mesh` as `partition_specs` and the batch sharding say."""
    graphdef, state = nnx.split(bn)
    placed = jax.tree.map(lambda s: NamedSharding(mesh, s), partition_specs(state, mesh=mesh))

    def forward(state, x):
        layer = nnx.merge(graphdef, state)
        return layer(x), nnx.state(layer)

    with jax.set_mesh(mesh):
        state = jax.device_put(state, placed)
        x = jax.device_put(x, batch_sharding(mesh))
        step = jax.jit(forward, out_shardings=(batch_sharding(mesh), placed))
        compiled = step.lower(state, x).compile()
        y, new_state = step(state, x)
        jax.block_until_ready(y)
    nnx.update(bn, new_state)
    return np.asarray(y), compiled.as_text()


def test_sync_equals_single_device_batch_norm_over_the_whole_batch(mesh):
    y, _ = compiled_forward(make(sync=True), mesh, X)
    expected, _, _ = paddle_batch_norm(X, np.zeros(5), np.ones(5))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    single = make(sync=False, replicas=1)  # one device, no mesh: plain batch norm
    np.testing.assert_allclose(y, np.asarray(single(jnp.asarray(X))), rtol=1e-5, atol=1e-5)
    flax_bn = nnx.BatchNorm(5, momentum=MOMENTUM, epsilon=EPS, rngs=nnx.Rngs(0))
    flax_bn.scale[...], flax_bn.bias[...] = jnp.asarray(SCALE), jnp.asarray(BIAS)
    np.testing.assert_allclose(y, np.asarray(flax_bn(jnp.asarray(X))), rtol=1e-5, atol=1e-5)


def test_sync_running_statistics(mesh):
    bn = make(sync=True)
    compiled_forward(bn, mesh, X)
    _, mean, var = paddle_batch_norm(X, np.zeros(5), np.ones(5))
    assert bn.mean[...].shape == (1, 5)
    np.testing.assert_allclose(np.asarray(bn.mean[...])[0], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(bn.var[...])[0], var, rtol=1e-5, atol=1e-6)


def test_local_equals_each_replicas_own_batch_norm(mesh):
    bn = make(sync=False)
    y, _ = compiled_forward(bn, mesh, X)
    rows = len(X) // REPLICAS
    assert bn.mean[...].shape == (REPLICAS, 5)
    for r in range(REPLICAS):
        block = X[r * rows : (r + 1) * rows]
        expected, mean, var = paddle_batch_norm(block, np.zeros(5), np.ones(5))
        np.testing.assert_allclose(y[r * rows : (r + 1) * rows], expected, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(bn.mean[...])[r], mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(bn.var[...])[r], var, rtol=1e-5, atol=1e-5)
    # The replicas' statistics differ from each other and from the whole batch's.
    whole, _, _ = paddle_batch_norm(X, np.zeros(5), np.ones(5))
    assert np.abs(y - whole).max() > 0.1
    assert np.ptp(np.asarray(bn.mean[...]), axis=0).min() > 0.01


def test_local_statistics_stay_on_their_replica(mesh):
    bn = make(sync=False)
    compiled_forward(bn, mesh, X)
    assert bn.mean[...].sharding.spec == jax.sharding.PartitionSpec(("dp", "sharding"), None)


def test_local_evaluation_uses_each_replicas_running_statistics(mesh):
    bn = make(sync=False)
    compiled_forward(bn, mesh, X)
    bn.eval()
    assert bn.use_running_average
    y, _ = compiled_forward(bn, mesh, X[::-1].copy())
    rows = len(X) // REPLICAS
    mean, var = np.asarray(bn.mean[...]), np.asarray(bn.var[...])
    for r in range(REPLICAS):
        block = X[::-1][r * rows : (r + 1) * rows]
        expected = (block - mean[r]) / np.sqrt(var[r] + EPS) * SCALE + BIAS
        np.testing.assert_allclose(y[r * rows : (r + 1) * rows], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_hlo_local_has_no_collective_sync_all_reduces_the_statistics(axis_type):
    mesh = build_mesh(dp=4, sharding=2, axis_types=axis_type)
    _, local = compiled_forward(make(sync=False), mesh, X)
    assert collectives(local) == []
    _, sync = compiled_forward(make(sync=True), mesh, X)
    found = collectives(sync)
    assert [c.op for c in found] == ["all-reduce"]
    # Sum and sum of squares of the 5 channels, in one all-reduce over all 8 replicas.
    assert found[0].group_size == REPLICAS
    assert found[0].arrays == [("f32", (1, 5)), ("f32", (1, 5))]


@pytest.mark.parametrize("sync", [False, True])
def test_inside_a_shard_map_over_the_data_axes(mesh, sync):
    """Per-replica optimizers (DGC, LocalSGD) run the loss in a shard_map: each device sees its
    own rows and its own row of statistics; sync averages over the manual data axes."""
    graphdef, state = nnx.split(make(sync=sync))
    specs = partition_specs(state, mesh=mesh)

    def forward(state, x):
        layer = nnx.merge(graphdef, state)
        return layer(x), nnx.state(layer)

    data = PartitionSpec(("dp", "sharding"))
    step = jax.shard_map(forward, mesh=mesh, in_specs=(specs, data), out_specs=(data, specs))
    y, new_state = jax.block_until_ready(jax.jit(step)(state, X))
    bn = make(sync=sync)
    expected, _ = compiled_forward(bn, mesh, X)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_state["mean"][...], bn.mean[...], rtol=1e-5, atol=1e-6)


def test_channels_first(mesh):
    x = np.moveaxis(X, -1, 1).copy()  # Paddle's NCHW: [batch, channels, length]
    y, _ = compiled_forward(make(sync=True, axis=1), mesh, x)
    expected, _, _ = paddle_batch_norm(x, np.zeros(5), np.ones(5), feature=1)
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_half_precision_input_keeps_float32_statistics():
    bn = make(sync=True, replicas=1)
    y = bn(jnp.asarray(X, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16 and bn.mean[...].dtype == jnp.float32
    expected, mean, _ = paddle_batch_norm(
        np.asarray(jnp.asarray(X, jnp.bfloat16), np.float32), 0, 1
    )
    np.testing.assert_allclose(np.asarray(y, np.float32), expected, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(bn.mean[...][0], mean, rtol=1e-5, atol=1e-6)


def test_gradient_flows_through_each_replicas_statistics():
    weights = jnp.asarray(rng.randn(*X.shape).astype(np.float32))

    def ours(x, layer):
        return jnp.sum(layer(x) * weights)

    def by_hand(x):  # plain batch norm of each half
        out = []
        for half in jnp.split(x, 2):
            mean, var = half.mean((0, 1)), half.var((0, 1))
            out.append((half - mean) / jnp.sqrt(var + EPS) * SCALE + BIAS)
        return jnp.sum(jnp.concatenate(out) * weights)

    x = jnp.asarray(X)
    grads = nnx.grad(ours)(x, make(sync=False, replicas=2))
    np.testing.assert_allclose(grads, jax.grad(by_hand)(x), rtol=1e-4, atol=1e-4)


def test_convert_lays_out_the_running_statistics_both_ways():
    bn = make(sync=False, replicas=4)
    bn.mean[...] = jnp.arange(20.0).reshape(4, 5)
    model = nnx.List([bn])
    assert convert_batch_norm(model, sync=True) is model
    assert bn.groups == 1
    np.testing.assert_allclose(bn.mean[...], np.arange(20.0).reshape(4, 5).mean(0, keepdims=True))
    convert_batch_norm(model, sync=False, replicas=8)
    assert bn.groups == 8 and bn.mean[...].shape == (8, 5) and bn.var[...].shape == (8, 5)
    np.testing.assert_allclose(bn.mean[...][7], np.arange(20.0).reshape(4, 5).mean(0))


def test_local_statistics_for_another_replica_count_are_refused(mesh):
    with pytest.raises(ValueError, match=r"local statistics for 16 replicas, but the mesh splits "):
        compiled_forward(make(sync=False, replicas=16), mesh, X)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"a batch of 15 rows does not split into 8 equal"):
        make(sync=False)(jnp.ones((15, 5)))
    with pytest.raises(ValueError, match=r"has 4 features, expected num_features=5"):
        make(sync=True)(jnp.ones((8, 4)))
    with pytest.raises(ValueError, match=r"axis=0 must name a non-batch axis"):
        make(sync=True, axis=0)(jnp.ones((8, 5)))
    with pytest.raises(ValueError, match=r"BatchNorm: replicas must be a positive int, got 0"):
        BatchNorm(5, replicas=0)
    with pytest.raises(TypeError, match=r"sync must be bool, got int 1"):
        BatchNorm(5, sync=1)
