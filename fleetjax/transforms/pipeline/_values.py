"""Pytrees of values a pipeline stage keeps: zeros, buffer slots, sums over mesh axes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def merged(states: Any, micro_batches: int, data: tuple[str, ...]) -> Any:
    """The new model state from each replica's sums of its micro-batches' new floating states
    (and the last of the others): the mean of the floating ones over every replica's
    micro-batches, the last replica's of the others."""

    def one(x: jax.Array) -> jax.Array:
        if jnp.issubdtype(x.dtype, jnp.floating):
            total = psum(x, data) if data else x
            return (total / (micro_batches * (lax.psum(1, data) if data else 1))).astype(x.dtype)
        return lax.all_gather(x, data)[-1] if data else x

    return jax.tree.map(one, states)


def psum(tree: Any, axes: Any) -> Any:
    """`tree` summed over `axes` in its dtypes (booleans: any)."""

    def one(x: jax.Array) -> jax.Array:
        if x.dtype == jnp.bool_:
            return lax.psum(x.astype(jnp.int32), axes) > 0
        return lax.psum(x, axes)

    return jax.tree.map(one, tree)


def kept_states(total: Any, new: Any, last: jax.Array) -> Any:
    """`total` (a sum of new floating states, and the last of the others) with `new` added, or
    for the others, `new` if it is the last micro-batch's."""

    def one(t: jax.Array, n: jax.Array) -> jax.Array:
        return t + n if jnp.issubdtype(t.dtype, jnp.floating) else jnp.where(last, n, t)

    return jax.tree.map(one, total, new)


def added(total: Any, value: Any) -> Any:
    """`total` + `value`, in `total`'s dtypes (a gradient of a half-precision copy of a
    parameter added to the parameter's gradient)."""
    return jax.tree.map(lambda t, v: t + v.astype(t.dtype), total, value)


def zeros(shape: Any, *lead: int) -> Any:
    """Zeros of `shape` (a pytree of shapes), with leading dimensions `lead`."""
    return jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), shape)


def put(buffers: Any, slot: jax.Array, values: Any) -> Any:
    """`values` written into slot `slot` of `buffers`."""
    return jax.tree.map(lambda b, v: b.at[slot].set(v), buffers, values)


def put_where(buffers: Any, slot: jax.Array, write: jax.Array, values: Any) -> Any:
    """`values` written into slot `slot` of `buffers` if `write`, else `buffers` as they are."""
    kept = take(buffers, slot)
    chosen = jax.tree.map(lambda v, k: jnp.where(write, v, k), values, kept)
    return put(buffers, slot, chosen)


def take(tree: Any, index: jax.Array) -> Any:
    """Entry `index` of every leaf's leading axis."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, keepdims=False), tree)
