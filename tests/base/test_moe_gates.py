"""MoE gates at their formulas: Paddle's NaiveGate, GShardGate and SwitchGate against Paddle
3.3.1 run on CPU (tests/data/write_moe_with_paddle.py) and the examples of Paddle's capacity
ops; TopKRouter's forms (softmax, sigmoid, group-limited, aux-loss-free bias, jitter) and the
auxiliary losses against numpy."""

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fleetjax.layers import GShardGate, NaiveGate, SwitchGate, TopKRouter
from fleetjax.layers.moe import (
    load_balancing_loss,
    max_violation,
    sequence_load_balancing_loss,
    z_loss,
)
from fleetjax.layers.moe.routing import drop_beyond_capacity

PADDLE = np.load(pathlib.Path(__file__).parents[1] / "data" / "paddle3.3.1_moe_gates.npz")


@nnx.jit(static_argnames="sequences")
def route(gate, x, key=None, sequences=1):
    """`gate.route`, compiled once per test (gate state updates kept, as eagerly)."""
    return gate.route(x, sequences=sequences, rngs=key)


def paddle_gate(cls, mode, **options):
    gate = cls(8, 8, 1, rngs=nnx.Rngs(0), **options)
    gate.weight[...] = PADDLE["weight"]
    gate.bias[...] = PADDLE["bias"]
    gate.deterministic = mode == "eval"
    return gate


@pytest.mark.parametrize(
    ("name", "cls", "mode", "options"),
    [
        ("naive", NaiveGate, "train", {}),
        ("gshard", GShardGate, "train", {"random_routing": False}),
        ("gshard", GShardGate, "eval", {"random_routing": False}),
        ("switch", SwitchGate, "eval", {}),
    ],
)
def test_paddle_gates_equal_paddle(name, cls, mode, options):
    gate = paddle_gate(cls, mode, **options)
    experts, weights, _ = route(gate, jnp.asarray(PADDLE["x"]))
    np.testing.assert_array_equal(experts, PADDLE[f"{name}_{mode}_experts"])
    np.testing.assert_allclose(weights, PADDLE[f"{name}_{mode}_values"], rtol=1e-6)
    loss = gate.get_loss()
    expected = PADDLE.get(f"{name}_{mode}_loss", np.float32(0))
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    assert float(gate.get_loss()) == 0.0  # Paddle's get_loss(clear=True) cleared it


def test_capacity_follows_paddles_examples():
    # _prune_gate_by_capacity's example: expert 3's fourth assignment is over its 3.
    ids = jnp.array([1, 3, 3, 3, 3, 2, 1, 1])[:, None]
    np.testing.assert_array_equal(drop_beyond_capacity(ids, 8, 3)[:, 0], [1, 3, 3, 3, -1, 2, 1, 1])
    # _limit_by_capacity's: worker 0 sends counts [1, 2, 2], worker 1 [8, 3, 6] to experts
    # of capacity 5; worker 0's tokens come first, so worker 1 keeps [4, 3, 3].
    counts = [[1, 2, 2], [8, 3, 6]]
    ids = np.concatenate([np.repeat(np.arange(3), c) for c in counts])[:, None]
    kept = np.asarray(drop_beyond_capacity(jnp.asarray(ids), 3, 5))[:, 0]
    worker = np.repeat([0, 1], [sum(c) for c in counts])
    found = [[int(np.sum((kept == e) & (worker == w))) for e in range(3)] for w in range(2)]
    assert found == [[1, 2, 2], [4, 3, 3]]


