"""Ring attention over the mesh axis ``cp`` (Paddle's `cp_degree`): causal and load-balanced.

Each ``cp`` device holds a block of the sequence's queries, keys and values. The key and value
blocks go round the ring (`lax.ppermute`), one hop per step; each device attends its queries to
the block it holds and merges the result into its running output with the log-sum-exp of the
scores, as flash attention merges its tiles. After ``cp`` steps every query has seen every key.
The backward pass goes round again, recomputing each block's scores from the kept log-sum-exp
and sending the keys' and values' gradients round with them, so that nothing of size
``length x length`` is ever kept: per device, attention keeps its blocks and their
log-sum-exps, 1/cp of the sequence (`jax.custom_vjp`).

Load balance: with causal attention a device holding the sequence's start would have almost
nothing to do while the device holding its end attends to everything. The sequence is cut into
``2 cp`` chunks and device ``j`` holds chunks ``j`` and ``2 cp - 1 - j`` (`load_balanced`), so
that at each step every device computes the same amount: its whole block against the first half
of an earlier device's keys, or the second half of its queries against a later device's keys
(the diagonal step, its own block, is masked).

The ring's ``cp`` steps are unrolled rather than a loop: inside the gradient of a loop over
layers, XLA:GPU's scheduler orders a looped collective-permute into a cycle ("A cycle is
detected while visiting instruction %collective-permute-start").
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from fleetjax.layers import _tiles
from fleetjax.layers.partitioning import free_axes

AXIS = "cp"
_DIAGONAL, _EARLIER, _LATER, _FULL = range(4)  # what a step computes (see `_kind`)
_F32 = jnp.float32


def ring_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, causal: bool, spec: PartitionSpec
) -> jax.Array:
    """Attention of `q`, `k`, `v` ([batch, length, heads, head_dim], the length split over
    ``cp`` in the load-balanced order) by a ring over ``cp``, under the context mesh.

    The ring runs in a `shard_map` over every axis of the context mesh that is not manual
    already, the arrays split as `spec` says (the length over ``cp``): a step's work depends
    on the device (a `lax.switch`), and a collective the compiler put inside one of its
    branches would wait for devices that took another."""
    mesh = jax.sharding.get_abstract_mesh()
    run = jax.shard_map(
        functools.partial(_attention, causal=causal),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
        axis_names=set(free_axes(mesh)),
        check_vma=False,
    )
    return run(q, k, v)


def load_balanced(x: jax.Array, axis: int, ways: int) -> jax.Array:
    """`x` with its dimension `axis` cut into ``2 ways`` chunks and reordered so that block
    ``j`` of ``ways`` equal blocks holds chunks ``j`` and ``2 ways - 1 - j``."""
    chunks = x.reshape(*x.shape[:axis], 2, ways, -1, *x.shape[axis + 1 :])
    first, second = jnp.take(chunks, 0, axis), jnp.flip(jnp.take(chunks, 1, axis), axis)
    return jnp.stack([first, second], axis + 1).reshape(x.shape)


def natural(x: jax.Array, axis: int, ways: int) -> jax.Array:
    """The inverse of `load_balanced`: `x`'s dimension `axis` back in its natural order."""
    pairs = x.reshape(*x.shape[:axis], ways, 2, -1, *x.shape[axis + 1 :])
    first, second = jnp.take(pairs, 0, axis + 1), jnp.take(pairs, 1, axis + 1)
    return jnp.concatenate([first, jnp.flip(second, axis)], axis).reshape(x.shape)


def _kind(step: jax.Array, causal: bool) -> jax.Array:
    """What the step computes on this device: its own block (masked), an earlier device's
    (whole block against the first half of the keys) or a later one's (second half of the
    queries against all keys); without causality, everything."""
    if not causal:
        return jnp.int32(_FULL)
    ways, me = lax.axis_size(AXIS), lax.axis_index(AXIS)
    source = (me - step) % ways
    return jnp.where(step == 0, _DIAGONAL, jnp.where(source < me, _EARLIER, _LATER))


