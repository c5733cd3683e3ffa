"""Recompute (Paddle's `recompute`, `recompute_configs`): keep only the named activations of each
layer and recompute the rest in the backward pass, with `jax.checkpoint` policies.

Name activations with `checkpoint_name(x, "name")`. Remat saves memory only at a granularity
finer than the whole loss (a `jax.checkpoint` around the whole loss recomputes, and so stores,
every activation again during the backward pass), so layers are marked: `recompute(layer_fn)`
(Paddle's `fleet.utils.recompute`), typically the body of a `lax.scan` over stacked layers:

    def body(x, layer_params):
        return fleetjax.recompute(block)(layer_params, x), None

    x, _ = jax.lax.scan(body, x, params["layers"])

Under a train step whose strategy turns recompute on, each marked layer becomes
`jax.checkpoint(layer_fn, policy=...)` with the strategy's policy; elsewhere the marker does
nothing. `remat(fn, ...)` applies a policy directly, with no strategy involved.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name as _jax_checkpoint_name

from fleetjax.vocabulary import REMAT_POLICIES as POLICIES  # the plain jax.checkpoint_policies


def remat_policy(
    checkpoints: Sequence[str] = (), *, policy: str | None = None, offload: bool = False
) -> Callable[..., Any]:
    """The `jax.checkpoint` policy that saves the named `checkpoints` (and whatever the named
    `policy` saves), or, with `offload`, moves the named checkpoints to pinned host memory."""
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    policies = jax.checkpoint_policies
    if offload:
        if policy is not None:
            raise ValueError(
                "enable_offload offloads the named checkpoints; it cannot be combined with a "
                f"named policy ({policy!r})"
            )
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(checkpoints),
            offload_src="device",
            offload_dst="pinned_host",
        )
    named = policies.save_only_these_names(*checkpoints)
    if policy is None:
        return named
    return policies.save_from_both_policies(getattr(policies, policy), named)


def remat(
    fn: Callable[..., Any],
    checkpoints: Sequence[str] = (),
    *,
    policy: str | None = None,
    offload: bool = False,
) -> Callable[..., Any]:
    """`fn` under `jax.checkpoint` with `remat_policy(checkpoints, policy=..., offload=...)`."""
    return jax.checkpoint(fn, policy=remat_policy(checkpoints, policy=policy, offload=offload))


@dataclasses.dataclass
class _Tracing:
    """What one traced loss did with the recompute markers."""

    policy: Callable[..., Any]
    layers: int = 0
    names: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


_ACTIVE: contextvars.ContextVar[_Tracing | None] = contextvars.ContextVar(
    "fleetjax_recompute", default=None
)


def recompute(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark `fn` (one layer) for recompute under the train step's recompute policy.

    `fleetjax.recompute(block)(x)` is Paddle's `fleet.utils.recompute(block, x)`; without an
    active recompute strategy it is `block(x)`. Keyword arguments are held fixed (not
    differentiated).
    """

    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        tracing = _ACTIVE.get()
        if tracing is None:
            return fn(*args, **kwargs)
        tracing.layers += 1
        return jax.checkpoint(functools.partial(fn, **kwargs), policy=tracing.policy)(*args)

    return wrapped


def checkpoint_name(x: Any, name: str) -> Any:
    """Name the activation `x` so that `recompute_configs["checkpoints"]` can keep it
    (`jax.ad_checkpoint.checkpoint_name`, recording its shape for the strategy's checks)."""
    tracing = _ACTIVE.get()
    if tracing is not None:
        tracing.names.setdefault(name, tuple(x.shape))
    return _jax_checkpoint_name(x, name)


@contextlib.contextmanager
def recompute_scope(
    checkpoints: Sequence[str] = (),
    *,
    policy: str | None = None,
    offload: bool = False,
    checkpoint_shape: Sequence[int] = (),
    replicas: int = 1,
) -> Iterator[_Tracing]:
    """Trace a loss with recompute on: layers marked with `recompute` use the policy.

    On leaving, checks that layers were marked, that every checkpoint name was used, and, if
    `checkpoint_shape` is given, that each named checkpoint has that shape (whole, or per data
    replica: the leading dimension divided by `replicas`).
    """
    tracing = _Tracing(remat_policy(checkpoints, policy=policy, offload=offload))
    token = _ACTIVE.set(tracing)
    try:
        yield tracing
    finally:
        _ACTIVE.reset(token)
    if tracing.layers == 0:
        raise ValueError(
            "recompute is on, but the loss marks no layer with fleetjax.recompute; a "
            "jax.checkpoint around the whole loss would not save memory. Wrap each layer "
            "(for stacked layers, the lax.scan body) with fleetjax.recompute(layer_fn)"
        )
    missing = [name for name in checkpoints if name not in tracing.names]
    if missing:
        raise ValueError(
            f"recompute checkpoints {missing} are not named in the loss; names given with "
            f"fleetjax.checkpoint_name: {sorted(tracing.names) or 'none'}"
        )
    if checkpoint_shape:
        want = tuple(checkpoint_shape)
        for name in checkpoints:
            shape = tracing.names[name]
            per_replica = (shape[0] // replicas, *shape[1:]) if shape else shape
            if want not in (shape, per_replica):
                raise ValueError(
                    f"checkpoint_shape is {list(want)}, but checkpoint {name!r} has shape "
                    f"{list(shape)} ({list(per_replica)} per data replica)"
                )
