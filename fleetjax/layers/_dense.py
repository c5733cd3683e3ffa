"""Attention over a whole sequence that keeps only its probabilities for the backward pass, in
the inputs' dtype: 2 bytes a score under bf16, where the autodiff of
`jax.nn.dot_product_attention`'s XLA path keeps its float32 scores and their exponentials too
(about 10 bytes a score). Megatron-LM's fused softmax keeps the same (Korthikanti et al. 2022
count it as the softmax output, 2 a s^2 b).

The forward pass is XLA's attention as JAX writes it (float32 scores and softmax, the
probabilities cast to the values' dtype before they weigh the values); the backward pass
differentiates softmax from its output, p (dp - sum(p dp)), in float32, and runs its matmuls
in the inputs' dtype with float32 accumulation. Both go a tile of queries at a time
(`_tiles`), so that besides the kept probabilities only a tile's float32 scores exist at once.
Written here because JAX's attention has no such backward on XLA's path (cuDNN's fused kernel
keeps no scores at all, on NVIDIA GPUs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from fleetjax.layers import _tiles

_F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, is_causal: bool) -> jax.Array:
    """softmax(q k^T / sqrt(head_dim)) v for `q`, `k`, `v` [batch, length, heads, head_dim]
    (causal with `is_causal`), keeping q, k, v and the probabilities for the backward pass."""
    return _forward(q, k, v, is_causal)[0]


def _forward(
    q: jax.Array, k: jax.Array, v: jax.Array, is_causal: bool
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    length = q.shape[1]
    tiles = _tiles.count(length)
    size = length // tiles

    def tile(one: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        index, q_tile = one
        causal = None
        if is_causal:  # every row keeps its diagonal: no row is all -inf
            rows = index * size + jnp.arange(size)
            causal = rows[:, None] >= jnp.arange(length)[None, :]
        scores = _tiles.scores(q_tile, k, causal)
        probabilities = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", probabilities, v), probabilities

    # [tiles, batch, heads, tile, keys]: the probabilities stay tiled for the backward pass.
    out, probabilities = lax.map(tile, (jnp.arange(tiles), _tiles.tiled(q, tiles, 1)))
    return _tiles.untiled(out, 1), (q, k, v, probabilities)


def _backward(
    is_causal: bool, kept: tuple[jax.Array, ...], grad: jax.Array
) -> tuple[jax.Array, ...]:
    del is_causal  # the masked probabilities are 0, and so are their scores' gradients
    q, k, v, probabilities = kept
    tiles = probabilities.shape[0]
    scale = 1 / math.sqrt(q.shape[-1])

    def tile(sums: tuple, one: tuple) -> tuple[tuple, jax.Array]:
        dk, dv = sums
        q_tile, grad_tile, p = one
        dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, grad_tile, preferred_element_type=_F32)
        dp = jnp.einsum("bqhd,bkhd->bhqk", grad_tile, v, preferred_element_type=_F32)
        p = p.astype(_F32)
        # In the inputs' dtype for the two matmuls (accumulated in float32), as flash
        # attention's backward keeps it: under bf16 they run on bf16 tensor cores.
        scores_grad = (p * (dp - jnp.sum(p * dp, axis=-1, keepdims=True)) * scale).astype(q.dtype)
        dq = jnp.einsum("bhqk,bkhd->bqhd", scores_grad, k, preferred_element_type=_F32)
        dk = dk + jnp.einsum("bhqk,bqhd->bkhd", scores_grad, q_tile, preferred_element_type=_F32)
        return (dk, dv), dq.astype(q.dtype)

    zeros = (jnp.zeros_like(k, _F32), jnp.zeros_like(v, _F32))  # k's and v's shardings too
    per_query = (_tiles.tiled(q, tiles, 1), _tiles.tiled(grad, tiles, 1), probabilities)
    (dk, dv), dq = lax.scan(tile, zeros, per_query)
    return _tiles.untiled(dq, 1), dk.astype(k.dtype), dv.astype(v.dtype)


dense_attention.defvjp(_forward, _backward)
