"""Paddle's SGD / Momentum / Adam / AdamW as optax transformations; get_lr / set_lr; names."""

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fleetjax import optimizers as opt


def random_problem(seed=0, steps=4):
    rng = np.random.RandomState(seed)
    params = {"w": rng.randn(5, 3).astype(np.float32), "b": rng.randn(3).astype(np.float32)}
    grads = [
        {k: (3 * rng.randn(*v.shape)).astype(np.float32) for k, v in params.items()}
        for _ in range(steps)
    ]
    return params, grads


def run(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def clip(g, max_norm):
    norm = np.sqrt(np.sum(g * g))
    return g * (max_norm / norm) if norm > max_norm else g


def paddle_momentum(params, grads, lr, mu, nesterov=False, wd=0.0, clip_norm=None):
    """Paddle: ClipGradByNorm, then L2Decay, then the momentum op."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    velocity = {k: np.zeros_like(v) for k, v in params.items()}
    for step_grads in grads:
        for k, g in step_grads.items():
            g = g.astype(np.float64)
            g = clip(g, clip_norm) if clip_norm else g
            g = g + wd * params[k]
            velocity[k] = mu * velocity[k] + g
            params[k] = params[k] - lr * (g + mu * velocity[k] if nesterov else velocity[k])
    return params


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"use_nesterov": True}, {"weight_decay": 0.01, "clip_norm": 2.0}],
    ids=["plain", "nesterov", "l2_and_clip"],
)
def test_momentum_is_paddles(kwargs):
    params, grads = random_problem()
    got, _ = run(opt.momentum(0.1, 0.9, **kwargs), params, grads)
    expected = paddle_momentum(
        params,
        grads,
        0.1,
        0.9,
        nesterov=kwargs.get("use_nesterov", False),
        wd=kwargs.get("weight_decay", 0.0),
        clip_norm=kwargs.get("clip_norm"),
    )
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)


def test_sgd_follows_a_schedule():
    params, grads = random_problem()
    schedule = optax.exponential_decay(0.5, transition_steps=1, decay_rate=0.5)
    got, state = run(opt.sgd(schedule), params, grads)
    expected = {k: v.astype(np.float64) for k, v in params.items()}
    for i, g in enumerate(grads):
        expected = {k: expected[k] - 0.5 * 0.5**i * g[k] for k in g}
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)
    assert float(opt.get_lr(state)) == pytest.approx(0.5 * 0.5**3)  # the latest step's


def paddle_adam(params, grads, lr, b1, b2, eps, wd=0.0, decoupled=False):
    """Paddle's adam kernel (lr_t form), L2Decay for Adam, `p *= 1 - lr wd` for AdamW."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    for t, step_grads in enumerate(grads, start=1):
        for k, g in step_grads.items():
            if decoupled:
                params[k] = params[k] * (1 - lr * wd)
            else:
                g = g + wd * params[k]
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            lr_t = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
            params[k] = params[k] - lr_t * m[k] / (np.sqrt(v[k]) + eps * np.sqrt(1 - b2**t))
    return params


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam_l2", "adamw"])
def test_adam_and_adamw_are_paddles(decoupled):
    params, grads = random_problem(seed=1)
    make = opt.adamw if decoupled else opt.adam
    got, _ = run(make(0.01, 0.8, 0.95, 1e-6, weight_decay=0.05), params, grads)
    expected = paddle_adam(params, grads, 0.01, 0.8, 0.95, 1e-6, wd=0.05, decoupled=decoupled)
    chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)


def test_they_are_ordinary_optax_transformations_that_remember():
    tx = opt.momentum(0.1, 0.8, use_nesterov=True, clip_norm=1.0)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    assert tx.kind == "Momentum"
    assert dict(tx.hyperparams) == {
        "learning_rate": 0.1,
        "momentum": 0.8,
        "use_nesterov": True,
        "weight_decay": 0.0,
        "clip_norm": 1.0,
    }
    assert repr(tx) == (
        "Momentum(learning_rate=0.1, momentum=0.8, use_nesterov=True, weight_decay=0.0, "
        "clip_norm=1.0)"
    )
    assert [opt.sgd().kind, opt.adam().kind, opt.adamw().kind] == ["SGD", "Adam", "AdamW"]
    assert opt.adamw().hyperparams["weight_decay"] == 0.01  # Paddle's AdamW default
    params, grads = random_problem(steps=2)
    chained, _ = run(optax.chain(optax.identity(), tx), params, grads)
    alone, _ = run(tx, params, grads)
    chex.assert_trees_all_equal(chained, alone)


def test_get_and_set_lr_inside_wrapped_states():
    params, grads = random_problem(steps=1)
    tx = optax.MultiSteps(optax.chain(optax.identity(), opt.momentum(0.1)), every_k_schedule=1)
    state = tx.init(params)
    assert float(opt.get_lr(state)) == pytest.approx(0.1)
    state = opt.set_lr(state, 0.25)
    assert float(opt.get_lr(state)) == 0.25
    updates, state = tx.update(grads[0], state, params)
    chex.assert_trees_all_close(updates, jax.tree.map(lambda g: -0.25 * g, grads[0]), rtol=1e-6)
    assert float(opt.get_lr(jax.jit(opt.set_lr)(state, 0.5))) == 0.5


def test_lr_errors():
    params, _ = random_problem()
    with pytest.raises(ValueError, match="opt_state holds no injected learning rate; build the"):
        opt.get_lr(optax.sgd(0.1).init(params))
    both = optax.chain(opt.sgd(0.1), opt.sgd(0.2)).init(params)
    with pytest.raises(ValueError, match="holds 2 injected learning rates"):
        opt.set_lr(both, 0.3)
    scheduled = opt.sgd(optax.constant_schedule(0.1)).init(params)
    with pytest.raises(ValueError, match="cannot change a learning rate that follows a schedule"):
        opt.set_lr(scheduled, 0.3)
    state = opt.sgd(0.1).init(params)
    with pytest.raises(TypeError, match="set_lr needs a number, got '0.3'"):
        opt.set_lr(state, "0.3")
    with pytest.raises(TypeError, match=r"set_lr needs a scalar, got shape \(2,\)"):
        opt.set_lr(state, jnp.ones(2))


def test_bad_arguments():
    with pytest.raises(ValueError, match="learning_rate must be > 0, got -1"):
        opt.momentum(-1)
    with pytest.raises(TypeError, match="learning_rate must be a number or an optax schedule"):
        opt.sgd("0.1")
    with pytest.raises(TypeError, match="momentum must be a number, got '0.9'"):
        opt.momentum(0.1, "0.9")
    with pytest.raises(ValueError, match=r"beta1 must be in \[0.0, 1.0\), got 1.0"):
        opt.adam(beta1=1.0)
    with pytest.raises(ValueError, match="clip_norm must be > 0"):
        opt.sgd(clip_norm=0)


class Block(NamedTuple):
    kernel: jax.Array
    bias: jax.Array


def test_param_names():
    params = {
        "params": {"dense_0": {"kernel": jnp.ones(2), "bias": jnp.ones(1)}},
        "stack": [jnp.ones(1), Block(jnp.ones(1), jnp.ones(1))],
    }
    assert opt.param_names(params) == {
        "params": {"dense_0": {"kernel": "params/dense_0/kernel", "bias": "params/dense_0/bias"}},
        "stack": ["stack/0", Block("stack/1/kernel", "stack/1/bias")],
    }
