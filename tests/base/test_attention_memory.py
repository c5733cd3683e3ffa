"""Attention over a whole sequence as Megatron's fused softmax keeps it for the backward pass:
the values and gradients of `jax.nn.dot_product_attention`, keeping its inputs and its
probabilities in 16 bits alone (Korthikanti et al. 2022's 2 a s^2 b), under AMP at the
precision the policy gives matmuls."""

import chex
import jax
import jax.numpy as jnp
import pytest

from fleetjax.layers import attention
from fleetjax.layers.precision import traced_dtype
from fleetjax.transforms import amp

BATCH, LENGTH, HEADS, HEAD_DIM, WIDTH = 2, 16, 4, 8, 32


def normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape).astype(dtype)


def residuals(fn, *args):
    """The arrays `jax.vjp(fn, *args)` keeps for the backward pass."""
    return jax.tree.leaves(jax.vjp(fn, *args)[1])


# 1536 queries go in three tiles of 512 (forward and backward a tile at a time).
@pytest.mark.parametrize("length", [LENGTH, 1536])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_equals_jax_dot_product_attention(causal, length):
    q, k, v, grad = (normal(i, (BATCH, length, HEADS, HEAD_DIM)) for i in range(4))
    ours, ours_vjp = jax.vjp(lambda *x: attention(*x, is_causal=causal), q, k, v)
    plain = lambda *x: jax.nn.dot_product_attention(*x, is_causal=causal, implementation="xla")  # noqa: E731
    expected, expected_vjp = jax.vjp(plain, q, k, v)
    chex.assert_trees_all_close(ours, expected, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(ours_vjp(grad), expected_vjp(grad), rtol=1e-5, atol=1e-6)


def test_attention_keeps_its_inputs_and_16_bit_probabilities_alone():
    """bf16 q, k, v: the backward pass keeps them and the [batch, heads, length, length]
    probabilities in bf16 (2 bytes a score), where the autodiff of XLA's attention keeps
    float32 scores too."""
    q, k, v = (normal(i, (BATCH, LENGTH, HEADS, HEAD_DIM), jnp.bfloat16) for i in range(3))
    kept = residuals(lambda *x: attention(*x, is_causal=True), q, k, v)
    squares = [r for r in kept if r.shape[-2:] == (LENGTH, LENGTH)]  # tiles of queries x keys
    assert [(r.size, r.dtype) for r in squares] == [(BATCH * HEADS * LENGTH**2, jnp.bfloat16)]
    assert sum(r.nbytes for r in kept) == 3 * q.nbytes + squares[0].nbytes
    plain = lambda *x: jax.nn.dot_product_attention(*x, is_causal=True, implementation="xla")  # noqa: E731
    plain_squares = [r for r in residuals(plain, q, k, v) if r.shape[-2:] == (LENGTH, LENGTH)]
    assert jnp.dtype("float32") in {r.dtype for r in plain_squares}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_under_amp_attention_runs_in_half_precision(level):
    """The policy runs a custom-gradient function as traced: attention casts its inputs as the
    policy casts matmuls, so under O1 and O2 alike it runs, and keeps its probabilities, in
    bf16 (it would run in float32 as the model was traced)."""
    policy = amp.policy("bfloat16", level)

    def heads(x):
        q = jnp.tanh(x).reshape(BATCH, LENGTH, HEADS, HEAD_DIM)
        return attention(q, q, q, is_causal=True)

    x = normal(0, (BATCH, LENGTH, WIDTH))
    assert amp.autocast(heads, policy)(x).dtype == jnp.bfloat16
    traced = jax.make_jaxpr(amp.autocast(heads, policy))(x)
    calls = [e for e in traced.eqns if e.primitive.name == "custom_vjp_call"]
    assert [v.aval.dtype for c in calls for v in c.invars] == [jnp.bfloat16] * 3
    kept = residuals(amp.autocast(heads, policy), x)
    squares = [r for r in kept if r.shape[-2:] == (LENGTH, LENGTH)]
    assert [r.dtype for r in squares] == [jnp.bfloat16]


def test_traced_dtype_follows_the_policy_only_while_autocast_traces():
    assert traced_dtype("dot_general") is None
    seen = {}

    def probe(x):
        seen["dot"], seen["add"], seen["exp"] = map(traced_dtype, ("dot_general", "add", "exp"))
        with amp.fp16_guard():
            seen["guarded"] = traced_dtype("dot_general")
            return x * 2  # use_guard needs an operation inside a guard

    x = jnp.ones(2)
    for policy, expected in (
        (amp.policy("bfloat16", "O1"), (jnp.bfloat16, None, None, jnp.bfloat16)),
        (amp.policy("bfloat16", "O2"), (jnp.bfloat16, jnp.bfloat16, None, jnp.bfloat16)),
        (amp.policy("float16", "O2", use_guard=True), (None, None, None, jnp.float16)),
    ):
        amp.autocast(probe, policy)(x)
        assert tuple(seen[k] for k in ("dot", "add", "exp", "guarded")) == expected, policy
    assert traced_dtype("dot_general") is None


def test_an_unknown_implementation_is_named():
    q = normal(0, (BATCH, LENGTH, HEADS, HEAD_DIM))
    message = r"implementation must be one of \(None, 'xla', 'cudnn'\), got 'flash'"
    with pytest.raises(ValueError, match=message):
        attention(q, q, q, implementation="flash")


def test_mixed_dtypes_are_refused_outside_amp_and_cast_alike_under_it():
    # A bfloat16 q and float32 k, v: the dtype of the output depended on the mesh's split.
    q = normal(0, (BATCH, LENGTH, HEADS, HEAD_DIM)).astype(jnp.bfloat16)
    kv = normal(1, (BATCH, LENGTH, HEADS, HEAD_DIM))
    message = r"^attention takes q, k and v of one dtype, got bfloat16, float32, float32: cast"
    with pytest.raises(TypeError, match=message):
        attention(q, kv, kv)
    # Under AMP the policy casts all three to its half dtype, whatever they were.
    out = amp.autocast(attention, amp.policy("bfloat16", "O1"))(q, kv, kv)
    assert out.dtype == jnp.bfloat16
