"""DGC on 8 simulated replicas against a numpy reference of Paddle's `dgc`, `dgc_clip_by_norm`,
`dgc_momentum` and sparse all-reduce; the sparsity schedule; what XLA compiled for the exchange."""

import math

import jax
import numpy as np
import optax
import pytest
from hlo import collectives
from jax import lax
from replicas import AXES, REPLICAS, bus_bytes, per_replica, replica, stacked

from fleetjax import optimizers as opt
from fleetjax.mesh import build_mesh

PADDLE_SPARSITY = [0.75, 0.9375, 0.984375, 0.996, 0.999]


def test_sparsity_schedule_and_k():
    """Section 4.3 / section 6 case 27: rampup_step=10 over five stages from step 0."""
    at = [opt.sparsity_at(step, 0, 10, PADDLE_SPARSITY) for step in range(12)]
    assert at == [0.75] * 2 + [0.9375] * 2 + [0.984375] * 2 + [0.996] * 2 + [0.999] * 4
    assert [opt.top_k_count(102400, s) for s in PADDLE_SPARSITY] == [25600, 6400, 1600, 409, 102]
    # The seed's example: rampup_step=100 gives each stage 20 steps, counted from the begin step.
    assert opt.sparsity_at(127, 128, 100, PADDLE_SPARSITY) is None  # dense before it
    stages = [opt.sparsity_at(128 + s, 128, 100, PADDLE_SPARSITY) for s in (0, 19, 20, 99, 500)]
    assert stages == [0.75, 0.75, 0.9375, 0.999, 0.999]
    assert opt.sparsity_at(0, 0, 1, [0.999]) == 0.999  # fleet's default


def test_eligibility():
    assert opt.is_eligible(jax.ShapeDtypeStruct((128, 128), np.float32))
    assert not opt.is_eligible(jax.ShapeDtypeStruct((16383,), np.float32))
    assert not opt.is_eligible(jax.ShapeDtypeStruct((128, 128), np.float16))


def make_params(seed=0):
    rng = np.random.RandomState(seed)
    return {
        "big": rng.randn(128, 128).astype(np.float32),  # 16384: the smallest eligible size
        "small": rng.randn(16383).astype(np.float32),  # one short: dense momentum
    }


def local_grads(params, steps, seed=1):
    """Per step, a different gradient for each replica (stacked), some with large norms."""
    rng = np.random.RandomState(seed)
    scale = lambda: rng.uniform(0.1, 3.0)  # noqa: E731
    draw = lambda p: (scale() * rng.randn(REPLICAS, *p.shape)).astype(np.float32)  # noqa: E731
    return [jax.tree.map(draw, params) for _ in range(steps)]


def train(tx, params, grads):
    """The DGC optimizer on every replica; returns the stacked params and state after each step."""
    init = per_replica(tx.init)

    def step(g, state, p):
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state

    step = per_replica(step)
    p, state, history = stacked(params), init(stacked(params)), []
    for g in grads:
        p, state = step(g, state, p)
        history.append((p, state))
    return history


def clip(g, max_norm):
    norm = np.sqrt(np.sum(g * g))
    return g * (max_norm / norm) if norm > max_norm else g


def paddle_dgc(params, grads, lr, mu, nesterov, wd, clip_norm, begin, rampup_step, sparsity):
    """Paddle's DGC, replica by replica, in float64; grads[t][name] is (N, ...) local grads."""
    n = REPLICAS
    p = {k: v.astype(np.float64) for k, v in params.items()}
    u = {k: np.zeros((n, *v.shape)) for k, v in p.items()}
    v = {k: np.zeros((n, *x.shape)) for k, x in p.items()}
    history = []
    for t, step_grads in enumerate(grads):
        for name, local in step_grads.items():
            local = local.astype(np.float64)
            if name == "small" or t < begin:  # dense momentum on the all-reduced gradient
                g = local.mean(0)
                g = clip(g, clip_norm) if (clip_norm and name == "small") else g
                g = g + wd * p[name]
                u[name] = mu * u[name] + g  # equal on every replica
                direction = g + mu * u[name][0] if nesterov else u[name][0]
            else:
                k = opt.top_k_count(p[name].size, opt.sparsity_at(t, begin, rampup_step, sparsity))
                total = np.zeros(p[name].size)
                for r in range(n):
                    g = local[r]
                    if clip_norm:  # Paddle clips its 1/N-scaled gradient to clip_norm/sqrt(N)
                        g = n * clip(g / n, clip_norm / math.sqrt(n))
                    g = g + wd * p[name]
                    if nesterov:
                        u[name][r] = mu * (u[name][r] + g)
                        v[name][r] = v[name][r] + u[name][r] + g
                    else:
                        u[name][r] = mu * u[name][r] + g
                        v[name][r] = v[name][r] + u[name][r]
                    flat_u, flat_v = u[name][r].reshape(-1), v[name][r].reshape(-1)
                    sent = np.argsort(-np.abs(flat_v))[:k]
                    total[sent] += flat_v[sent]
                    flat_u[sent] = 0
                    flat_v[sent] = 0
                direction = (total / n).reshape(p[name].shape)
            p[name] = p[name] - lr * direction
        history.append(({k: x.copy() for k, x in p.items()}, {k: x.copy() for k, x in u.items()}))
    return history


