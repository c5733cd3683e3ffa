"""Paddle's SGD, Momentum, Adam and AdamW as optax transformations that remember their arguments.

Each is an ordinary `optax.GradientTransformationExtraArgs`, thin over optax, with the learning
rate injected into the state (`optax.inject_hyperparams`) so `get_lr` / `set_lr` reach it. It
also remembers its Paddle class and arguments, so a strategy can rebuild it as Paddle does
(LARS from a Momentum, LAMB from an Adam, DGC from a Momentum).

Paddle's `weight_decay=<float>` on SGD, Momentum and Adam is L2 regularization (`L2Decay`): the
gradient gets `+ weight_decay * param` before the update; on AdamW it is decoupled decay.
`clip_norm` is Paddle's `grad_clip=ClipGradByNorm(clip_norm)`: each gradient tensor is scaled
down to at most that L2 norm, before the regularization is added.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

LearningRate = float | Callable[[jax.Array], jax.Array]


class PaddleOptimizer(optax.GradientTransformationExtraArgs):
    """An optax transformation made by one of this package's constructors.

    Attributes:
      kind: Paddle's optimizer class: "SGD", "Momentum", "Adam", "AdamW", "LarsMomentum",
        "Lamb" or "DGCMomentum".
      hyperparams: the constructor's arguments by name (the learning rate as given: a number
        or an optax schedule).
      parameter_list: the classes' `parameters=` (Paddle's `_parameter_list`), or None: the
        parameters of a `fleetjax.nn.Layer` bind it to the optimizer for
        `fleetjax.distributed.shard_optimizer`.
    """

    kind: str
    hyperparams: Mapping[str, Any]
    parameter_list: Any

    def __new__(
        cls,
        init: Any,
        update: Any,
        kind: str = "",
        hyperparams: Mapping[str, Any] | None = None,
    ) -> PaddleOptimizer:
        self = super().__new__(cls, init, update)
        self.kind = kind
        self.hyperparams = types.MappingProxyType(dict(hyperparams or {}))
        self.parameter_list = None
        return self

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hyperparams.items())
        return f"{self.kind}({args})"


def check_learning_rate(learning_rate: Any) -> LearningRate:
    """A positive number or an optax schedule; otherwise a clear error."""
    if callable(learning_rate):
        return learning_rate
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)):
        raise TypeError(
            f"learning_rate must be a number or an optax schedule, got {learning_rate!r}"
        )
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    return float(learning_rate)


def check_number(name: str, value: Any, *, low: float = 0.0, below: float = math.inf) -> float:
    """`value` as a float in `[low, below)`, or a clear error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not low <= value < below:
        allowed = f">= {low}" if below == math.inf else f"in [{low}, {below})"
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return float(value)


def check_clip_norm(clip_norm: float | None) -> float | None:
    """None, or a positive `clip_norm`; otherwise a clear error."""
    if clip_norm is None:
        return None
    value = check_number("clip_norm", clip_norm)
    if value == 0:
        raise ValueError("clip_norm must be > 0 (or None for no clipping), got 0")
    return value


def l2_norm(x: jax.Array) -> jax.Array:
    """`||x||_2` of a whole tensor, in at least float32."""
    return jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.promote_types(x.dtype, jnp.float32)))))


def clip_norm_per_tensor(tensor: jax.Array, max_norm: float | jax.Array) -> jax.Array:
    """Paddle's `clip_by_norm`: `tensor * max_norm / ||tensor||` where the norm exceeds it."""
    norm = l2_norm(tensor)
    scale = jnp.where(norm > max_norm, max_norm / jnp.where(norm > 0, norm, 1), 1)
    return (tensor * scale).astype(tensor.dtype)


def clip_by_norm(max_norm: float) -> optax.GradientTransformation:
    """Paddle's `ClipGradByNorm(max_norm)`: each gradient tensor clipped to that L2 norm."""
    return optax.stateless_with_tree_map(lambda g, _: clip_norm_per_tensor(g, max_norm))


def regularized(
    tx: optax.GradientTransformation, weight_decay: float, clip_norm: float | None
) -> optax.GradientTransformationExtraArgs:
    """`tx` after Paddle's gradient clipping and then L2 regularization (each only if set)."""
    pre = []
    if clip_norm is not None:
        pre.append(clip_by_norm(clip_norm))
    if weight_decay:
        pre.append(optax.add_decayed_weights(weight_decay))
    return optax.chain(*pre, tx)


