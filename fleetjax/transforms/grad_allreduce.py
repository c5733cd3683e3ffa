"""Data-parallel gradient reduction made explicit, so the strategy controls what is sent.

Under plain data parallelism XLA inserts the gradient all-reduce itself. Paddle's
`fp16_allreduce` changes what is communicated, and ZeRO-2 must leave each device with only its
shard of the reduced gradient (XLA:CPU would all-reduce and then slice), so the gradient is
computed per device inside `jax.shard_map` over the data axes and reduced by a reducer:
`reducer(local_grads, axes) -> grads`, run inside the shard_map, where each device holds the
gradient of its own batch rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from fleetjax.mesh import manual_axes
from fleetjax.transforms.grad_fn import GradFn, Outputs

Reducer = Callable[[Any, tuple[str, ...]], Any]


def mean_in(dtype: Any) -> Reducer:
    """Average float32 gradients over the data axes, communicating them in `dtype` (Paddle's
    `fp16_allreduce`: cast, all-reduce, cast back). Gradients of other dtypes are averaged as
    they are. Each gradient is divided by the replica count before the sum, as Paddle scales
    the loss gradient, so the half-precision sum does not overflow where the mean would not."""

    def reduce(grads: Any, axes: tuple[str, ...]) -> Any:
        replicas = jax.lax.psum(1, axes)

        def one(g: jax.Array) -> jax.Array:
            if not jnp.issubdtype(g.dtype, jnp.floating):
                raise TypeError(f"gradients must be floating point, got {g.dtype}")
            if g.dtype != jnp.float32:
                return jax.lax.pmean(g, axes)
            return jax.lax.psum((g / replicas).astype(dtype), axes).astype(jnp.float32)

        return jax.tree.map(one, grads)

    return reduce


def hierarchical_mean(replicas: int, ranks_per_node: int, dtype: Any = jnp.float32) -> Reducer:
    """Average gradients over the data axes in two levels (Paddle's
    `use_hierarchical_allreduce`, `hierarchical_allreduce_inter_nranks`): a ring reduce-scatter
    within each node, an all-reduce of each device's part across nodes (a ring among the devices
    with the same place in their node), and a ring all-gather within the node.

    The `replicas` devices along the data axes form nodes of `ranks_per_node` consecutive ones
    (node-major order, as `jax.devices()` lists a host's devices together), so only
    1 / `ranks_per_node` of each gradient crosses nodes. Every step is a `ppermute` between
    neighbours, which XLA compiles to collective-permutes (NCCL send/recv on GPU). Float32
    gradients travel in `dtype` (`fp16_allreduce`), divided by `replicas` first, as in `mean_in`.
    """
    if ranks_per_node < 1 or replicas % ranks_per_node:
        raise ValueError(
            f"hierarchical_allreduce_inter_nranks={ranks_per_node} must divide the "
            f"{replicas} data-parallel devices into whole nodes"
        )
    nodes = replicas // ranks_per_node

    def reduce(grads: Any, axes: tuple[str, ...]) -> Any:
        index = jax.lax.axis_index(axes)
        node, rank = index // ranks_per_node, index % ranks_per_node
        within = _Ring(
            axes,
            ranks_per_node,
            [(i, i - i % ranks_per_node + (i + 1) % ranks_per_node) for i in range(replicas)],
        )
        across = _Ring(axes, nodes, [(i, (i + ranks_per_node) % replicas) for i in range(replicas)])

        def one(g: jax.Array) -> jax.Array:
            if not jnp.issubdtype(g.dtype, jnp.floating):
                raise TypeError(f"gradients must be floating point, got {g.dtype}")
            wire = dtype if g.dtype == jnp.float32 else g.dtype
            part = _reduce_scatter((g / replicas).astype(wire).ravel(), rank, within)
            part = _all_gather(_reduce_scatter(part, node, across), node, across)[: part.size]
            flat = _all_gather(part, rank, within)[: g.size]
            return flat.reshape(g.shape).astype(g.dtype)

        return jax.tree.map(one, grads)

    return reduce


class _Ring(NamedTuple):
    """Rings of `size` devices along the data `axes`, several at once: `perm` links each device
    to the next one of its ring."""

    axes: tuple[str, ...]
    size: int
    perm: list[tuple[int, int]]

    def shift(self, x: jax.Array) -> jax.Array:
        """Every device's `x`, at the next device of its ring."""
        return jax.lax.ppermute(x, self.axes, self.perm)


def _reduce_scatter(flat: jax.Array, position: jax.Array, ring: _Ring) -> jax.Array:
    """The ring's sum of chunk ``(position + 1) % size`` of `flat` (zero-padded into `size`
    chunks), at the device at `position` of its ring."""
    size = ring.size
    chunks = jnp.pad(flat, (0, -flat.size % size)).reshape(size, -1)
    for s in range(size - 1):
        got = ring.shift(chunks[(position - s) % size])
        chunks = chunks.at[(position - s - 1) % size].add(got)
    return chunks[(position + 1) % size]


def _all_gather(chunk: jax.Array, position: jax.Array, ring: _Ring) -> jax.Array:
    """Every device's chunk (device p holding chunk ``(p + 1) % size``, as `_reduce_scatter`
    leaves them), concatenated in chunk order, on every device."""
    size = ring.size
    out = jnp.zeros((size, *chunk.shape), chunk.dtype).at[(position + 1) % size].set(chunk)
    for s in range(size - 1):
        chunk = ring.shift(chunk)
        out = out.at[(position - s) % size].set(chunk)
    return out.reshape(-1)


def scatter_mean(specs: Any, axis: str = "sharding") -> Reducer:
    """Average gradients over the data axes, leaving each device only its shard of those whose
    `specs` (a pytree of `PartitionSpec`s like the gradients) split a dimension over `axis`: a
    reduce-scatter over `axis` and an all-reduce over the other data axes (ZeRO-2)."""

    def reduce(grads: Any, axes: tuple[str, ...]) -> Any:
        replicas = jax.lax.psum(1, axes)

        def one(g: jax.Array, spec: PartitionSpec) -> jax.Array:
            g = g / replicas
            dims = [d for d, entry in enumerate(spec) if entry == axis or axis in (entry or ())]
            if not dims:
                return jax.lax.psum(g, axes)
            g = jax.lax.psum_scatter(g, axis, scatter_dimension=dims[0], tiled=True)
            others = tuple(a for a in axes if a != axis)
            return jax.lax.psum(g, others) if others else g

        return jax.tree.map(one, grads, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

    return reduce


def data_parallel(
    grad_fn: GradFn,
    mesh: Mesh,
    axes: Sequence[str],
    reducer: Reducer,
    grad_specs: Any = None,
    *,
    state_specs: Any = None,
    check_vma: bool = True,
) -> GradFn:
    """`grad_fn(params, model_state, batch, *rest) -> ((loss, aux, model_state), grads)` with
    the gradients reduced by `reducer` over the data `axes`; `grad_specs` says how the reduced
    gradients are split over the data axes (a pytree of `PartitionSpec`s; default whole on
    every device), `state_specs` likewise for the model state (None for none, or replicated).
    `check_vma` False lets a reducer made of `ppermute`s (`hierarchical_mean`) return equal
    values that JAX cannot prove equal.

    Inside, each device computes `grad_fn` on its rows of the batch; the loss and aux values are
    averaged over the replicas (they are means over equal shares of the batch); the new model
    state is each device's, split as `state_specs` says (a layer that syncs its statistics
    over the replicas makes them equal). A PRNG key in `rest` is folded with the replica
    index, so replicas draw different random numbers. Mesh axes other than `axes` (of size >
    1) stay with the compiler.
    """
    axes = tuple(axes)

    def local(params: Any, model_state: Any, batch: Any, *rest: Any) -> tuple[Outputs, Any]:
        # Varying parameters give each device its own gradient; with replicated (invariant)
        # ones, JAX's transpose would already sum the gradients over the devices.
        params = jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), params)
        if rest:
            rest = (jax.random.fold_in(rest[0], jax.lax.axis_index(axes)), *rest[1:])
        (loss, aux, model_state), grads = grad_fn(params, model_state, batch, *rest)
        mean = lambda tree: jax.tree.map(lambda x: jax.lax.pmean(x, axes), tree)  # noqa: E731
        return Outputs(mean(loss), mean(aux), model_state), reducer(grads, axes)

    manual = manual_axes(mesh, axes)

    def reduced(params: Any, model_state: Any, batch: Any, *rest: Any) -> tuple[Outputs, Any]:
        state = PartitionSpec() if state_specs is None else state_specs
        specs = (PartitionSpec(), state, PartitionSpec(axes), *(PartitionSpec() for _ in rest))
        out = PartitionSpec() if grad_specs is None else grad_specs
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=specs,
            out_specs=(Outputs(PartitionSpec(), PartitionSpec(), state), out),
            axis_names=manual,
            check_vma=check_vma,
        )(params, model_state, batch, *rest)

    return reduced
