"""Paddle's sparse table rules (paddle/fluid/distributed/ps/table/sparse_sgd_rule.cc), row-wise:
how a parameter-server table's rows train, as optax's transformations are for whole arrays.

`naive_sgd`, `adagrad` (`SparseAdaGradSGDRule`: one g2sum per row; `StdAdaGradSGDRule` with
`per_element`), `adam` (`SparseAdamSGDRule`: lazy, per-row beta powers, so a row's moments only
move when it is touched; `SparseSharedAdamSGDRule` with `shared`); `sparse_accessor` applies one
to the first column (`embed_w`) and one to the others (`embedx`), as Paddle's `SparseAccessor`
does; `paddle_rule` builds the one an `SGDParameter.name` names. Gradients are not divided by
the show count (Paddle's `scale`, a CTR accessor's bookkeeping): the rules see the gradient of
the loss. `fleetjax.transforms.sparse_rows` applies them to the rows a batch touches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "PADDLE_RULES",
    "AccessorSlots",
    "AdagradSlots",
    "AdamSlots",
    "SparseRule",
    "adagrad",
    "adam",
    "naive_sgd",
    "paddle_rule",
    "sparse_accessor",
]

Bounds = tuple[float, float] | None


class SparseRule(NamedTuple):
    """A row-wise update rule, as an optax transformation is for whole arrays:
    ``init(rows) -> slots`` (arrays with one row per table row) and
    ``update(rows, slots, grads) -> (rows, slots)``, each row depending only on itself."""

    init: Callable[[jax.Array], Any]
    update: Callable[[jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


def _bound(w: jax.Array, weight_bounds: Bounds) -> jax.Array:
    """Paddle's `BoundValue`: below the low bound (or NaN) -> low, above the high -> high."""
    if weight_bounds is None:
        return w
    low, high = weight_bounds
    return jnp.where(w >= low, jnp.where(w <= high, w, high), low).astype(w.dtype)


def _column(rows: jax.Array, width: int, value: float = 0.0) -> jax.Array:
    return jnp.full((rows.shape[0], width), value, rows.dtype)


def naive_sgd(learning_rate: float = 0.05, weight_bounds: Bounds = None) -> SparseRule:
    """`SparseNaiveSGDRule`: ``w -= learning_rate * g``, bounded."""

    def update(rows: jax.Array, slots: Any, grads: jax.Array) -> tuple[jax.Array, Any]:
        return _bound(rows - learning_rate * grads, weight_bounds), slots

    return SparseRule(lambda rows: optax.EmptyState(), update)


class AdagradSlots(NamedTuple):
    g2sum: jax.Array  # [rows, 1], or [rows, dim] with `per_element`


def adagrad(
    learning_rate: float = 0.05,
    initial_g2sum: float = 3.0,
    weight_bounds: Bounds = None,
    *,
    per_element: bool = False,
) -> SparseRule:
    """`SparseAdaGradSGDRule`: ``w -= lr * g * sqrt(initial_g2sum / (initial_g2sum + g2sum))``,
    then ``g2sum += mean(g ** 2)`` over the row (one g2sum per row); with `per_element`,
    `StdAdaGradSGDRule` (one g2sum per element, ``g2sum += g ** 2``)."""

    def init(rows: jax.Array) -> AdagradSlots:
        return AdagradSlots(_column(rows, rows.shape[1] if per_element else 1))

    def update(rows: jax.Array, slots: AdagradSlots, g: jax.Array) -> tuple[jax.Array, Any]:
        scale = jnp.sqrt(initial_g2sum / (initial_g2sum + slots.g2sum))
        rows = _bound(rows - learning_rate * g * scale, weight_bounds)
        added = g * g if per_element else jnp.mean(g * g, axis=1, keepdims=True)
        return rows, AdagradSlots(slots.g2sum + added)

    return SparseRule(init, update)


class AdamSlots(NamedTuple):
    gsum: jax.Array  # first moment: [rows, dim], or [rows, 1] with `shared`
    g2sum: jax.Array  # second moment, likewise
    beta1_pow: jax.Array  # [rows, 1]: beta1 ** (the row's updates + 1)
    beta2_pow: jax.Array


