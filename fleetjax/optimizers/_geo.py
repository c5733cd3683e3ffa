"""Geo-SGD: Paddle's parameter-server mode with `a_sync=True` and `a_sync_configs.k_steps > 0`
(its `GeoCommunicator`, paddle/fluid/distributed/ps/service/communicator/communicator.cc).

Each trainer trains on its own copy of the parameters and every `k_steps` steps exchanges
what it changed with the servers, which hold the global copy (`old` below: the global values
at the last exchange, the same on every trainer). Per parameter, on trainer r of T:

    delta_r = (latest_r - old) / T          # SendDense: the scaled change; old_r += delta_r
    server  = old + sum_r delta_r           # the servers add every trainer's delta
    latest_r += server - (old + delta_r)    # RecvDense; then old = server

so after an exchange the global copy is the trainers' mean, and each trainer keeps
``(1 - 1/T)`` of its own change on top of it (Paddle's formula; it is sent on later). Paddle's
trainers send and receive on a background thread; here every replica exchanges after its
`k_steps`-th, 2 `k_steps`-th, ... step, all at once.

`geo_sgd(inner, k_steps)` wraps the optimizer of the dense parameters; it runs inside
`jax.shard_map` over the data axes (`axis_names`), one replica per trainer, each with its own
parameters and optimizer state (as LocalSGD). Sparse tables exchange their touched rows the
same way, by the same formula (`geo_merge`; `fleetjax.transforms.sparse_rows.geo_exchange`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fleetjax.vocabulary import DATA_AXES


class GeoState(NamedTuple):
    """One replica's Geo-SGD state.

    Attributes:
      step: steps taken (int32).
      old: the parameters as the servers held them at the last exchange (Paddle's
        `old_scope`), the same on every replica.
      inner_state: the wrapped optimizer's state (this replica's own).
    """

    step: jax.Array
    old: Any
    inner_state: Any


def geo_merge(
    latest: jax.Array, old: jax.Array, axes: Sequence[str], sent: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(this replica's values, the servers') after Paddle's Geo exchange (the module docstring's
    formula) of `latest` (this replica's) against `old` (the servers' at the last exchange),
    inside `jax.shard_map` over the replica `axes`. `sent` (bools broadcasting against them)
    marks what this replica sends, as Paddle sends only the rows a trainer changed; its delta
    is zero elsewhere. Default: all of it."""
    delta = (latest - old) * (1.0 / lax.psum(1, tuple(axes)))
    if sent is not None:
        delta = jnp.where(sent, delta, 0)
    server = old + lax.psum(delta, tuple(axes))
    return latest + (server - (old + delta)), server


def geo_sgd(
    inner: optax.GradientTransformation,
    k_steps: int,
    axis_names: Sequence[str] = DATA_AXES,
) -> optax.GradientTransformationExtraArgs:
    """Paddle's Geo-SGD around `inner`: local steps, and every `k_steps` steps the exchange of
    the parameters' changes (module docstring). Runs inside `jax.shard_map` over
    `axis_names`, on each replica's own gradients, parameters and state."""
    if isinstance(k_steps, bool) or not isinstance(k_steps, int) or k_steps < 1:
        raise ValueError(f"a_sync_configs.k_steps must be an int >= 1 for Geo-SGD, got {k_steps!r}")
    inner = optax.with_extra_args_support(inner)
    axes = tuple(axis_names)

    def init(params: Any) -> GeoState:
        old = jax.tree.map(jnp.asarray, params)
        return GeoState(jnp.zeros([], jnp.int32), old, inner.init(params))

    def update(
        grads: Any, state: GeoState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, GeoState]:
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        step = state.step + 1

        def exchanged(updates: Any) -> tuple[Any, Any]:
            pairs = jax.tree.map(
                lambda n, o: geo_merge(n, o, axes), optax.apply_updates(params, updates), state.old
            )
            is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
            latest = jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair)
            server = jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)
            moved = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), latest, params)
            return moved, server

        updates, old = lax.cond(step % k_steps == 0, exchanged, lambda u: (u, state.old), updates)
        return updates, GeoState(step, old, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)
