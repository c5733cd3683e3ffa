"""LocalSGD and Adaptive LocalSGD on 8 simulated replicas against numpy references of Paddle's
step-counter rules; synchronous SGD as the k=1 limit; what XLA compiled."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from replicas import REPLICAS, ops_outside_branches, per_replica, replica, stacked

from fleetjax import optimizers as opt

ROWS = 4  # per replica


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def numpy_grads(params, batch):
    err = batch["x"] @ params["w"] + params["b"] - batch["y"]
    scale = 2 / err.size
    return {"w": scale * batch["x"].T @ err, "b": scale * err.sum(0)}


def make_params():
    rng = np.random.RandomState(0)
    return {"w": rng.randn(5, 3).astype(np.float32), "b": np.zeros(3, np.float32)}


def make_batches(steps, seed=1):
    """Per step, each replica's own rows, stacked: x (8, ROWS, 5), y (8, ROWS, 3)."""
    rng = np.random.RandomState(seed)
    return [
        {
            "x": rng.randn(REPLICAS, ROWS, 5).astype(np.float32),
            "y": (3 * rng.randn(REPLICAS, ROWS, 3)).astype(np.float32),
        }
        for _ in range(steps)
    ]


def train(tx, batches, losses=None):
    """Each replica steps on its own batch with its own gradient; stacked params and states."""
    init = per_replica(tx.init)

    def step(params, state, batch, value):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        value = loss if losses is None else value
        updates, state = tx.update(grads, state, params, value=value)
        return optax.apply_updates(params, updates), state

    step = per_replica(step)
    params, state, history = stacked(make_params()), init(stacked(make_params())), []
    for i, batch in enumerate(batches):
        value = np.zeros(REPLICAS, np.float32) if losses is None else losses[i]
        params, state = step(params, state, batch, value)
        history.append((params, state))
    return history, step


def paddle_localsgd(batches, lr, mu, k_steps, begin_step):
    """Paddle's LocalSGD with a Momentum inner optimizer, replica by replica, in float64."""
    params = [jax.tree.map(np.float64, make_params()) for _ in range(REPLICAS)]
    velocity = [jax.tree.map(np.zeros_like, p) for p in params]
    last_step, history = begin_step, []  # Paddle starts last_step at begin_step
    for step, batch in enumerate(batches, start=1):
        for r in range(REPLICAS):
            local = {name: np.float64(x[r]) for name, x in batch.items()}
            g = numpy_grads(params[r], local)
            velocity[r] = jax.tree.map(lambda v, g: mu * v + g, velocity[r], g)
            params[r] = jax.tree.map(lambda p, v: p - lr * v, params[r], velocity[r])
        if step <= begin_step or step - last_step == k_steps:
            mean = jax.tree.map(lambda *ps: np.mean(ps, axis=0), *params)
            params, last_step = [mean] * REPLICAS, step
        history.append((list(params), last_step))
    return history


def spread(stacked_params):
    return max(float(np.ptp(np.asarray(x), axis=0).max()) for x in jax.tree.leaves(stacked_params))


def test_replicas_drift_between_syncs_and_agree_after():
    batches = make_batches(steps=9)
    history, step = train(opt.localsgd(opt.momentum(0.05, 0.9), k_steps=3, begin_step=2), batches)
    expected = paddle_localsgd(batches, 0.05, 0.9, k_steps=3, begin_step=2)
    syncs = []
    for (params, state), (reference, last_step) in zip(history, expected, strict=True):
        for r in range(REPLICAS):
            got = replica(params, r)
            for name in got:
                np.testing.assert_allclose(got[name], reference[r][name], rtol=1e-5, atol=1e-5)
        assert int(state.last_step[0]) == last_step
        syncs.append(spread(params) < 1e-6)  # agree to rounding right after a sync
        assert syncs[-1] or spread(params) > 1e-2  # else they have drifted apart
    assert syncs == [True, True, False, False, True, False, False, True, False]
    # The parameters' all-reduce is only in the sync branch: no collective on other steps.
    params, state = history[-1]
    hlo = step.lower(params, state, batches[0], np.zeros(REPLICAS, np.float32)).compile()
    assert ops_outside_branches(hlo.as_text(), "all-reduce") == []
    assert "all-reduce" in hlo.as_text()