def test_gshard_capacity_is_per_expert_over_the_ranks_tokens_in_order():
    gate = GShardGate(8, 4, 2, random_routing=False, rngs=nnx.Rngs(0))  # 8 experts, 2 ranks
    gate.bias[...] = jnp.array([9.0, 5.0] + [0.0] * 6)  # every token: experts 0 and 1
    experts = route(gate, jax.random.normal(jax.random.key(0), (16, 8)) / 100).experts
    capacity = math.ceil(1.2 * 16 / 2)  # Paddle's ceil(1.2 x T) of each rank's 8 tokens
    expected = np.where(np.arange(16)[:, None] < capacity, [[0, 1]], -1)
    np.testing.assert_array_equal(experts, expected)
    gate.deterministic = True  # eval: 2.4 x 8 = 20 > 16, nothing dropped
    assert int(jnp.sum(route(gate, jnp.ones((16, 8))).experts < 0)) == 0


def test_gshard_random_routing_drops_the_second_expert_where_twice_its_score_is_below_u():
    gate = GShardGate(8, 8, 1, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (64, 8))
    key = jax.random.key(7)
    experts, weights, _ = route(gate, x, key)
    u = jax.random.uniform(key, (64,))
    plain = paddle_gate_like(gate, x)
    np.testing.assert_array_equal(experts[:, 0], plain[:, 0])
    np.testing.assert_array_equal(experts[:, 1], np.where(2 * weights[:, 1] < u, -1, plain[:, 1]))
    assert 0 < int(jnp.sum(experts[:, 1] < 0)) < 64
    with pytest.raises(ValueError, match="GShardGate needs a PRNG key"):
        route(GShardGate(8, 8, 1, rngs=nnx.Rngs(params=0)), x)


def paddle_gate_like(gate, x):
    return np.asarray(jax.lax.top_k(gate.scores(x), 2)[1])


def test_switch_jitter_adds_uniform_noise_in_training():
    gate = SwitchGate(8, 8, 1, switch_eps=0.5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (32, 8))
    key = jax.random.key(3)
    experts, weights, _ = route(gate, x, key)
    noise = jax.random.uniform(key, (32, 8)) * 2 * 0.5 + 1 - 0.5
    probs = jax.nn.softmax(gate.scores(x) + noise)
    np.testing.assert_array_equal(experts[:, 0], jnp.argmax(probs, -1))
    np.testing.assert_allclose(weights[:, 0], jnp.max(probs, -1), rtol=1e-6)


# -- TopKRouter -------------------------------------------------------------------------------

X = jax.random.normal(jax.random.key(2), (12, 8))


def router(**options):
    return TopKRouter(8, 8, options.pop("top_k", 2), rngs=nnx.Rngs(0), **options)


def np_topk(scores, k):
    experts = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    return experts, np.take_along_axis(scores, experts, -1)


def np_softmax(z):
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"pre_softmax": True, "normalize_top_k": True},
        {"score_function": "sigmoid", "normalize_top_k": True, "scaling_factor": 2.5},
    ],
    ids=["softmax", "pre_softmax", "sigmoid"],
)
def test_router_forms(options):
    gate = router(**options)
    routing = route(gate, X)
    logits = np.asarray(X @ gate.weight[...])
    if options.get("score_function") == "sigmoid":
        experts, weights = np_topk(1 / (1 + np.exp(-logits)), 2)
        weights = 2.5 * weights / weights.sum(-1, keepdims=True)
    elif options.get("pre_softmax"):
        experts, weights = np_topk(np_softmax(logits), 2)
        weights = weights / weights.sum(-1, keepdims=True)
    else:
        experts, weights = np_topk(logits, 2)
        weights = np_softmax(weights)
    np.testing.assert_array_equal(routing.experts, experts)
    np.testing.assert_allclose(routing.weights, weights, rtol=1e-5)


def test_group_limited_routing_picks_from_the_best_groups():
    gate = router(score_function="sigmoid", top_k=4, num_groups=4, group_top_k=2)
    routing = route(gate, X)
    scores = 1 / (1 + np.exp(-np.asarray(X @ gate.weight[...])))
    groups = scores.reshape(12, 4, 2)
    group_scores = np.sort(groups, -1)[..., -2:].sum(-1)  # top 4 / 2 = 2 of each group
    best = np.argsort(-group_scores, -1)[:, :2]
    for t in range(12):
        allowed = {2 * g + i for g in best[t] for i in range(2)}
        assert set(np.asarray(routing.experts[t]).tolist()) == allowed  # 4 of the 4 allowed


