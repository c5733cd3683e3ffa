"""Paddle's optimizer classes with Paddle's arguments: `paddle.optimizer.SGD`, `Momentum`, `Adam`,
`AdamW`, the gradient clips of `paddle.nn` and `paddle.regularizer.L2Decay`.

    opt = Adam(learning_rate=1e-3, parameters=..., weight_decay=L2Decay(1e-4),
               grad_clip=ClipGradByGlobalNorm(1.0))

Each class is its function of this package (`SGD(...)` builds `sgd(...)`, `Adam(...)` builds
`adam(...)`, ...) and is a `PaddleOptimizer`, so it goes wherever an optax transformation goes
and a strategy rebuilds it as it rebuilds those (LARS from a Momentum, ...). `grad_clip`
applies to the gradients before the L2 decay, as in Paddle. `parameters=` has no effect: an
optax transformation updates the parameters the train step gives it (a warning says so once).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import optax

from fleetjax._warnings import warn_once
from fleetjax.nn import Parameters
from fleetjax.optimizers import _basic
from fleetjax.optimizers._basic import LearningRate, PaddleOptimizer, check_number, clip_by_norm

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "ClipGradByGlobalNorm",
    "ClipGradByNorm",
    "ClipGradByValue",
    "L2Decay",
    "Momentum",
]


@dataclasses.dataclass(frozen=True)
class ClipGradByNorm:
    """Paddle's `paddle.nn.ClipGradByNorm(clip_norm)`: each gradient tensor scaled down to at
    most `clip_norm` in L2 norm."""

    clip_norm: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_norm", _positive("clip_norm", self.clip_norm))

    def transformation(self) -> optax.GradientTransformation:
        """The clip as an optax transformation."""
        return clip_by_norm(self.clip_norm)


@dataclasses.dataclass(frozen=True)
class ClipGradByGlobalNorm:
    """Paddle's `paddle.nn.ClipGradByGlobalNorm(clip_norm)`: every gradient scaled by
    `clip_norm / max(global_norm, clip_norm)`, the global norm taken over all of them
    (`optax.clip_by_global_norm`; over whole arrays, however they are sharded).

    `group_name` and `auto_skip_clip` are accepted and change nothing: one optimizer clips one
    group, and a clip that is not needed multiplies by 1.
    """

    clip_norm: float
    group_name: str = "default_group"
    auto_skip_clip: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_norm", _positive("clip_norm", self.clip_norm))

    def transformation(self) -> optax.GradientTransformation:
        """The clip as an optax transformation."""
        return optax.clip_by_global_norm(self.clip_norm)


@dataclasses.dataclass(frozen=True)
class ClipGradByValue:
    """Paddle's `paddle.nn.ClipGradByValue(max, min=None)`: every gradient element clipped to
    `[min, max]`; `min` defaults to `-max`."""

    max: float
    min: float | None = None

    def __post_init__(self) -> None:
        high = check_number("ClipGradByValue max", self.max, low=-float("inf"))
        if self.min is None and not high > 0:
            raise ValueError(f"ClipGradByValue max must be > 0 when min is not given, got {high}")
        low = -high if self.min is None else check_number("min", self.min, low=-float("inf"))
        if not low < high:
            raise ValueError(f"ClipGradByValue needs min < max, got min={low}, max={high}")
        object.__setattr__(self, "max", high)
        object.__setattr__(self, "min", low)

    def transformation(self) -> optax.GradientTransformation:
        """The clip as an optax transformation."""
        low, high = self.min, self.max
        return optax.stateless_with_tree_map(lambda g, _: jnp.clip(g, low, high).astype(g.dtype))


GradClip = ClipGradByNorm | ClipGradByGlobalNorm | ClipGradByValue


@dataclasses.dataclass(frozen=True)
class L2Decay:
    """Paddle's `paddle.regularizer.L2Decay(coeff)`: `coeff * param` added to each gradient
    (after the clip), the same as `weight_decay=coeff`."""

    coeff: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "coeff", check_number("L2Decay coeff", self.coeff))


class SGD(PaddleOptimizer):
    """Paddle's `paddle.optimizer.SGD`: `sgd(learning_rate, weight_decay=..., ...)`."""

    def __new__(
        cls,
        learning_rate: LearningRate = 0.001,
        parameters: Any = None,
        weight_decay: float | L2Decay | None = None,
        grad_clip: GradClip | None = None,
        multi_precision: bool = False,
        name: str | None = None,
    ) -> SGD:
        _no_effect(parameters, multi_precision=multi_precision)
        decay = _l2_coeff(weight_decay)

        def build(clip: float | None) -> PaddleOptimizer:
            return _basic.sgd(learning_rate, weight_decay=decay, clip_norm=clip)

        return _made(cls, build, grad_clip, parameters)