@pytest.mark.parametrize("inner", [opt.sgd(0.1), opt.momentum(0.05, 0.9)], ids=repr)
def test_k1_is_synchronous_sgd(inner):
    batches = make_batches(steps=4)
    history, _ = train(opt.localsgd(inner, k_steps=1, begin_step=1), batches)
    params, state = make_params(), inner.init(make_params())
    for batch, (got, _) in zip(batches, history, strict=True):
        whole = {name: x.reshape(-1, x.shape[-1]) for name, x in batch.items()}
        updates, state = inner.update(jax.grad(loss_fn)(params, whole), state, params)
        params = optax.apply_updates(params, updates)
        for r in (0, 7):
            mine = replica(got, r)
            for name in params:
                np.testing.assert_allclose(mine[name], params[name], rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize(
    "k_steps, begin_step, syncs",
    [(2, 0, [2, 4, 6, 8]), (4, 3, [1, 2, 3, 7]), (1, 1, list(range(1, 9)))],
)
def test_sync_steps(k_steps, begin_step, syncs):
    history, _ = train(opt.localsgd(opt.sgd(0.01), k_steps, begin_step), make_batches(steps=8))
    last = [int(state.last_step[0]) for _, state in history]
    assert sorted(set(last) - {0}) == syncs


def paddle_adaptive(losses, lrs, init_k_steps, begin_step):
    """Paddle's Adaptive LocalSGD counters: (k_steps, last_step) after each step, float32."""
    f32 = np.float32
    k_steps, last_step, history = init_k_steps, 0, []
    for step, (loss, lr) in enumerate(zip(losses, lrs, strict=True), start=1):
        avg = f32(np.sum(loss, dtype=f32) / f32(REPLICAS))
        if step == 1:
            loss_0, lr_0 = avg, f32(lr)
        if step <= begin_step:
            last_step = step
        elif step - last_step == k_steps:
            ratio = f32(lr_0) * avg / (f32(lr) * loss_0) * f32(init_k_steps)
            k_steps = int(np.clip(np.ceil(np.sqrt(ratio)), 1, 16))
            last_step = step
        history.append((k_steps, last_step))
    return history


def test_adaptive_k_sequence():
    steps = 24
    rng = np.random.RandomState(2)
    # Losses fall, then the learning rate drops tenfold: k shrinks, then grows (to the cap).
    losses = [
        4 / (1 + s) * rng.uniform(0.5, 1.5, REPLICAS).astype(np.float32) for s in range(steps)
    ]
    schedule = optax.piecewise_constant_schedule(0.1, {10: 0.1, 14: 0.1})
    tx = opt.adaptive_localsgd(opt.sgd(schedule), init_k_steps=4, begin_step=2)
    history, _ = train(tx, make_batches(steps), losses)
    got = [(int(s.k_steps[0]), int(s.last_step[0])) for _, s in history]
    expected = paddle_adaptive(losses, [schedule(s) for s in range(steps)], 4, 2)
    assert got == expected
    assert len({k for k, _ in got}) >= 3, got  # k really moved


def test_adaptive_paddle_numbers():
    """Section 4.7: lr_0=0.1, loss_0=2.0, init_k=4."""
    cases = [(0.5, 0.1), (1.8, 0.01), (1.8, 0.001)]
    assert [int(opt.next_k_steps(4, 0.1, 2.0, lr, loss)) for loss, lr in cases] == [1, 6, 16]


def test_errors():
    with pytest.raises(ValueError, match="k_steps must be an int >= 1, got 0"):
        opt.localsgd(opt.sgd(), k_steps=0)
    with pytest.raises(ValueError, match="opt_state holds no injected learning rate"):
        opt.adaptive_localsgd(optax.sgd(0.1)).init(make_params())
    tx = opt.adaptive_localsgd(opt.sgd(0.1))
    message = r"needs this replica's loss: call update\(grads, state, params, value=loss\)"
    with pytest.raises(ValueError, match=message):
        tx.update(make_params(), tx.init(make_params()), make_params())