@pytest.mark.parametrize(
    "nesterov, wd, clip_norm", [(False, 0.0, None), (True, 1e-3, 40.0)], ids=["plain", "all"]
)
def test_dgc_is_paddles(nesterov, wd, clip_norm):
    params, config = make_params(), {"rampup_begin_step": 2, "rampup_step": 3}
    sparsity = [0.9, 0.99]  # steps 0-1 dense, 2 at 0.9, 3-4 at 0.99 (int(s * 2 / 3))
    grads = local_grads(params, steps=5)
    tx = opt.dgc(0.1, 0.9, use_nesterov=nesterov, weight_decay=wd, clip_norm=clip_norm,
                 sparsity=sparsity, **config)  # fmt: skip
    got = train(tx, params, grads)
    expected = paddle_dgc(params, grads, 0.1, 0.9, nesterov, wd, clip_norm, 2, 3, sparsity)
    for (p, state), (p_ref, u_ref) in zip(got, expected, strict=True):
        for r in (0, 5):  # every replica holds the same parameters, and its own u
            for name in params:
                np.testing.assert_allclose(replica(p, r)[name], p_ref[name], rtol=1e-5, atol=1e-6)
                u = replica(state[0].u, r)[name]
                np.testing.assert_allclose(u, u_ref[name][r], rtol=1e-5, atol=1e-6)


def test_before_rampup_it_is_dense_momentum():
    """Until rampup_begin_step: Momentum on the mean gradient, and no clip of eligible ones."""
    params = make_params()
    grads = local_grads(params, steps=3)
    tx = opt.dgc(0.1, 0.9, clip_norm=1.0, rampup_begin_step=3)
    p, _ = train(tx, params, grads)[-1]
    dense = opt.momentum(0.1, 0.9)
    want = dict(params)
    clipped = opt.momentum(0.1, 0.9, clip_norm=1.0)
    for name, reference in (("big", dense), ("small", clipped)):
        state = reference.init(params[name])
        for g in grads:
            updates, state = reference.update(g[name].mean(0), state, want[name])
            want[name] = optax.apply_updates(want[name], updates)
        np.testing.assert_allclose(replica(p, 3)[name], want[name], rtol=1e-5, atol=1e-6)


def test_sent_coordinates_are_masked_and_k_follows_the_schedule():
    params = {"big": make_params()["big"]}
    grads = local_grads(params, steps=6)
    tx = opt.dgc(0.1, 0.9, rampup_begin_step=1, rampup_step=4, sparsity=[0.75, 0.99])
    ks = []
    for step, (_, state) in enumerate(train(tx, params, grads)):
        u, v = np.asarray(state[0].u["big"]), np.asarray(state[0].v["big"])
        sent = v == 0
        if step < 1:
            assert sent.all() and not (u == 0).any()  # dense: nothing accumulated in v
            continue
        np.testing.assert_array_equal(u == 0, sent)  # momentum factor masking
        counts = sent.reshape(REPLICAS, -1).sum(1)
        assert len(set(counts)) == 1  # the same k on every replica
        ks.append(int(counts[0]))
        expected_s = opt.sparsity_at(step, 1, 4, [0.75, 0.99])
        assert ks[-1] == opt.top_k_count(16384, expected_s)
    assert ks == [4096, 4096, 163, 163, 163]


