"""LARS and LAMB against numpy references of Paddle's `lars_momentum` and `lamb` kernels, and
Paddle's own numbers (reference section 6, cases 18-20)."""

import chex
import jax
import numpy as np
import optax
import pytest

from fleetjax import optimizers as opt


def model_params(seed=0):
    """A bias (excluded by name), a zero tensor (the norm guard) and two weights."""
    rng = np.random.RandomState(seed)
    return {
        "params": {
            "dense_0": {
                "kernel": rng.randn(6, 4).astype(np.float32),
                "bias": rng.randn(4).astype(np.float32),
            },
            "zero": np.zeros((3, 3), np.float32),
            "head": {"kernel": rng.randn(4, 2).astype(np.float32)},
        }
    }


def random_grads(params, steps, seed=1):
    rng = np.random.RandomState(seed)
    draw = lambda p: rng.randn(*p.shape).astype(np.float32)  # noqa: E731
    return [jax.tree.map(draw, params) for _ in range(steps)]


def run(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def numpy_steps(kernel, params, grads):
    """Applies `kernel(name, p, g, state, t) -> (p, state)` leaf by leaf, t = 1, 2, ..."""
    names = jax.tree.leaves(opt.param_names(params))
    leaves = [np.asarray(p, np.float64) for p in jax.tree.leaves(params)]
    states = [None] * len(leaves)
    for t, step_grads in enumerate(grads, start=1):
        for i, g in enumerate(jax.tree.leaves(step_grads)):
            leaves[i], states[i] = kernel(names[i], leaves[i], np.float64(g), states[i], t)
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def paddle_lars(lr, mu, coeff, wd, eps, exclude):
    """Paddle's CPU `lars_momentum` kernel, substring exclusion from the fleet LARS optimizer."""

    def kernel(name, p, g, v, t):
        decay = 0.0 if any(e in name for e in exclude) else wd
        pn, gn = np.linalg.norm(p), np.linalg.norm(g)
        rate = lr(t) if callable(lr) else lr
        local_lr = rate
        if decay > 0 and pn > 0 and gn > 0:
            local_lr = rate * coeff * pn / (gn + decay * pn + eps)
        v = mu * (0 if v is None else v) + local_lr * (g + decay * p)
        return p - v, v

    return kernel


@pytest.mark.parametrize("schedule", [False, True], ids=["constant_lr", "lr_schedule"])
def test_lars_is_paddles(schedule):
    params = model_params()
    grads = random_grads(params, steps=5)
    # A schedule checks that the learning rate sits inside the velocity, as in Paddle.
    lr = optax.exponential_decay(0.5, 1, 0.6) if schedule else 0.5
    numpy_lr = (lambda t: 0.5 * 0.6 ** (t - 1)) if schedule else 0.5
    exclude = ["dense_0/bias"]
    tx = opt.lars(lr, 0.9, 0.02, 0.01, 1e-4, exclude_from_weight_decay=exclude)
    expected = numpy_steps(paddle_lars(numpy_lr, 0.9, 0.02, 0.01, 1e-4, exclude), params, grads)
    got = run(tx, params, grads)
    chex.assert_trees_all_close(got, expected, rtol=2e-5, atol=1e-6)
    # The excluded bias took plain momentum steps with the global learning rate.
    plain = numpy_steps(paddle_lars(numpy_lr, 0.9, 0.02, 0.0, 0.0, []), params, grads)
    bias = got["params"]["dense_0"]["bias"], plain["params"]["dense_0"]["bias"]
    np.testing.assert_allclose(*bias, rtol=2e-5)
    kernel = got["params"]["head"]["kernel"], plain["params"]["head"]["kernel"]
    assert not np.allclose(*kernel, rtol=1e-2)


def test_lars_zero_param_takes_a_plain_step():
    """||p|| = 0: local_lr = lr, so the first step is -lr * g (the trust ratio would be 0)."""
    params = model_params()
    grads = random_grads(params, steps=1)
    got = run(opt.lars(0.5, 0.9, 0.02, 0.01), params, grads)["params"]["zero"]
    np.testing.assert_allclose(got, -0.5 * grads[0]["params"]["zero"], rtol=1e-6)


def test_lars_excludes_by_substring():
    params = model_params()
    grads = random_grads(params, steps=2)
    tx = opt.lars(0.5, 0.9, 0.02, 0.01, exclude_from_weight_decay=["dense"])
    got = run(tx, params, grads)
    expected = numpy_steps(paddle_lars(0.5, 0.9, 0.02, 0.01, 0.0, ["dense"]), params, grads)
    chex.assert_trees_all_close(got, expected, rtol=2e-5, atol=1e-6)
    plain = numpy_steps(paddle_lars(0.5, 0.9, 0.02, 0.0, 0.0, []), params, grads)
    chex.assert_trees_all_close(got["params"]["dense_0"], plain["params"]["dense_0"], rtol=2e-5)


def test_lars_paddle_numbers():
    """Section 4.4 [verified]: two identical-gradient steps."""
    params = {"w": np.array([[1, 2], [3, 4]], np.float32)}
    grads = [{"w": np.array([[0.1, 0.2], [0.3, 0.4]], np.float32)}] * 2
    tx = opt.lars(0.1, 0.9, lars_coeff=1e-3, lars_weight_decay=5e-4, epsilon=0)
    one, two = run(tx, params, grads[:1])["w"], run(tx, params, grads)["w"]
    np.testing.assert_allclose(one.ravel(), [0.9999, 1.9998, 2.9997, 3.9996], rtol=1e-6)
    np.testing.assert_allclose(two.ravel(), [0.99971, 1.9994199, 2.99913, 3.9988399], rtol=1e-6)


def test_lars_paddle_unit_test_shape():
    """Paddle's TestLarsMomentumOp: mu=1e-4, coeff=1e-3, wd=5e-4, lr=1e-3 on a (123, 321)."""
    rng = np.random.RandomState(0)
    params = {"p": rng.uniform(-1, 1, (123, 321)).astype(np.float32)}
    grads = [{"p": rng.uniform(-1, 1, (123, 321)).astype(np.float32)}]
    got = run(opt.lars(1e-3, 1e-4, 1e-3, 5e-4), params, grads)
    expected = numpy_steps(paddle_lars(1e-3, 1e-4, 1e-3, 5e-4, 0.0, []), params, grads)
    np.testing.assert_allclose(got["p"], expected["p"], rtol=1e-6)


def paddle_lamb(lr, wd, b1, b2, eps, exclude, always_adapt=False):
    """Paddle's `lamb` kernel; beta_pow starts at beta; suffix exclusion from fleet's LAMB."""

    def kernel(name, p, g, state, t):
        m, v = state if state is not None else (0.0, 0.0)
        decay = 0.0 if any(name.endswith(e) for e in exclude) else wd
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + decay * p
        trust = 1.0
        if decay > 0 or always_adapt:
            pn, rn = np.linalg.norm(p), np.linalg.norm(r)
            trust = pn / rn if pn > 0 and rn > 0 else 1.0
        return p - lr * trust * r, (m, v)

    return kernel


@pytest.mark.parametrize("always_adapt", [False, True])
def test_lamb_is_paddles(always_adapt):
    params = model_params(seed=2)
    grads = random_grads(params, steps=5, seed=3)
    # "dense_0" is no suffix of any name: nothing is excluded by it (LARS would exclude two).
    exclude = ["bias", "dense_0"]
    tx = opt.lamb(0.01, 0.05, 0.8, 0.9, 1e-6, exclude, always_adapt=always_adapt)
    got = run(tx, params, grads)
    kernel = paddle_lamb(0.01, 0.05, 0.8, 0.9, 1e-6, exclude, always_adapt)
    expected = numpy_steps(kernel, params, grads)
    chex.assert_trees_all_close(got, expected, rtol=2e-5, atol=1e-6)
    adam = run(optax.adam(0.01, 0.8, 0.9, 1e-6), params, grads)  # an excluded one is plain Adam
    bias = got["params"]["dense_0"]["bias"], adam["params"]["dense_0"]["bias"]
    assert np.allclose(*bias, rtol=2e-5) != always_adapt


@pytest.mark.parametrize(
    "name, exclude, expected",
    [
        ("fc.w_0", [], [0.98077106, -2.0186577, 3.0184674, 0.48086625]),  # trust 1.903857
        ("fc.b_0", ["b_0"], [0.99, -2.01, 3.01, 0.49]),  # excluded: trust 1
    ],
)
def test_lamb_paddle_numbers(name, exclude, expected):
    """Section 4.5 [verified] / section 6 cases 18-19, one step."""
    params = {name: np.array([1, -2, 3, 0.5], np.float32)}
    grads = [{name: np.array([0.5, 0.1, -0.2, 1.0], np.float32)}]
    tx = opt.lamb(0.01, 0.01, 0.9, 0.999, 1e-6, exclude_from_weight_decay=exclude)
    np.testing.assert_allclose(run(tx, params, grads)[name], expected, rtol=1e-6)


def test_lamb_paddle_numbers_zero_param():
    params = {"p": np.zeros(4, np.float32)}
    grads = [{"p": np.array([0.5, 0.1, -0.2, 1.0], np.float32)}]
    got = run(opt.lamb(0.01, 0.01, 0.9, 0.999, 1e-6), params, grads)["p"]
    np.testing.assert_allclose(got, [-0.00999998, -0.0099999, 0.00999995, -0.00999999], rtol=1e-6)


def test_they_need_params_and_name_lists():
    params = model_params()
    for tx in (opt.lars(), opt.lamb()):
        with pytest.raises(ValueError, match="needs the parameters: call update"):
            tx.update(params, tx.init(params))
    with pytest.raises(TypeError, match=r"exclude_from_weight_decay must be a list .* got 'bias'"):
        opt.lamb(exclude_from_weight_decay="bias")
    assert opt.lars(0.1).kind == "LarsMomentum" and opt.lamb().kind == "Lamb"
    assert float(opt.get_lr(opt.lamb(0.02).init(params))) == pytest.approx(0.02)