def _positions(n: int) -> jax.Array:
    """Global positions of this device's load-balanced block of `n` tokens."""
    ways, me, half = lax.axis_size(AXIS), lax.axis_index(AXIS), n // 2
    return jnp.concatenate(
        [me * half + jnp.arange(half), (2 * ways - 1 - me) * half + jnp.arange(half)]
    )


def _block(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> tuple:
    """A block's softmax-normalised output [b, q, h, d] and log-sum-exp [b, q, h], a tile of
    queries at a time."""

    def tile(one: tuple) -> tuple:
        q, mask = one
        s = _tiles.scores(q, k, mask)
        lse = jax.nn.logsumexp(s, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v.astype(_F32))
        return out, lse.transpose(0, 2, 1)

    tiles = _tiles.count(q.shape[1])
    if tiles == 1:
        return tile((q, mask))
    masks = None if mask is None else _tiles.tiled(mask, tiles, 0)
    out, lse = lax.map(tile, (_tiles.tiled(q, tiles, 1), masks))
    return _tiles.untiled(out, 1), _tiles.untiled(lse, 1)


def _pieces(kind: int, q: jax.Array, k: jax.Array, mask: jax.Array) -> tuple:
    """The rows of `q`, the columns of `k` and the mask a step of `kind` computes."""
    half = q.shape[1] // 2
    rows = slice(half, None) if kind == _LATER else slice(None)
    cols = slice(None, half) if kind == _EARLIER else slice(None)
    return rows, cols, mask if kind == _DIAGONAL else None


def _forward_step(kind: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple:
    """A step's output and log-sum-exp for all of this device's queries (-inf where none)."""
    mask = _positions(q.shape[1])
    mask = mask[None, :] <= mask[:, None]

    def branch(kind: int) -> tuple:
        rows, cols, m = _pieces(kind, q, k, mask)
        out, lse = _block(q[:, rows], k[:, cols], v[:, cols], m)
        pad = q.shape[1] - out.shape[1]
        out = jnp.pad(out, ((0, 0), (pad, 0), (0, 0), (0, 0)))
        return out, jnp.pad(lse, ((0, 0), (pad, 0), (0, 0)), constant_values=-jnp.inf)

    return lax.switch(kind, [functools.partial(branch, i) for i in range(4)])


def _merged(out: jax.Array, lse: jax.Array, block: jax.Array, block_lse: jax.Array) -> tuple:
    """Two partial attentions of the same queries merged by their log-sum-exps."""
    total = jnp.logaddexp(lse, block_lse)
    return out * jnp.exp(lse - total)[..., None] + block * jnp.exp(block_lse - total)[
        ..., None
    ], total


def _rotate(tree: tuple) -> tuple:
    """`tree` sent on to the next ``cp`` device (a `lax.ppermute`).

    XLA:CPU's collective-permute waits for every device of the program, so inside a branch that
    only some devices take (a pipeline stage's forward) it would never complete; on CPU the
    ring rotates by an all-to-all instead, which waits for its group alone (the same values, at
    ``cp`` times the traffic: CPU devices are a simulation)."""
    ways = lax.axis_size(AXIS)

    def permuted(tree: tuple) -> tuple:
        return lax.ppermute(tree, AXIS, [(i, (i + 1) % ways) for i in range(ways)])

    def exchanged(tree: tuple) -> tuple:
        me = lax.axis_index(AXIS)

        def one(x: jax.Array) -> jax.Array:
            slots = jnp.zeros((ways, *x.shape), x.dtype).at[(me + 1) % ways].set(x)
            return lax.all_to_all(slots, AXIS, 0, 0)[(me - 1) % ways]

        return jax.tree.map(one, tree)

    return lax.platform_dependent(tree, cpu=exchanged, default=permuted)


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> tuple:
    """The output (float32) and log-sum-exp of this device's queries, after a ring of steps."""
    out, lse = _forward_step(_kind(jnp.int32(0), causal), q, k, v)

    kv = k, v
    for index in range(1, lax.axis_size(AXIS)):
        kv = _rotate(kv)
        out, lse = _merged(out, lse, *_forward_step(_kind(jnp.int32(index), causal), q, *kv))
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    return _forward(q, k, v, causal)[0].astype(q.dtype)


def _attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> tuple:
    out, lse = _forward(q, k, v, causal)
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _backward_step(kind: jax.Array, q: jax.Array, kv: tuple, do: jax.Array, stats: tuple) -> tuple:
    """A step's gradients for this device's queries and for the keys and values it holds."""
    k, v = kv
    lse, delta = stats
    mask = _positions(q.shape[1])
    mask = mask[None, :] <= mask[:, None]

    def branch(kind: int) -> tuple:
        rows, cols, m = _pieces(kind, q, k, mask)
        kb, vb = k[:, cols], v[:, cols]
        per_query = (q[:, rows], do[:, rows], lse[:, rows], delta[:, rows])
        dq, dk, dv = _block_grads(per_query, kb, vb, m)
        width = (0, 0), (0, 0), (0, 0)
        dq = jnp.pad(dq, ((0, 0), (q.shape[1] - dq.shape[1], 0), *width[1:]))
        dk, dv = (jnp.pad(g, ((0, 0), (0, k.shape[1] - g.shape[1]), *width[1:])) for g in (dk, dv))
        return dq, dk, dv

    return lax.switch(kind, [functools.partial(branch, i) for i in range(4)])


def _block_grads(per_query: tuple, k: jax.Array, v: jax.Array, mask: jax.Array | None) -> tuple:
    """A block's gradients for its queries and for its keys and values, from the queries,
    their output's cotangent, log-sum-exp and delta (`per_query`), a tile of queries at a time
    (the keys' and values' gradients summed over the tiles)."""

    def tile(sums: tuple, one: tuple) -> tuple:
        (q, do, lse, delta), mask = one
        p = jnp.exp(_tiles.scores(q, k, mask) - lse.transpose(0, 2, 1)[..., None])
        dv = jnp.einsum("bhqk,bqhd->bkhd", p, do.astype(_F32))
        dp = jnp.einsum("bqhd,bkhd->bhqk", do, v, preferred_element_type=_F32)
        ds = p * (dp - delta.transpose(0, 2, 1)[..., None]) / math.sqrt(q.shape[-1])
        dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(_F32))
        dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(_F32))
        return (sums[0] + dk, sums[1] + dv), dq

    zeros = (jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    tiles = _tiles.count(per_query[0].shape[1])
    if tiles == 1:
        (dk, dv), dq = tile(zeros, (per_query, mask))
        return dq, dk, dv
    tiled = [_tiles.tiled(x, tiles, 1) for x in per_query]
    masks = None if mask is None else _tiles.tiled(mask, tiles, 0)
    (dk, dv), dq = lax.scan(tile, zeros, (tiled, masks))
    return _tiles.untiled(dq, 1), dk, dv


def _attention_backward(causal: bool, residuals: tuple, do: jax.Array) -> tuple:
    q, k, v, out, lse = residuals
    stats = (lse, jnp.sum(out.astype(_F32) * do.astype(_F32), axis=-1))
    zeros = jnp.zeros(k.shape, _F32)

    dq, kv, dkv = jnp.zeros(q.shape, _F32), (k, v), (zeros, zeros)
    for index in range(lax.axis_size(AXIS)):
        dq_step, dk, dv = _backward_step(_kind(jnp.int32(index), causal), q, kv, do, stats)
        dkv = (dkv[0] + dk, dkv[1] + dv)
        kv, dkv = _rotate((kv, dkv))
        dq = dq + dq_step
    dk, dv = dkv
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_attention.defvjp(_attention_forward, _attention_backward)
