"""LARS: Paddle's `lars_momentum` op (`strategy.lars`, `lars_configs`).

Per parameter tensor `p` with gradient `g` (Paddle's CPU kernel, whose guards we follow):

    wd       = 0 if any name in exclude_from_weight_decay is a substring of p's name
               else lars_weight_decay
    local_lr = lr * lars_coeff * ||p|| / (||g|| + wd * ||p|| + epsilon)
                                        if wd > 0 and ||p|| > 0 and ||g|| > 0, else lr
    v = momentum * v + local_lr * (g + wd * p);   p = p - v

so an excluded parameter gets plain momentum with the global learning rate. `optax.lars`
differs (denominator `||g + wd p||`, and it adapts even when wd = 0). Parameter names are
`param_names` paths such as `"params/dense_0/bias"`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fleetjax.optimizers._basic import (
    LearningRate,
    PaddleOptimizer,
    check_clip_norm,
    check_learning_rate,
    check_number,
    l2_norm,
    paddle_optimizer,
    regularized,
)
from fleetjax.optimizers._names import check_names, param_names


def scale_by_lars(
    lars_coeff: float = 0.001,
    lars_weight_decay: float = 0.0005,
    epsilon: float = 0.0,
    exclude_from_weight_decay: Sequence[str] = (),
) -> optax.GradientTransformation:
    """`g -> trust * (g + wd * p)`, LARS's scaling before the learning rate and momentum
    (`trust = local_lr / lr` above). Needs `params` in `update`."""
    exclude = check_names(exclude_from_weight_decay, "exclude_from_weight_decay")

    def scale(g: jax.Array, p: jax.Array, name: str) -> jax.Array:
        wd = 0.0 if any(part in name for part in exclude) else lars_weight_decay
        if wd == 0:
            return g
        p_norm, g_norm = l2_norm(p), l2_norm(g)
        adapt = (p_norm > 0) & (g_norm > 0)
        trust = lars_coeff * p_norm / jnp.where(adapt, g_norm + wd * p_norm + epsilon, 1)
        return (jnp.where(adapt, trust, 1) * (g + wd * p)).astype(g.dtype)

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("LARS needs the parameters: call update(grads, state, params)")
        return jax.tree.map(scale, updates, params, param_names(params)), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def lars(
    learning_rate: LearningRate = 0.001,
    momentum: float = 0.9,
    lars_coeff: float = 0.001,
    lars_weight_decay: float = 0.0005,
    epsilon: float = 0.0,
    exclude_from_weight_decay: Sequence[str] = (),
    *,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
) -> PaddleOptimizer:
    """Paddle's `LarsMomentumOptimizer` (`lars_momentum`), as `strategy.lars` builds it.

    Args:
      learning_rate, momentum: from the user's Momentum (a schedule is allowed).
      lars_coeff, lars_weight_decay, epsilon, exclude_from_weight_decay: `lars_configs`;
        a parameter whose `param_names` path contains one of the excluded strings gets
        `lars_weight_decay = 0`, and with it no adaptation.
      weight_decay, clip_norm: the user's Momentum's L2 regularization and per-tensor clip,
        applied to the gradient first (Paddle passes both on to the LARS optimizer).
    """
    learning_rate = check_learning_rate(learning_rate)
    hyperparams = {
        "learning_rate": learning_rate,
        "momentum": check_number("momentum", momentum),
        "lars_coeff": check_number("lars_coeff", lars_coeff),
        "lars_weight_decay": check_number("lars_weight_decay", lars_weight_decay),
        "epsilon": check_number("epsilon", epsilon),
        "exclude_from_weight_decay": check_names(
            exclude_from_weight_decay, "exclude_from_weight_decay"
        ),
        "weight_decay": check_number("weight_decay", weight_decay),
        "clip_norm": check_clip_norm(clip_norm),
    }
    # The learning rate goes inside the velocity, as in Paddle (it matters for schedules).
    tx = optax.chain(
        scale_by_lars(lars_coeff, lars_weight_decay, epsilon, exclude_from_weight_decay),
        optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=learning_rate),
        optax.trace(decay=hyperparams["momentum"]),
    )
    return paddle_optimizer(
        regularized(tx, hyperparams["weight_decay"], hyperparams["clip_norm"]),
        "LarsMomentum",
        hyperparams,
    )