class Momentum(PaddleOptimizer):
    """Paddle's `paddle.optimizer.Momentum`: `momentum(learning_rate, momentum, ...)`.

    Raises:
      NotImplementedError: for `rescale_grad` other than 1.0 (scale the loss instead).
    """

    def __new__(
        cls,
        learning_rate: LearningRate = 0.001,
        momentum: float = 0.9,
        parameters: Any = None,
        use_nesterov: bool = False,
        weight_decay: float | L2Decay | None = None,
        grad_clip: GradClip | None = None,
        multi_precision: bool = False,
        rescale_grad: float = 1.0,
        use_multi_tensor: bool = False,
        name: str | None = None,
    ) -> Momentum:
        _no_effect(parameters, multi_precision=multi_precision, use_multi_tensor=use_multi_tensor)
        _not_implemented(rescale_grad=(rescale_grad, 1.0, "scale the loss instead"))
        decay = _l2_coeff(weight_decay)

        def build(clip: float | None) -> PaddleOptimizer:
            return _basic.momentum(
                learning_rate,
                momentum,
                use_nesterov=use_nesterov,
                weight_decay=decay,
                clip_norm=clip,
            )

        return _made(cls, build, grad_clip, parameters)


class Adam(PaddleOptimizer):
    """Paddle's `paddle.optimizer.Adam`: `adam(learning_rate, beta1, beta2, epsilon, ...)`
    (`weight_decay` is L2 regularization).

    Raises:
      NotImplementedError: for `amsgrad=True` (use `optax.amsgrad`).
    """

    def __new__(
        cls,
        learning_rate: LearningRate = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        parameters: Any = None,
        weight_decay: float | L2Decay | None = None,
        grad_clip: GradClip | None = None,
        lazy_mode: bool = False,
        multi_precision: bool = False,
        use_multi_tensor: bool = False,
        amsgrad: bool = False,
        name: str | None = None,
    ) -> Adam:
        _no_effect(
            parameters,
            lazy_mode=lazy_mode,
            multi_precision=multi_precision,
            use_multi_tensor=use_multi_tensor,
        )
        _not_implemented(amsgrad=(amsgrad, False, "use optax.amsgrad"))
        decay = _l2_coeff(weight_decay)

        def build(clip: float | None) -> PaddleOptimizer:
            return _basic.adam(
                learning_rate, beta1, beta2, epsilon, weight_decay=decay, clip_norm=clip
            )

        return _made(cls, build, grad_clip, parameters)


class AdamW(PaddleOptimizer):
    """Paddle's `paddle.optimizer.AdamW`: `adamw(learning_rate, beta1, beta2, epsilon,
    weight_decay)`, decoupled decay.

    Raises:
      TypeError: if `weight_decay` is not a number (Paddle's rule; `L2Decay` is for the other
        optimizers).
      NotImplementedError: for `lr_ratio`, `apply_decay_param_fun`, `use_lowprecision_moment`
        and `amsgrad` (build `optax.adamw(..., mask=...)` instead).
    """

    def __new__(
        cls,
        learning_rate: LearningRate = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        parameters: Any = None,
        weight_decay: float = 0.01,
        use_lowprecision_moment: bool = False,
        lr_ratio: Callable[..., float] | None = None,
        apply_decay_param_fun: Callable[[str], bool] | None = None,
        grad_clip: GradClip | None = None,
        lazy_mode: bool = False,
        multi_precision: bool = False,
        amsgrad: bool = False,
        name: str | None = None,
    ) -> AdamW:
        _no_effect(parameters, lazy_mode=lazy_mode, multi_precision=multi_precision)
        instead = "build optax.adamw(..., mask=...) or chain optax transformations instead"
        _not_implemented(
            use_lowprecision_moment=(use_lowprecision_moment, False, instead),
            lr_ratio=(lr_ratio, None, instead),
            apply_decay_param_fun=(apply_decay_param_fun, None, instead),
            amsgrad=(amsgrad, False, "use optax.amsgrad"),
        )
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
            raise TypeError(
                f"AdamW weight_decay must be a float (the decoupled decay coefficient), got "
                f"{weight_decay!r}"
            )

        def build(clip: float | None) -> PaddleOptimizer:
            return _basic.adamw(learning_rate, beta1, beta2, epsilon, weight_decay, clip_norm=clip)

        return _made(cls, build, grad_clip, parameters)


