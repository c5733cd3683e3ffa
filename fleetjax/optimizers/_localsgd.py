"""LocalSGD and Adaptive LocalSGD: Paddle's `LocalSGDOptimizer` and `AdaptiveLocalSGDOptimizer`
(`strategy.localsgd` / `localsgd_configs`, `strategy.adaptive_localsgd` /
`adaptive_localsgd_configs`).

Interface. Both wrap the user's optimizer and run INSIDE `jax.shard_map` over the data axes
(`axis_names`): each replica calls `update(grads, state, params)` with its OWN local gradient
(no gradient all-reduce), its own optimizer state and its own parameters (all stacked on a
leading axis sharded over the data axes, as the replicas drift apart between syncs). The
returned updates are the inner optimizer's, except on a sync step, where they move every
replica onto the mean of the replicas' new parameters (`pmean` over `axis_names`; the only
communication). Adaptive LocalSGD also needs this replica's loss: `update(..., value=loss)`.

Paddle's step counter is 1 on the first step. A sync happens on every step up to and including
`begin_step`, then whenever `step - last_sync == k_steps`. Adaptive LocalSGD starts from
`k_steps = init_k_steps` and, on each sync after `begin_step`, sets (in float32, as Paddle)

    k_steps = clip(ceil(sqrt(lr_0 * mean_loss / (lr * loss_0) * init_k_steps)), 1, 16)

where `loss_0`, `lr_0` are the replica-mean loss and the learning rate of step 1, `mean_loss`
the replica-mean loss of this step and `lr` this step's learning rate (read with `get_lr`).

This is Paddle's classic LocalSGD. (In Paddle 3.x's default static setup the RawProgram
optimizer also all-reduces every gradient, so LocalSGD there is synchronous data parallel plus
redundant averaging.) Averaging is `pmean` of the parameters; Paddle averages deltas from a
snapshot, the same values up to rounding. Updates are applied by addition, so right after a
sync the replicas agree to within the rounding of `p + (mean - p)`, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from fleetjax.optimizers._lr import get_lr
from fleetjax.vocabulary import DATA_AXES

MAX_K_STEPS = 16  # Paddle's bounds on the adapted interval
MIN_K_STEPS = 1


class LocalSGDState(NamedTuple):
    """One replica's LocalSGD state.

    Attributes:
      step: steps taken (int32); Paddle's counter, which reads 1 during the first step.
      last_step: the step of the latest sync (0 before any).
      inner_state: the wrapped optimizer's state (this replica's own).
    """

    step: jax.Array
    last_step: jax.Array
    inner_state: Any


class AdaptiveLocalSGDState(NamedTuple):
    """One replica's Adaptive LocalSGD state.

    Attributes:
      step, last_step, inner_state: as in `LocalSGDState`.
      k_steps: the current sync interval (int32).
      loss_0: the replica-mean loss of step 1.
      lr_0: the learning rate of step 1.
    """

    step: jax.Array
    last_step: jax.Array
    k_steps: jax.Array
    loss_0: jax.Array
    lr_0: jax.Array
    inner_state: Any


def _check_steps(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _sync_due(step: jax.Array, last_step: jax.Array, k_steps: Any, begin_step: int) -> Any:
    """Paddle's rule: every step up to `begin_step`, then when `k_steps` have passed."""
    return (step <= begin_step) | (step - last_step == k_steps)


def _step_and_sync(
    inner: optax.GradientTransformationExtraArgs,
    grads: Any,
    inner_state: Any,
    params: Any,
    sync: jax.Array,
    axes: tuple[str, ...],
    extra_args: dict[str, Any],
) -> tuple[Any, Any]:
    """The inner optimizer's local step, and on a sync the move onto the replicas' mean."""
    updates, inner_state = inner.update(grads, inner_state, params, **extra_args)

    def onto_mean(updates: Any) -> Any:
        new = optax.apply_updates(params, updates)
        mean = lax.pcast(lax.pmean(new, axes), axes, to="varying")
        return jax.tree.map(lambda m, p: (m - p).astype(p.dtype), mean, params)

    return lax.cond(sync, onto_mean, lambda u: u, updates), inner_state


