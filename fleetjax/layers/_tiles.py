"""Queries in tiles, as flash attention takes them, and their scores: an attention's scores a
tile of queries at a time, `[batch, heads, QUERY_TILE, keys]`, not `[batch, heads, queries,
keys]` (which for 8 rows of 4k tokens and 24 heads would be 12 GiB in float32, and more in the
backward pass)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

QUERY_TILE = 512


def count(n: int) -> int:
    """How many query tiles `n` queries make: of `QUERY_TILE` each where they divide."""
    return n // QUERY_TILE if n > QUERY_TILE and n % QUERY_TILE == 0 else 1


def tiled(x: jax.Array, tiles: int, axis: int) -> jax.Array:
    """`x` with `axis` cut into `tiles` tiles, stacked on a new leading axis."""
    shape = (*x.shape[:axis], tiles, x.shape[axis] // tiles, *x.shape[axis + 1 :])
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def untiled(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of `tiled`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])


def scores(q: jax.Array, k: jax.Array, mask: jax.Array | None) -> jax.Array:
    """[batch, heads, queries, keys] float32 scores q k^T / sqrt(head_dim) of `q` and `k`
    ([batch, length, heads, head_dim]), -inf where `mask` is False."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    s = s / math.sqrt(q.shape[-1])
    return s if mask is None else jnp.where(mask, s, -jnp.inf)