def test_losses_follow_their_formulas():
    gate = router(aux_loss_coeff=0.5, seq_aux_loss_coeff=0.25, z_loss_coeff=0.125)
    routing = route(gate, X, sequences=3)
    logits = np.asarray(X @ gate.weight[...], np.float64)
    probs = np_softmax(logits)
    experts = np.asarray(routing.experts)

    def balance(p, e):
        share = np.bincount(e.ravel(), minlength=8) / e.size
        return 8 * np.sum(share * p.mean(0))

    lse = np.log(np.exp(logits).sum(-1))
    halves = zip(np.split(probs, 3), np.split(experts, 3), strict=True)
    seq = np.mean([balance(p, e) for p, e in halves])
    expected = {"aux": 0.5 * balance(probs, experts), "seq_aux": 0.25 * seq,
                "z": 0.125 * np.mean(lse**2)}  # fmt: skip
    assert routing.losses.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(routing.losses[name], value, rtol=1e-5)
    np.testing.assert_allclose(float(gate.get_loss()), sum(expected.values()), rtol=1e-5)


def test_loss_functions_alone():
    probs = jnp.full((4, 4), 0.25)
    balanced = jnp.array([[0, 1], [2, 3], [1, 0], [3, 2]])
    assert float(load_balancing_loss(probs, jnp.full(4, 2.0), 2)) == pytest.approx(1.0)
    assert float(sequence_load_balancing_loss(probs, balanced, 2, 2)) == pytest.approx(1.0)
    assert float(z_loss(jnp.zeros((3, 4)))) == pytest.approx(math.log(4) ** 2)
    assert float(max_violation(jnp.array([1.0, 1, 1, 1]))) == 0.0
    assert float(max_violation(jnp.array([4.0, 0, 0, 0]))) == pytest.approx(3.0)


def test_aux_loss_free_bias_moves_by_rate_a_step_and_selects_only():
    gate = router(bias_update_rate=0.1)
    first = route(gate, X)  # no load seen yet: no update
    np.testing.assert_array_equal(gate.expert_bias[...], np.zeros(8))
    load = np.bincount(np.asarray(first.experts).ravel(), minlength=8) / first.experts.size
    np.testing.assert_allclose(gate.expert_load[...], load)
    second = route(gate, X)  # selects with the first step's update, and keeps it
    bias = 0.1 * np.sign(load.mean() - load)
    np.testing.assert_allclose(gate.expert_bias[...], bias, rtol=1e-6)
    logits = np.asarray(X @ gate.weight[...])
    experts, _ = np_topk(logits + bias, 2)
    np.testing.assert_array_equal(second.experts, experts)
    weights = np_softmax(np.take_along_axis(logits, experts, -1))  # unbiased
    np.testing.assert_allclose(second.weights, weights, rtol=1e-5)
    gate.deterministic = True  # evaluation selects with the pending update, keeps nothing
    kept = np.asarray(gate.expert_bias[...]).copy()
    route(gate, X)
    np.testing.assert_array_equal(gate.expert_bias[...], kept)


def test_router_input_jitter_multiplies_by_uniform_noise_in_training():
    gate = router(jitter=0.1)
    key = jax.random.key(5)
    routing = route(gate, X, key)
    noise = jax.random.uniform(key, X.shape, X.dtype, 0.9, 1.1)
    plain = route(router(), X * noise)  # same weights (same seed), no jitter
    np.testing.assert_array_equal(routing.experts, plain.experts)
    gate.deterministic = True
    np.testing.assert_array_equal(route(gate, X).experts, route(router(), X).experts)
