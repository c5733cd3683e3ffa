"""`has_state`: variables the loss updates but gradients do not train (batch-norm running
statistics) live in `TrainState.model_state` and come out as one device computes them, on every
path of the step: GSPMD, the explicit reducers, in-step gradient merge and per-replica DGC."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleetjax
from fleetjax.layers import BatchNorm

REPLICAS = 8


class Net(nnx.Module):
    def __init__(self, sync: bool):
        rngs = nnx.Rngs(0)
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.norm = BatchNorm(16, sync=sync, replicas=REPLICAS)
        self.out = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jnp.tanh(self.norm(self.hidden(x))))


def model(sync):
    """(loss_fn, params, model_state) of a Net with sync or local batch norm."""
    graphdef, params, stats = nnx.split(Net(sync), nnx.Param, nnx.BatchStat)

    def loss_fn(params, stats, batch):
        net = nnx.merge(graphdef, params, stats)
        loss = jnp.mean((net(batch["x"]) - batch["y"]) ** 2)
        return loss, nnx.state(net, nnx.BatchStat)

    return loss_fn, params, stats


def batches(n=3, rows=64):
    rng = np.random.RandomState(0)
    return [
        {
            "x": rng.randn(rows, 6).astype(np.float32) * 2 + 1,
            "y": rng.randn(rows, 2).astype(np.float32),
        }
        for _ in range(n)
    ]


def trained(strategy, sync, optimizer):
    loss_fn, params, stats = model(sync)
    step = fleetjax.make_train_step(loss_fn, optimizer, strategy, has_state=True)
    state = step.init(params, model_state=stats)
    losses = []
    for batch in batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return jax.device_get(state), losses


def one_device(sync, optimizer, micro_batches=1):
    """The same training by hand: plain `jax.jit` on one device, the whole batch at once (the
    layer groups the rows into the replicas' shares itself, so local statistics are comparable),
    or `micro_batches` interleaved micro-batches whose new statistics are averaged."""
    loss_fn, params, stats = model(sync)
    # The statistics are rebuilt inside the gradient's trace, as the step does: nnx refuses to
    # update Variables made at another trace level.
    rebuilt = lambda p, s, b: loss_fn(p, jax.tree.map(lambda x: x, s), b)  # noqa: E731
    grad = jax.value_and_grad(rebuilt, has_aux=True)

    @jax.jit
    def step(params, stats, opt_state, batch):
        parts = [
            jax.tree.map(lambda x, i=i: x[i::micro_batches], batch) for i in range(micro_batches)
        ]
        outs = [grad(params, stats, part) for part in parts]
        mean = lambda *xs: sum(xs) / micro_batches  # noqa: E731
        loss = mean(*(loss for (loss, _), _ in outs))
        stats = jax.tree.map(mean, *(new for (_, new), _ in outs))
        grads = jax.tree.map(mean, *(g for _, g in outs))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    with jax.default_device(jax.devices()[0]):
        opt_state, losses = optimizer.init(params), []
        for batch in batches():
            params, stats, opt_state, loss = step(params, stats, opt_state, batch)
            losses.append(float(loss))
    return fleetjax.TrainState(0, params, opt_state, None, None, stats), losses


def assert_same_training(got, expected):
    (state, losses), (ref_state, ref_losses) = got, expected
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    chex.assert_trees_all_close(state.params, ref_state.params, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(state.model_state, ref_state.model_state, rtol=1e-5, atol=1e-6)


SYNC = pytest.mark.parametrize("sync", [True, False], ids=["sync", "local"])


@SYNC
@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"fp16_allreduce": True, "fp16_allreduce_dtype": "bfloat16"},
        {"sharding": True, "sharding_configs": {"sharding_degree": 8, "stage": 2}},
    ],
    ids=["gspmd", "explicit-reducer", "zero2"],
)
def test_running_statistics_equal_one_device(sync, fields):
    strategy = fleetjax.DistributedStrategy(**fields)
    got = trained(strategy, sync, optax.sgd(0.1))
    expected = one_device(sync, optax.sgd(0.1))
    if "fp16_allreduce" in fields:  # gradients travel in bfloat16: the statistics follow loosely
        (state, losses), (ref, ref_losses) = got, expected
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)
        chex.assert_trees_all_close(state.model_state, ref.model_state, rtol=1e-2, atol=1e-3)
    else:
        assert_same_training(got, expected)
    stats = got[0].model_state["norm"]
    assert stats["mean"][...].shape == ((1, 16) if sync else (REPLICAS, 16))
    assert np.abs(stats["mean"][...]).max() > 0.05  # they moved from their zeros


@SYNC
def test_in_step_merge_averages_the_micro_batches_statistics(sync):
    merge = fleetjax.DistributedStrategy(
        gradient_merge=True, gradient_merge_configs={"k_steps": 2, "mode": "in_step"}
    )
    got = trained(merge, sync, optax.sgd(0.1))
    assert_same_training(got, one_device(sync, optax.sgd(0.1), micro_batches=2))


@SYNC
def test_per_replica_optimizers_carry_the_statistics(sync):
    """DGC before its rampup is dense momentum SGD, with the whole update per replica."""
    dgc = fleetjax.DistributedStrategy(dgc=True, dgc_configs={"rampup_begin_step": 100})
    momentum = fleetjax.optimizers.momentum(0.05, momentum=0.9)
    got = trained(dgc, sync, momentum)
    assert_same_training(got, one_device(sync, momentum))


def test_local_statistics_differ_per_replica_sync_ones_do_not():
    def first_means(sync):
        loss_fn, params, stats = model(sync)
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), has_state=True)
        state, _ = step(step.init(params, model_state=stats), batches(1)[0])
        return np.asarray(state.model_state["norm"]["mean"][...])

    local, sync = first_means(False), first_means(True)
    assert local.shape == (REPLICAS, 16) and sync.shape == (1, 16)
    assert not np.allclose(local[0], local[1])
    # Equal shares: the whole batch's mean is the mean of the replicas' means.
    np.testing.assert_allclose(sync[0], local.mean(0), rtol=1e-5, atol=1e-6)


def test_the_state_is_placed_by_its_logical_names():
    loss_fn, params, stats = model(sync=False)
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), has_state=True)
    state = step.init(params, model_state=stats)
    mean = state.model_state["norm"]["mean"][...]
    assert mean.sharding.spec == jax.P(("dp", "sharding"), None)
    assert mean.addressable_shards[0].data.shape == (1, 16)


def test_the_model_state_must_be_asked_for_and_given():
    loss_fn, params, stats = model(sync=True)
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), has_state=True)
    with pytest.raises(ValueError, match=r"has_state=True\) needs the model state"):
        step.init(params)
    plain = fleetjax.make_train_step(lambda p, b: 0.0, optax.sgd(0.1))
    with pytest.raises(ValueError, match="made without has_state=True"):
        plain.init(params, model_state=stats)
