"""LAMB: Paddle's `lamb` op (`strategy.lamb`, `lamb_configs`).

Per parameter tensor `p`, after Adam's moments (`beta_pow` starts at beta, as optax's count):

    wd    = 0 if p's name ends with one of exclude_from_weight_decay, else lamb_weight_decay
    r     = m_hat / (sqrt(v_hat) + epsilon) + wd * p
    trust = ||p|| / ||r||   if (wd > 0 or always_adapt) and ||p|| > 0 and ||r|| > 0, else 1
    p     = p - lr * trust * r

so an excluded parameter takes a plain Adam step (`optax.lamb` would still adapt it).
Parameter names are `param_names` paths such as `"params/dense_0/bias"`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
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


def scale_by_lamb_trust_ratio(
    lamb_weight_decay: float = 0.01,
    exclude_from_weight_decay: Sequence[str] = (),
    always_adapt: bool = False,
) -> optax.GradientTransformation:
    """`r -> trust * (r + wd * p)` on Adam's direction `r`, as above. Needs `params`."""
    exclude = check_names(exclude_from_weight_decay, "exclude_from_weight_decay")

    def scale(r: jax.Array, p: jax.Array, name: str) -> jax.Array:
        wd = 0.0 if name.endswith(exclude) else lamb_weight_decay
        r = r + wd * p
        if wd == 0 and not always_adapt:
            return r
        p_norm, r_norm = l2_norm(p), l2_norm(r)
        adapt = (p_norm > 0) & (r_norm > 0)
        trust = jnp.where(adapt, p_norm / jnp.where(adapt, r_norm, 1), 1)
        return (trust * r).astype(r.dtype)

    def update(updates: Any, state: optax.EmptyState, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("LAMB needs the parameters: call update(grads, state, params)")
        return jax.tree.map(scale, updates, params, param_names(params)), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def lamb(
    learning_rate: LearningRate = 0.001,
    lamb_weight_decay: float = 0.01,
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-6,
    exclude_from_weight_decay: Sequence[str] = (),
    always_adapt: bool = False,
    *,
    clip_norm: float | None = None,
) -> PaddleOptimizer:
    """Paddle's `paddle.optimizer.Lamb`, as `strategy.lamb` builds it.

    Args:
      learning_rate, beta1, beta2, epsilon: from the user's Adam (fleet passes the Adam's
        epsilon, default 1e-8; Lamb's own default is 1e-6). A schedule is allowed.
      lamb_weight_decay, exclude_from_weight_decay: `lamb_configs`; a parameter whose
        `param_names` path ends with one of the excluded strings gets no decay and no trust
        ratio.
      always_adapt: Paddle's `Lamb(always_adapt=...)`: apply the trust ratio even where the
        decay is 0 (fleet leaves it False).
      clip_norm: the user's Adam's per-tensor clip, applied to the gradient first.
    """
    learning_rate = check_learning_rate(learning_rate)
    hyperparams = {
        "learning_rate": learning_rate,
        "lamb_weight_decay": check_number("lamb_weight_decay", lamb_weight_decay),
        "beta1": check_number("beta1", beta1, below=1.0),
        "beta2": check_number("beta2", beta2, below=1.0),
        "epsilon": check_number("epsilon", epsilon),
        "exclude_from_weight_decay": check_names(
            exclude_from_weight_decay, "exclude_from_weight_decay"
        ),
        "always_adapt": bool(always_adapt),
        "clip_norm": check_clip_norm(clip_norm),
    }
    # float32 betas, as Paddle's kernel has them, so `1 - beta2` and `1 - beta2**t` round
    # alike (from python floats optax rounds only the latter: steps ~1e-5 relative apart).
    b1, b2 = np.float32(hyperparams["beta1"]), np.float32(hyperparams["beta2"])
    tx = optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=hyperparams["epsilon"]),
        scale_by_lamb_trust_ratio(lamb_weight_decay, exclude_from_weight_decay, always_adapt),
        optax.inject_hyperparams(optax.scale_by_learning_rate)(learning_rate=learning_rate),
    )
    return paddle_optimizer(regularized(tx, 0.0, hyperparams["clip_norm"]), "Lamb", hyperparams)