def test_paddle_dgc_op_case():
    """Section 6 case 22 (test_dgc_op.py): 102400 elements, two ranks, step 0: k = 25600, and
    u and v are 0 at every sent index."""
    params = {"p": np.random.RandomState(0).randn(102400).astype(np.float32)}
    mesh = build_mesh(dp=2, devices=jax.devices()[:2])
    tx = opt.dgc_reducer(0.9, use_nesterov=True, weight_decay=1e-4, rampup_step=10,
                         sparsity=PADDLE_SPARSITY, axis_names=AXES)  # fmt: skip
    state = per_replica(tx.init, mesh)(stacked(params, 2))
    grads = {"p": np.random.RandomState(1).randn(2, 102400).astype(np.float32)}
    _, state = per_replica(tx.update, mesh)(grads, state, stacked(params, 2))
    u, v = np.asarray(state.u["p"]), np.asarray(state.v["p"])
    np.testing.assert_array_equal((u == 0).sum(1), [25600, 25600])
    np.testing.assert_array_equal(u == 0, v == 0)


def test_sparse_allreduce_sums_the_sparsified_vectors():
    rng = np.random.RandomState(0)
    values = rng.randn(REPLICAS, 20000).astype(np.float32)
    total, sent = per_replica(lambda x: opt.sparse_allreduce(x, 37, AXES))(values)
    expected = np.zeros(20000, np.float32)
    for r in range(REPLICAS):
        top = np.argsort(-np.abs(values[r]))[:37]
        assert set(np.asarray(sent[r])) == set(top)
        expected[top] += values[r, top]
    for r in range(REPLICAS):
        np.testing.assert_allclose(total[r], expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"needs a flat float32 array, got float16\[20000\]"):
        opt.sparse_allreduce(values[0].astype(np.float16), 37, AXES)


def test_compiled_exchange_is_sparse():
    """At 99.9% sparsity on 8 devices: all-gathers only for the eligible gradient, at most
    1/100 of the bytes of its dense all-reduce; ineligible ones (small, float16) go dense."""
    params = {
        "big": np.ones((256, 256), np.float32),
        "small": np.ones(100, np.float32),
        "half": np.ones((128, 128), np.float16),
    }
    tx = opt.dgc_reducer(0.9, sparsity=[0.999], axis_names=AXES)
    state = per_replica(tx.init)(stacked(params))
    reduce = per_replica(tx.update)
    grads = stacked(params)
    found = collectives(reduce.lower(grads, state, stacked(params)).compile().as_text())
    reduced = {c.shape.split("{")[0] for c in found if c.op == "all-reduce"}
    assert reduced == {"f32[100]", "f16[128,128]"}, found
    gathers = [c for c in found if c.op == "all-gather"]
    k = opt.top_k_count(256 * 256, 0.999)
    assert [g.shape.split("{")[0] for g in gathers] == [f"f32[8,{2 * k}]"]

    dense = per_replica(lambda g: lax.pmean(g, AXES))
    (dense_op,) = collectives(dense.lower(grads["big"]).compile().as_text())
    sparse_bytes = sum(bus_bytes(g.op, g.shape, g.group_size) for g in gathers)
    dense_bytes = bus_bytes(dense_op.op, dense_op.shape, dense_op.group_size)
    assert dense_op.op == "all-reduce"
    assert sparse_bytes <= dense_bytes / 100, (sparse_bytes, dense_bytes)


def test_bad_configs():
    params = {"big": np.ones((128, 128), np.float32)}
    message = (
        r"sparsity 0.99999 leaves nothing to send of the 16384 elements of parameter 'big': "
        r"int\(16384 \* \(1 - 0.99999\)\) = 0; use a lower sparsity"
    )
    with pytest.raises(ValueError, match=message):
        opt.dgc(sparsity=[0.9, 0.99999]).init(params)
    with pytest.raises(
        ValueError, match=r"sparsity must be a non-empty list of floats in \(0, 1\)"
    ):
        opt.dgc(sparsity=[0.9, 1.0])
    with pytest.raises(ValueError, match="rampup_step must be an int >= 1, got 0"):
        opt.dgc(rampup_step=0)
    with pytest.raises(ValueError, match="DGC needs the parameters"):
        opt.dgc_reducer(0.9).update(params, None)
    assert float(opt.get_lr(opt.dgc(0.3).init(params))) == pytest.approx(0.3)
