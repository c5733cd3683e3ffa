"""Paddle's `paddle.nn.functional` losses and activations: each loss is its layer of
`fleetjax.nn` called once (`mse_loss(input, label)` is `MSELoss()(input, label)`), so on a
deferred output it gives the same deferred loss, and equal calls share one compiled step."""

from __future__ import annotations

from typing import Any

import jax

from fleetjax.nn._losses import (
    BCELoss,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    L1Loss,
    MSELoss,
    NLLLoss,
)

__all__ = [
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
    "cross_entropy",
    "gelu",
    "l1_loss",
    "mse_loss",
    "nll_loss",
    "relu",
    "silu",
    "softmax",
]

relu, gelu, silu, softmax = jax.nn.relu, jax.nn.gelu, jax.nn.silu, jax.nn.softmax


def mse_loss(input: Any, label: Any, reduction: str = "mean", name: str | None = None) -> Any:
    """Paddle's `F.mse_loss`: `MSELoss(reduction)(input, label)`."""
    return MSELoss(reduction, name)(input, label)


def l1_loss(input: Any, label: Any, reduction: str = "mean", name: str | None = None) -> Any:
    """Paddle's `F.l1_loss`: `L1Loss(reduction)(input, label)`."""
    return L1Loss(reduction, name)(input, label)


def cross_entropy(
    input: Any,
    label: Any,
    weight: Any = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    soft_label: bool = False,
    axis: int = -1,
    use_softmax: bool = True,
    label_smoothing: float = 0.0,
    name: str | None = None,
) -> Any:
    """Paddle's `F.cross_entropy`: `CrossEntropyLoss(...)(input, label)`."""
    layer = CrossEntropyLoss(
        weight, ignore_index, reduction, soft_label, axis, use_softmax, label_smoothing, name
    )
    return layer(input, label)


def nll_loss(
    input: Any,
    label: Any,
    weight: Any = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    name: str | None = None,
) -> Any:
    """Paddle's `F.nll_loss`: `NLLLoss(...)(input, label)`."""
    return NLLLoss(weight, ignore_index, reduction, name)(input, label)


def binary_cross_entropy(
    input: Any, label: Any, weight: Any = None, reduction: str = "mean", name: str | None = None
) -> Any:
    """Paddle's `F.binary_cross_entropy`: `BCELoss(...)(input, label)`."""
    return BCELoss(weight, reduction, name)(input, label)


def binary_cross_entropy_with_logits(
    logit: Any,
    label: Any,
    weight: Any = None,
    reduction: str = "mean",
    pos_weight: Any = None,
    name: str | None = None,
) -> Any:
    """Paddle's `F.binary_cross_entropy_with_logits`: `BCEWithLogitsLoss(...)(logit, label)`."""
    return BCEWithLogitsLoss(weight, reduction, pos_weight, name)(logit, label)