def adam(
    learning_rate: float = 0.001,
    beta1_decay_rate: float = 0.9,
    beta2_decay_rate: float = 0.999,
    ada_epsilon: float = 1e-8,
    weight_bounds: Bounds = None,
    *,
    shared: bool = False,
) -> SparseRule:
    """`SparseAdamSGDRule`: Adam with moments and beta powers per row (starting at beta1 and
    beta2), so untouched rows keep theirs (lazy): ``lr_t = lr * sqrt(1 - beta2_pow) /
    (1 - beta1_pow)``, ``w -= lr_t * m / (sqrt(v) + ada_epsilon)``, then the powers times beta.
    With `shared`, `SparseSharedAdamSGDRule`: a row keeps one first and one second moment (the
    means of its elements' new moments)."""
    b1, b2, eps = beta1_decay_rate, beta2_decay_rate, ada_epsilon

    def init(rows: jax.Array) -> AdamSlots:
        zero = _column(rows, 1 if shared else rows.shape[1])
        return AdamSlots(zero, zero, _column(rows, 1, b1), _column(rows, 1, b2))

    def update(rows: jax.Array, s: AdamSlots, g: jax.Array) -> tuple[jax.Array, AdamSlots]:
        step_lr = learning_rate * jnp.sqrt(1 - s.beta2_pow) / (1 - s.beta1_pow)
        gsum = b1 * s.gsum + (1 - b1) * g
        g2sum = b2 * s.g2sum + (1 - b2) * g * g
        rows = _bound(rows - step_lr * (gsum / (jnp.sqrt(g2sum) + eps)), weight_bounds)
        if shared:
            gsum, g2sum = (jnp.mean(x, axis=1, keepdims=True) for x in (gsum, g2sum))
        return rows, AdamSlots(gsum, g2sum, s.beta1_pow * b1, s.beta2_pow * b2)

    return SparseRule(init, update)


class AccessorSlots(NamedTuple):
    embed: Any  # the first column's slots
    embedx: Any  # the other columns'


def sparse_accessor(embed: SparseRule, embedx: SparseRule) -> SparseRule:
    """Paddle's `SparseAccessor`: `embed` (its `embed_sgd_param`) updates a row's first column
    (`embed_w`), `embedx` (`embedx_sgd_param`) the others."""

    def init(rows: jax.Array) -> AccessorSlots:
        return AccessorSlots(embed.init(rows[:, :1]), embedx.init(rows[:, 1:]))

    def update(rows: jax.Array, s: AccessorSlots, g: jax.Array) -> tuple[jax.Array, Any]:
        first, s_embed = embed.update(rows[:, :1], s.embed, g[:, :1])
        if rows.shape[1] == 1:  # no embedx columns (Paddle's embedx_dim 0)
            return first, AccessorSlots(s_embed, s.embedx)
        rest, s_embedx = embedx.update(rows[:, 1:], s.embedx, g[:, 1:])
        return jnp.concatenate([first, rest], axis=1), AccessorSlots(s_embed, s_embedx)

    return SparseRule(init, update)


PADDLE_RULES: dict[str, Callable[..., SparseRule]] = {
    "SparseNaiveSGDRule": naive_sgd,
    "SparseAdaGradSGDRule": adagrad,
    "StdAdaGradSGDRule": functools.partial(adagrad, per_element=True),
    "SparseAdamSGDRule": adam,
    "SparseSharedAdamSGDRule": functools.partial(adam, shared=True),
}


def paddle_rule(name: str, **config: Any) -> SparseRule:
    """The rule Paddle's `SGDParameter.name` names, with its parameters (the keyword arguments
    of `naive_sgd`, `adagrad`, ...: Paddle's field names)."""
    if name not in PADDLE_RULES:
        raise NotImplementedError(
            f"sparse rule {name!r} is not available in fleetjax; use one of "
            f"{', '.join(PADDLE_RULES)}"
        )
    return PADDLE_RULES[name](**config)
