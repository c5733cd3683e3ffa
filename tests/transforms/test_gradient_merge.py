"""Gradient merge across calls (Paddle's) and in one call (micro-batches)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo import collectives, computations

import fleetjax
from fleetjax.transforms.gradient_merge import microbatched


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def make(seed=0, rows=64):
    rng = np.random.RandomState(seed)
    params = {
        "w1": rng.randn(8, 32).astype(np.float32) / 3,
        "w2": rng.randn(32, 2).astype(np.float32) / 6,
    }
    batch = {"x": rng.randn(rows, 8).astype(np.float32), "y": rng.randn(rows, 2).astype(np.float32)}
    return params, batch


def merge(k, avg=True, mode="across_calls"):
    s = fleetjax.DistributedStrategy(gradient_merge=True)
    s.gradient_merge_configs = {"k_steps": k, "avg": avg, "mode": mode}
    return s


def joined(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_paddle_verified_case():
    def dot_loss(w, batch):
        return jnp.mean(batch["x"] @ w)

    step = fleetjax.make_train_step(dot_loss, optax.sgd(0.1), merge(2))
    state = step.init(jnp.ones(2))
    seen = []
    for x in ([1, 2], [3, 4], [5, 6], [7, 8]):
        state, _ = step(state, {"x": np.tile(np.float32(x), (8, 1))})
        seen.append(np.asarray(state.params).tolist())
    np.testing.assert_allclose(seen, [[1, 1], [0.8, 0.7], [0.8, 0.7], [0.2, 0.0]], atol=1e-6)


def test_k_calls_equal_one_step_on_the_joined_batches():
    params, _ = make()
    batches = [make(seed)[1] for seed in range(1, 5)]
    tx = optax.adam(1e-2)
    step = fleetjax.make_train_step(loss_fn, tx, merge(4))
    state = step.init(params)
    inner_states = []
    for batch in batches:
        state, _ = step(state, batch)
        inner_states.append(jax.device_get(state.opt_state.inner_opt_state))
    big = fleetjax.make_train_step(loss_fn, tx)
    expected, _ = big(big.init(params), joined(batches))
    chex.assert_trees_all_close(state.params, expected.params, rtol=1e-5, atol=1e-6)
    # The optimizer (and its step count) ran once, on the 4th call.
    counts = [int(s[0].count) for s in inner_states]
    assert counts == [0, 0, 0, 1]


def test_sum_mode_applies_k_times_the_mean_gradient():
    params, _ = make()
    batches = [make(seed)[1] for seed in range(1, 5)]
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.01), merge(4, avg=False))
    state = step.init(params)
    for batch in batches:
        state, _ = step(state, batch)
    big = fleetjax.make_train_step(loss_fn, optax.sgd(0.04))
    expected, _ = big(big.init(params), joined(batches))
    chex.assert_trees_all_close(state.params, expected.params, rtol=1e-5, atol=1e-6)


def test_in_step_equals_the_large_batch_with_less_temp_memory():
    params, batch = make(rows=2048)
    tx = optax.adam(1e-2)
    micro = fleetjax.make_train_step(loss_fn, tx, merge(4, mode="in_step"))
    big = fleetjax.make_train_step(loss_fn, tx)
    a, ma = micro(micro.init(params), batch)
    b, mb = big(big.init(params), batch)
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-5)
    chex.assert_trees_all_close(a.params, b.params, rtol=1e-5, atol=1e-6)

    def temp(step):
        compiled = step.lower(step.init(params), batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp(micro) < 0.6 * temp(big), (temp(micro), temp(big))


def test_in_step_reduces_the_gradients_once_not_once_per_micro_batch():
    params, batch = make(rows=256)
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), merge(4, mode="in_step"))
    hlo = step.lower(step.init(params), batch).compile().as_text()
    where = {
        name: [c.arrays for c in collectives(text)]
        for name, text in computations(hlo).items()
        if collectives(text)
    }
    # One all-reduce of the gradients (and the loss) after the micro-batch loop; none inside.
    assert list(where) == ["ENTRY"]
    assert sorted(where["ENTRY"][0]) == [("f32", ()), ("f32", (8, 32)), ("f32", (32, 2))]


def test_in_step_sum_mode_and_auto_parallel_strategy():
    params, batch = make()
    s = fleetjax.Strategy({"gradient_merge": {"enable": True, "k_steps": 2, "avg": False}})
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.01), s)
    state, _ = step(step.init(params), batch)
    big = fleetjax.make_train_step(loss_fn, optax.sgd(0.02))
    expected, _ = big(big.init(params), batch)
    chex.assert_trees_all_close(state.params, expected.params, rtol=1e-5, atol=1e-6)


def test_batch_must_split_into_micro_batches_on_every_device():
    params, batch = make(rows=20)
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), merge(2, mode="in_step"))
    with pytest.raises(ValueError, match=r"20 rows, which do not split evenly over the 8"):
        step(step.init(params), batch)
    params, batch = make(rows=40)
    with pytest.raises(
        ValueError, match=r"40 rows, which do not split into k_steps=2 micro-batches"
    ):
        step(step.init(params), batch)


def test_microbatched_alone():
    params, batch = make(rows=12)

    def grad_fn(params, model_state, batch):
        (loss, aux), grads = jax.value_and_grad(lambda p, b: (loss_fn(p, b), {}), has_aux=True)(
            params, batch
        )
        # A model state: a running statistic of the batch and an integer counter.
        new_state = {"mean": batch["y"].mean(0), "count": model_state["count"] + 1}
        return (loss, aux, new_state), grads

    state = {"mean": jnp.zeros(2), "count": jnp.zeros((), jnp.int32)}
    (loss, _, new_state), grads = jax.jit(microbatched(grad_fn, 3))(params, state, batch)
    (ref_loss, _, ref_state), ref_grads = grad_fn(params, state, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
    # Floats: the micro-batches' mean (here the whole batch's); the counter: the last one's.
    np.testing.assert_allclose(new_state["mean"], ref_state["mean"], rtol=1e-6)
    assert new_state["count"] == 1 and new_state["count"].dtype == jnp.int32
    with pytest.raises(ValueError, match="k_steps must be a positive int, got 0"):
        microbatched(grad_fn, 0)


def test_sharding_gradient_merge_acc_step():
    s = merge(4)
    s.sharding = True
    s.sharding_configs = {"gradient_merge_acc_step": 2, "sharding_degree": 2}
    with pytest.raises(ValueError, match="gradient_merge_configs.k_steps=4 but sharding_configs"):
        fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
    s.gradient_merge = False  # the sharding key alone merges across calls
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
    assert step.plan.gradient_merge == fleetjax.plan.GradientMerge(2, True, False)
