"""Loss scaling (Paddle's `amp_configs`: `init_loss_scaling`, `use_dynamic_loss_scaling`,
`incr_every_n_steps`, `decr_every_n_nan_or_inf`, `incr_ratio`, `decr_ratio`).

Half-precision gradients underflow; so the loss is multiplied by a scale before the backward
pass and the gradients divided by it after. A step whose gradients are not all finite is
skipped (parameters and optimizer state unchanged), and the scale adapts by Paddle's rule
(its `check_finite_and_unscale` and `update_loss_scaling` kernels):

    scale = DynamicLossScale.create(32768.0)
    loss = scale.scale(loss)                        # before differentiating
    new, scale, metrics = apply_if_finite(step, (params, opt_state), grads, scale)

`DynamicLossScale` is a pytree (its counters are arrays, its rule's constants static), so it
lives in the train state and is checkpointed with it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """The loss scale and Paddle's good/bad step counters, with the rule that adjusts them.

    Attributes:
      loss_scale: the scale (float32 scalar).
      good_steps: consecutive steps with finite gradients (int32).
      bad_steps: consecutive steps with non-finite gradients (int32).
      dynamic: whether `adjust` changes the scale (`use_dynamic_loss_scaling`); a fixed scale
        still skips non-finite steps.
      incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio: Paddle's rule.
    """

    loss_scale: jax.Array
    good_steps: jax.Array
    bad_steps: jax.Array
    dynamic: bool = dataclasses.field(default=True, metadata={"static": True})
    incr_every_n_steps: int = dataclasses.field(default=1000, metadata={"static": True})
    decr_every_n_nan_or_inf: int = dataclasses.field(default=2, metadata={"static": True})
    incr_ratio: float = dataclasses.field(default=2.0, metadata={"static": True})
    decr_ratio: float = dataclasses.field(default=0.5, metadata={"static": True})

    @classmethod
    def create(cls, init_loss_scaling: float, **rule: Any) -> DynamicLossScale:
        """A fresh scale of `init_loss_scaling`, counters at zero; `rule` sets the static
        fields (`dynamic`, `incr_every_n_steps`, ...)."""
        zero = jnp.zeros((), jnp.int32)
        return cls(jnp.asarray(init_loss_scaling, jnp.float32), zero, zero, **rule)

    def scale(self, x: jax.Array) -> jax.Array:
        """`x` (a loss) times the scale, in `x`'s dtype."""
        return x * self.loss_scale.astype(x.dtype)

    def unscale(self, tree: Any) -> Any:
        """Every leaf of `tree` (the gradients) divided by the scale, in its own dtype."""
        return jax.tree.map(lambda g: g / self.loss_scale.astype(g.dtype), tree)

    def adjust(self, finite: jax.Array) -> DynamicLossScale:
        """The scale after a step whose gradients were all `finite` (or not): Paddle's
        `update_loss_scaling`. After `decr_every_n_nan_or_inf` consecutive non-finite steps the
        scale shrinks by `decr_ratio` (never below 1); after `incr_every_n_steps` consecutive
        finite steps it grows by `incr_ratio` (unless that overflows). A fixed scale
        (`dynamic=False`) stays."""
        if not self.dynamic:
            return self
        bad = jnp.where(finite, 0, self.bad_steps + 1)
        good = jnp.where(finite, self.good_steps + 1, 0)
        decrease = ~finite & (bad == self.decr_every_n_nan_or_inf)
        increase = finite & (good == self.incr_every_n_steps)
        grown = self.loss_scale * self.incr_ratio
        scale = jnp.where(
            decrease, jnp.maximum(self.loss_scale * self.decr_ratio, 1.0), self.loss_scale
        )
        scale = jnp.where(increase & jnp.isfinite(grown), grown, scale)
        return dataclasses.replace(
            self,
            loss_scale=scale.astype(jnp.float32),
            good_steps=jnp.where(increase, 0, good).astype(jnp.int32),
            bad_steps=jnp.where(decrease, 0, bad).astype(jnp.int32),
        )


jax.tree_util.register_dataclass(
    DynamicLossScale,
    data_fields=["loss_scale", "good_steps", "bad_steps"],
    meta_fields=[
        "dynamic",
        "incr_every_n_steps",
        "decr_every_n_nan_or_inf",
        "incr_ratio",
        "decr_ratio",
    ],
)


def all_finite(tree: Any) -> jax.Array:
    """Whether every element of every floating leaf is finite (Paddle's `found_inf`, negated)."""
    floating = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    leaves = [jnp.all(jnp.isfinite(x)) for x in floating]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def apply_if_finite(
    update: Callable[[Any], T],
    unchanged: T,
    grads: Any,
    loss_scale: DynamicLossScale,
    agree: Callable[[jax.Array], jax.Array] = lambda finite: finite,
) -> tuple[T, DynamicLossScale, dict[str, jax.Array]]:
    """`update(unscaled grads)` if every gradient is finite, else `unchanged`; and the adjusted
    scale, and metrics `loss_scale` (the scale this step used) and `skipped`.

    As optax's `apply_if_finite`, but for scaled gradients. `agree` makes replicas that hold
    different gradients decide alike (e.g. a `pmin` over the data axes inside `shard_map`).
    """
    grads = loss_scale.unscale(grads)
    finite = agree(all_finite(grads))
    new = jax.lax.cond(finite, update, lambda _: unchanged, grads)
    metrics = {"loss_scale": loss_scale.loss_scale, "skipped": ~finite}
    return new, loss_scale.adjust(finite), metrics