def localsgd(
    inner: optax.GradientTransformation,
    k_steps: int = 1,
    begin_step: int = 1,
    axis_names: Sequence[str] = DATA_AXES,
) -> optax.GradientTransformationExtraArgs:
    """Paddle's LocalSGD around `inner`: local steps, parameters averaged over `axis_names`
    on every step up to `begin_step` and then every `k_steps` (`localsgd_configs`). Runs
    inside `jax.shard_map` (see the module docstring)."""
    k_steps = _check_steps("k_steps", k_steps, 1)
    begin_step = _check_steps("begin_step", begin_step, 0)
    inner = optax.with_extra_args_support(inner)
    axes = tuple(axis_names)

    def init(params: Any) -> LocalSGDState:
        zero = jnp.zeros([], jnp.int32)
        return LocalSGDState(zero, zero, inner.init(params))

    def update(
        grads: Any, state: LocalSGDState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LocalSGDState]:
        step = state.step + 1
        sync = _sync_due(step, state.last_step, k_steps, begin_step)
        updates, inner_state = _step_and_sync(
            inner, grads, state.inner_state, params, sync, axes, extra_args
        )
        return updates, LocalSGDState(step, jnp.where(sync, step, state.last_step), inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def next_k_steps(init_k_steps: int, lr_0: Any, loss_0: Any, lr: Any, mean_loss: Any) -> jax.Array:
    """Adaptive LocalSGD's new interval, in float32 and in Paddle's order of operations."""
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    ratio = f32(lr_0) * f32(mean_loss) / (f32(lr) * f32(loss_0)) * np.float32(init_k_steps)
    return jnp.clip(jnp.ceil(jnp.sqrt(ratio)).astype(jnp.int32), MIN_K_STEPS, MAX_K_STEPS)


def adaptive_localsgd(
    inner: optax.GradientTransformation,
    init_k_steps: int = 1,
    begin_step: int = 1,
    axis_names: Sequence[str] = DATA_AXES,
) -> optax.GradientTransformationExtraArgs:
    """Paddle's Adaptive LocalSGD around `inner` (`adaptive_localsgd_configs`): LocalSGD whose
    interval adapts to the loss and learning rate (module docstring). `update` needs
    `value=` this replica's loss; `inner`'s learning rate must be injected (`get_lr`)."""
    init_k_steps = _check_steps("init_k_steps", init_k_steps, 1)
    begin_step = _check_steps("begin_step", begin_step, 0)
    inner = optax.with_extra_args_support(inner)
    axes = tuple(axis_names)

    def init(params: Any) -> AdaptiveLocalSGDState:
        inner_state = inner.init(params)
        lr = get_lr(inner_state)  # fails early, with advice, if there is none
        zero = jnp.zeros([], jnp.int32)
        return AdaptiveLocalSGDState(
            zero,
            zero,
            jnp.asarray(init_k_steps, jnp.int32),
            jnp.zeros([], jnp.float32),
            jnp.zeros([], lr.dtype),
            inner_state,
        )

    def update(
        grads: Any,
        state: AdaptiveLocalSGDState,
        params: Any = None,
        *,
        value: jax.Array | None = None,
        **extra_args: Any,
    ) -> tuple[Any, AdaptiveLocalSGDState]:
        if value is None:
            raise ValueError(
                "adaptive_localsgd needs this replica's loss: call update(grads, state, "
                "params, value=loss)"
            )
        step = state.step + 1
        sync = _sync_due(step, state.last_step, state.k_steps, begin_step)
        adapt = sync & (step > begin_step)
        updates, inner_state = _step_and_sync(
            inner, grads, state.inner_state, params, sync, axes, {"value": value, **extra_args}
        )
        lr = get_lr(inner_state)  # the learning rate this step used
        first = step == 1
        mean_loss = lax.cond(
            first | adapt,
            lambda: lax.pmean(value, axes).astype(jnp.float32),
            lambda: jnp.zeros([], jnp.float32),
        )
        loss_0 = jnp.where(first, mean_loss, state.loss_0)
        lr_0 = jnp.where(first, lr, state.lr_0)
        k_steps = jnp.where(
            adapt, next_k_steps(init_k_steps, lr_0, loss_0, lr, mean_loss), state.k_steps
        )
        last_step = jnp.where(sync, step, state.last_step)
        return updates, AdaptiveLocalSGDState(step, last_step, k_steps, loss_0, lr_0, inner_state)

    return optax.GradientTransformationExtraArgs(init, update)