def _made(
    cls: type[PaddleOptimizer],
    build: Callable[[float | None], PaddleOptimizer],
    grad_clip: GradClip | None,
    parameters: Any,
) -> Any:
    """`build(clip_norm)` as an instance of `cls`, keeping `parameters` (Paddle's
    `_parameter_list`). A per-tensor clip is the function's own `clip_norm`; a global-norm or
    by-value clip goes first in a chain and is kept in the hyperparameters as `grad_clip`,
    where a strategy's rebuild finds it."""
    optimizer = _clipped(cls, build, grad_clip)
    optimizer.parameter_list = parameters
    return optimizer


def _clipped(
    cls: type[PaddleOptimizer],
    build: Callable[[float | None], PaddleOptimizer],
    grad_clip: GradClip | None,
) -> Any:
    if grad_clip is None or isinstance(grad_clip, ClipGradByNorm):
        made = build(None if grad_clip is None else grad_clip.clip_norm)
        return PaddleOptimizer.__new__(cls, made.init, made.update, made.kind, made.hyperparams)
    if not isinstance(grad_clip, (ClipGradByGlobalNorm, ClipGradByValue)):
        raise TypeError(
            "grad_clip must be a fleetjax.optimizers.ClipGradByNorm, ClipGradByGlobalNorm or "
            f"ClipGradByValue (Paddle's paddle.nn clips), got {type(grad_clip).__name__}"
        )
    made = build(None)
    tx = optax.chain(grad_clip.transformation(), made)
    hyperparams = {**made.hyperparams, "grad_clip": grad_clip}
    return PaddleOptimizer.__new__(cls, tx.init, tx.update, made.kind, hyperparams)


def _positive(name: str, value: Any) -> float:
    value = check_number(name, value)
    if value == 0:
        raise ValueError(f"{name} must be > 0, got 0")
    return value


def _l2_coeff(weight_decay: float | L2Decay | None) -> float:
    """Paddle's `weight_decay=` of SGD, Momentum and Adam (a float or an `L2Decay`) as the L2
    coefficient."""
    if weight_decay is None:
        return 0.0
    if isinstance(weight_decay, L2Decay):
        return weight_decay.coeff
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)):
        raise TypeError(
            "weight_decay must be a float or a fleetjax.optimizers.L2Decay, got "
            f"{type(weight_decay).__name__}"
        )
    return check_number("weight_decay", weight_decay)


_WHY = {
    "parameters": "an optax transformation updates the parameters the train step gives it (the "
    "model of fleet.distributed_model or Trainer, the params of make_train_step)",
    "multi_precision": "parameters keep their own dtype; float32 master weights under float16 "
    "are the strategy's amp O2",
    "use_multi_tensor": "XLA compiles the update of every parameter into one program",
    "lazy_mode": "JAX's gradients are dense arrays (there are no sparse SelectedRows)",
}


def _no_effect(parameters: Any, **flags: bool) -> None:
    """Warn once for each argument given that has no meaning on JAX."""
    if isinstance(parameters, Sequence) and any(isinstance(p, Mapping) for p in parameters):
        raise NotImplementedError(
            "parameter groups (dicts in parameters=) are not supported: give each group its "
            "own settings with optax.multi_transform"
        )
    # A Layer's parameters() bind the layer: Paddle's auto-parallel dygraph loop trains it.
    bound = isinstance(parameters, Parameters)
    given = {"parameters": parameters is not None and not bound, **flags}
    for name, is_set in given.items():
        if bool(is_set):
            warn_once(f"the optimizer's {name}= has no effect in fleetjax: {_WHY[name]}")


def _not_implemented(**arguments: tuple[Any, Any, str]) -> None:
    """Raise for an argument (value, default, what to do instead) set to another value."""
    for name, (value, default, instead) in arguments.items():
        if value != default:
            raise NotImplementedError(f"{name}={value!r} is not supported: {instead}")
