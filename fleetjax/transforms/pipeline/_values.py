"""Pytrees of values a pipeline stage keeps: zeros, buffer slots and their layouts, sums over
mesh axes, the model states and the gradients' reduction."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from fleetjax.mesh import constrain, spec_axes
from fleetjax.transforms.grad_allreduce import Reducer
from fleetjax.transforms.pipeline._layout import WHOLE, Layout, is_spec
from fleetjax.transforms.pipeline._model import PipelineParams


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


def chunk_states(
    total: PipelineParams, new: PipelineParams, chunk: jax.Array, last: tuple
) -> PipelineParams:
    """`total` with the new states of embed, chunk `chunk`'s layers and the head kept (see
    `kept_states`; `last` says, per part, whether its new state is the last micro-batch's)."""
    layers = kept_states(take(total.layers, chunk), new.layers, last[1])
    return PipelineParams(
        kept_states(total.embed, new.embed, last[0]),
        jax.tree.map(lambda t, x: t.at[chunk].set(x), total.layers, layers),
        kept_states(total.head, new.head, last[2]),
    )


def reduced(grads: PipelineParams, reducer: Reducer, layout: Layout) -> PipelineParams:
    """`grads` reduced over the data axes by `reducer`, on each device's own part of them (a
    `shard_map` over the compiler's axes too: XLA would gather a gradient split over mp
    before a reduce-scatter over sharding)."""
    compiler = layout.compiler
    axes = {a for s in jax.tree.leaves(compiler, is_leaf=is_spec) for a in spec_axes(s)}
    reduce = functools.partial(reducer, axes=layout.data)
    if not axes:
        return reduce(grads)
    return jax.shard_map(
        reduce,
        mesh=jax.sharding.get_abstract_mesh(),
        in_specs=(compiler,),
        out_specs=compiler,
        axis_names=axes,
        check_vma=False,
    )(grads)


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


def kept_specs(
    layout: Layout, activations: Any, shapes: list[jax.ShapeDtypeStruct]
) -> list[PartitionSpec | None]:
    """Where buffers of values kept across ticks ([slots, layers per chunk, ...], a value of
    each of `shapes` per layer) are: a value shaped like the `activations` (a layer's input,
    all a recomputed layer keeps) is split over the compiler's axes along its largest dimension
    that divides, as sequence parallelism keeps it, and gathered when it is used: a 1/mp of the
    memory of the micro-batches in flight for an all-gather per layer. The others (None) stay
    as XLA lays them out (one that its layer splits over mp stays split)."""
    split, ways = layout.split, layout.split_ways
    like = [(a.shape, a.dtype) for a in jax.tree.leaves(activations)]

    def spec(r: jax.ShapeDtypeStruct) -> PartitionSpec | None:
        dims = sorted(range(len(r.shape)), key=lambda d: -r.shape[d])
        fits = [d for d in dims if r.shape[d] % ways == 0]
        if not split or (r.shape, r.dtype) not in like or not fits:
            return None
        entries: list[Any] = [None] * (2 + len(r.shape))
        entries[2 + fits[0]] = split
        return PartitionSpec(*entries)

    return [spec(r) for r in shapes]


def laid_out(buffers: list[jax.Array], specs: list[PartitionSpec | None]) -> list[jax.Array]:
    """`buffers` laid out as `kept_specs` says."""
    return [b if s is None else constrain(b, s) for b, s in zip(buffers, specs, strict=True)]


def whole_where_split(
    values: list[jax.Array], specs: list[PartitionSpec | None]
) -> list[jax.Array]:
    """`values` (of a slot) with those kept split whole, as the layers make and use them: the
    split stays in the buffer instead of spreading to the layers."""
    return [v if s is None else constrain(v, WHOLE) for v, s in zip(values, specs, strict=True)]
