"""Per-replica updates: what Paddle's DGC and LocalSGD need.

Those optimizers do their own communication (a sparse top-k exchange, a periodic average of
the parameters), so the whole update runs inside one `jax.shard_map` over the data axes: each
data-parallel replica computes the gradient of its own batch rows and steps its own optimizer
state, kept stacked on a leading replica axis between steps.

    update(state, batch, key, agree) -> (new_state, metrics)

`per_replica(update, mesh, axes, state_specs, stacked)` runs `update` on every replica: the
subtrees `stacked` marks arrive unstacked (the replica's own row) and leave restacked, the
key is folded with the replica index, `agree` makes replicas decide alike (a `pmin` of a
boolean over the replicas, for loss scaling's skip), and floating metrics are averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from fleetjax.mesh import manual_axes

Agree = Callable[[jax.Array], jax.Array]
# (state, batch, key, agree) -> (new state, metrics)
Update = Callable[[Any, Any, Any, Agree], tuple[Any, dict[str, Any]]]


def per_replica(
    update: Update, mesh: Mesh, axes: Sequence[str], state_specs: Any, stacked: Any
) -> Callable[[Any, Any, Any], tuple[Any, dict[str, Any]]]:
    """`update` run by each data-parallel replica over `axes` on its own rows and state.

    Args:
      update: ``update(state, batch, key, agree) -> (state, metrics)``; `key` may be None.
      mesh: the mesh; its other axes of size > 1 stay with the compiler.
      axes: the data axes the replicas span.
      state_specs: `PartitionSpec`s over `axes` only, a prefix pytree of the state: how the
        global state is split over the replicas (`PartitionSpec(axes)` for the stacked
        subtrees).
      stacked: bools, a prefix pytree of the state: True for the subtrees stacked on a leading
        replica axis (the optimizer state, LocalSGD's parameters).

    Returns:
      ``run(state, batch, key) -> (state, metrics)`` on the global state and batch (outside
      `shard_map`), with the replicas' metrics averaged.
    """
    axes = tuple(axes)

    def each(fn: Callable[[jax.Array], jax.Array]) -> Callable[[Any], Any]:
        def over(tree: Any) -> Any:
            def one(is_stacked: bool, subtree: Any) -> Any:
                return jax.tree.map(fn, subtree) if is_stacked else subtree

            return jax.tree.map(one, stacked, tree)

        return over

    unstack, restack = each(lambda x: x[0]), each(lambda x: x[None])

    def agree(finite: jax.Array) -> jax.Array:
        return jax.lax.pmin(finite.astype(jnp.int32), axes) == 1

    def mean(x: jax.Array) -> jax.Array:
        return jax.lax.pmean(x, axes) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def local(state: Any, batch: Any, key: Any) -> tuple[Any, dict[str, Any]]:
        if key is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(axes))
        new, metrics = update(unstack(state), batch, key, agree)
        return restack(new), jax.tree.map(mean, metrics)

    # Updates that are equal on every replica are typed per replica, so the outputs'
    # replication is not checked.
    manual = manual_axes(mesh, axes)

    def run(state: Any, batch: Any, key: Any) -> tuple[Any, dict[str, Any]]:
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(state_specs, PartitionSpec(axes), PartitionSpec()),
            out_specs=(state_specs, PartitionSpec()),
            axis_names=manual,
            check_vma=False,
        )(state, batch, key)

    return run
