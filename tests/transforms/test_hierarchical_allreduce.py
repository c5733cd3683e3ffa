"""`use_hierarchical_allreduce`: gradients averaged within nodes, then across them, then
gathered within them, with only 1 / ranks-per-node of each gradient crossing nodes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo import collectives
from jax.sharding import PartitionSpec as P

import fleetjax
from fleetjax.transforms import grad_allreduce

AXES = ("dp", "sharding")


def reduce_on_devices(ranks_per_node, grads, dtype=jnp.float32):
    """Each of the 8 devices' gradients (leading axis) reduced by the hierarchical reducer."""
    mesh = fleetjax.build_mesh(dp=4, sharding=2)
    reducer = grad_allreduce.hierarchical_mean(8, ranks_per_node, dtype)
    run = jax.shard_map(
        lambda g: reducer(jax.tree.map(lambda x: x[0], g), AXES),
        mesh=mesh,
        in_specs=P(AXES),
        out_specs=P(),
        check_vma=False,
    )
    return jax.jit(run)(grads)


@pytest.mark.parametrize("ranks_per_node", [1, 2, 4, 8])
def test_equals_the_mean_over_replicas(ranks_per_node):
    rng = np.random.RandomState(ranks_per_node)
    # Sizes that split into no whole chunks (7 x 5, 3) and a scalar.
    grads = {
        "w": rng.randn(8, 7, 5).astype(np.float32),
        "b": rng.randn(8, 3).astype(np.float32),
        "s": rng.randn(8).astype(np.float32),
    }
    got = reduce_on_devices(ranks_per_node, grads)
    chex.assert_trees_all_close(got, jax.tree.map(lambda g: g.mean(0), grads), atol=1e-6)


def test_half_precision_on_the_wire():
    grads = {"w": np.random.RandomState(0).randn(8, 64).astype(np.float32)}
    got = reduce_on_devices(4, grads, jnp.float16)
    assert got["w"].dtype == jnp.float32
    np.testing.assert_allclose(got["w"], grads["w"].mean(0), atol=2e-3)


def loss_fn(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) @ params["v"] - batch["y"]) ** 2)


PARAMS = {
    "w": np.random.RandomState(1).randn(16, 32).astype(np.float32),
    "v": np.random.RandomState(2).randn(32, 3).astype(np.float32),
}
BATCH = {
    "x": np.random.RandomState(3).randn(32, 16).astype(np.float32),
    "y": np.random.RandomState(4).randn(32, 3).astype(np.float32),
}


def trained(strategy, steps=3):
    step = fleetjax.make_train_step(loss_fn, optax.adam(0.1), strategy)
    state = step.init(PARAMS)
    for _ in range(steps):
        state, _ = step(state, BATCH)
    return step, state


def hierarchical(ranks_per_node, **fields):
    return fleetjax.DistributedStrategy(
        use_hierarchical_allreduce=True,
        hierarchical_allreduce_inter_nranks=ranks_per_node,
        **fields,
    )


def test_training_equals_plain_data_parallel():
    _, expected = trained(fleetjax.DistributedStrategy())
    _, got = trained(hierarchical(4))
    chex.assert_trees_all_close(got.params, expected.params, rtol=1e-5, atol=1e-6)


def test_only_a_node_share_of_each_gradient_crosses_nodes():
    ranks, nodes = 4, 2
    step, state = trained(hierarchical(ranks), steps=1)
    found = collectives(step.lower(state, BATCH).compile().as_text())
    # The loss mean is the only all-reduce: no gradient is all-reduced.
    assert [c.arrays for c in found if c.op == "all-reduce"] == [[("f32", ())]]
    permutes = [c for c in found if c.op == "collective-permute"]
    node = lambda device: device // ranks  # noqa: E731  (dp is the mesh's only axis)
    crossing = [c for c in permutes if any(node(a) != node(b) for a, b in c.pairs)]
    within = [c for c in permutes if c not in crossing]
    assert all(node(a) == node(b) for c in within for a, b in c.pairs)
    assert all(node(a) != node(b) for c in crossing for a, b in c.pairs)
    # Per gradient: ring reduce-scatter and all-gather within the node (ranks - 1 steps each)
    # and across nodes (nodes - 1 each), on chunks of 1/ranks then 1/(ranks nodes).
    assert len(within) == 2 * 2 * (ranks - 1) and len(crossing) == 2 * 2 * (nodes - 1)
    sent_across = sum(c.result_bytes for c in crossing)
    gradient_bytes = sum(x.nbytes for x in PARAMS.values())
    assert sent_across == 2 * (nodes - 1) / nodes * gradient_bytes / ranks


def test_a_node_is_a_process_by_default():
    """One process here: its 8 replicas form one node, as with inter_nranks=8."""

    def permutes(strategy):
        step, state = trained(strategy, steps=1)
        found = collectives(step.lower(state, BATCH).compile().as_text())
        return sorted((c.shape, c.pairs) for c in found if c.op == "collective-permute")

    default = permutes(fleetjax.DistributedStrategy(use_hierarchical_allreduce=True))
    assert default == permutes(hierarchical(8))
    assert default != permutes(hierarchical(4))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hierarchical_allreduce_inter_nranks": 3}, "inter_nranks=3 must divide the 8"),
        (
            {"sharding": True, "sharding_configs": {"sharding_degree": 8, "stage": 2}},
            "does not combine with ZeRO stage 2/3",
        ),
        ({"dgc": True}, "does not combine with dgc"),
    ],
)
def test_what_it_cannot_do_is_an_error(fields, message):
    strategy = fleetjax.DistributedStrategy(use_hierarchical_allreduce=True, **fields)
    with pytest.raises(ValueError, match=message):
        step = fleetjax.make_train_step(loss_fn, fleetjax.optimizers.momentum(0.1), strategy)
        step.init(PARAMS)
        step(step.init(PARAMS), BATCH)