def paddle_optimizer(
    tx: optax.GradientTransformation, kind: str, hyperparams: dict[str, Any]
) -> PaddleOptimizer:
    """`tx` as a `PaddleOptimizer` of `kind` made with `hyperparams`."""
    return PaddleOptimizer(tx.init, tx.update, kind, hyperparams)


def sgd(
    learning_rate: LearningRate = 0.001,
    *,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
) -> PaddleOptimizer:
    """Paddle's `paddle.optimizer.SGD`: `p -= lr * g`."""
    learning_rate = check_learning_rate(learning_rate)
    weight_decay = check_number("weight_decay", weight_decay)
    clip_norm = check_clip_norm(clip_norm)
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=learning_rate)
    return paddle_optimizer(
        regularized(tx, weight_decay, clip_norm),
        "SGD",
        {"learning_rate": learning_rate, "weight_decay": weight_decay, "clip_norm": clip_norm},
    )


def momentum(
    learning_rate: LearningRate = 0.001,
    momentum: float = 0.9,
    *,
    use_nesterov: bool = False,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
) -> PaddleOptimizer:
    """Paddle's `paddle.optimizer.Momentum`: `v = momentum * v + g; p -= lr * v`
    (Nesterov: `p -= lr * (g + momentum * v)`)."""
    learning_rate = check_learning_rate(learning_rate)
    mu = check_number("momentum", momentum)
    weight_decay = check_number("weight_decay", weight_decay)
    clip_norm = check_clip_norm(clip_norm)
    tx = optax.inject_hyperparams(optax.sgd)(
        learning_rate=learning_rate, momentum=mu, nesterov=bool(use_nesterov)
    )
    return paddle_optimizer(
        regularized(tx, weight_decay, clip_norm),
        "Momentum",
        {
            "learning_rate": learning_rate,
            "momentum": mu,
            "use_nesterov": bool(use_nesterov),
            "weight_decay": weight_decay,
            "clip_norm": clip_norm,
        },
    )


def _adam_args(beta1: float, beta2: float, epsilon: float) -> tuple[float, float, float]:
    return (
        check_number("beta1", beta1, below=1.0),
        check_number("beta2", beta2, below=1.0),
        check_number("epsilon", epsilon),
    )


def adam(
    learning_rate: LearningRate = 0.001,
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-8,
    *,
    weight_decay: float = 0.0,
    clip_norm: float | None = None,
) -> PaddleOptimizer:
    """Paddle's `paddle.optimizer.Adam` (`weight_decay` is L2 regularization)."""
    learning_rate = check_learning_rate(learning_rate)
    beta1, beta2, epsilon = _adam_args(beta1, beta2, epsilon)
    weight_decay = check_number("weight_decay", weight_decay)
    clip_norm = check_clip_norm(clip_norm)
    tx = optax.inject_hyperparams(optax.adam)(
        learning_rate=learning_rate, b1=beta1, b2=beta2, eps=epsilon
    )
    return paddle_optimizer(
        regularized(tx, weight_decay, clip_norm),
        "Adam",
        {
            "learning_rate": learning_rate,
            "beta1": beta1,
            "beta2": beta2,
            "epsilon": epsilon,
            "weight_decay": weight_decay,
            "clip_norm": clip_norm,
        },
    )


def adamw(
    learning_rate: LearningRate = 0.001,
    beta1: float = 0.9,
    beta2: float = 0.999,
    epsilon: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    clip_norm: float | None = None,
) -> PaddleOptimizer:
    """Paddle's `paddle.optimizer.AdamW`: Adam with decoupled decay `p -= lr * weight_decay * p`."""
    learning_rate = check_learning_rate(learning_rate)
    beta1, beta2, epsilon = _adam_args(beta1, beta2, epsilon)
    weight_decay = check_number("weight_decay", weight_decay)
    clip_norm = check_clip_norm(clip_norm)
    tx = optax.inject_hyperparams(optax.adamw)(
        learning_rate=learning_rate, b1=beta1, b2=beta2, eps=epsilon, weight_decay=weight_decay
    )
    return paddle_optimizer(
        regularized(tx, 0.0, clip_norm),
        "AdamW",
        {
            "learning_rate": learning_rate,
            "beta1": beta1,
            "beta2": beta2,
            "epsilon": epsilon,
            "weight_decay": weight_decay,
            "clip_norm": clip_norm,
        },
    )
