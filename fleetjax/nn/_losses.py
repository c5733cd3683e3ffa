"""Paddle's `paddle.nn` loss layers with Paddle's arguments and formulas: `MSELoss`, `L1Loss`,
`CrossEntropyLoss`, `NLLLoss`, `BCELoss`, `BCEWithLogitsLoss`.

On arrays a layer computes its loss as Paddle's does (a function of JAX arrays, for any loss
function). On the output of `fleet.distributed_model(model)(x)`, a `Deferred` value, it returns
a `DeferredLoss` instead: Paddle's dygraph loop, whose forward, backward and update fleetjax runs
as one compiled train step.

    loss_fn = nn.MSELoss()
    loss = loss_fn(dp_model(x), y)   # deferred: nothing has run
    loss.backward()                  # the gradient of the whole forward, under the strategy
    optimizer.step()                 # one compiled step: forward, backward, update
    optimizer.clear_grad()

A `Deferred` value refuses any other computation (`DeferredError`) rather than give a loss
without a gradient: for those, the loss is a function `loss_fn(model, batch)` that the train
step differentiates (`optimizer.minimize(loss_fn, batch)`).

Each layer checks its input and label as Paddle does, before anything runs: shapes (an error
naming both; a label that broadcasts against an input of another shape, which Paddle allows
in `MSELoss` and `L1Loss`, warns), integer class labels, labels within the classes or equal to
`ignore_index`. The values are checked where they are known (arrays, the dygraph loop's
label); inside a traced function a label out of range gives a NaN loss, never another class's.
"""

from __future__ import annotations

import warnings
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np

from fleetjax._warnings import user_stacklevel, warn_once

__all__ = [
    "BCELoss",
    "BCEWithLogitsLoss",
    "CrossEntropyLoss",
    "Deferred",
    "DeferredError",
    "L1Loss",
    "LossLayer",
    "MSELoss",
    "NLLLoss",
]

_REDUCTIONS = ("mean", "sum", "none")

FUNCTION_FORM = (
    "write the loss as a function of the model and the batch, "
    "`def loss_fn(model, batch): return ...` (any JAX of `model(batch['x'])`), and train with "
    "`optimizer.minimize(loss_fn, batch)`, or `optimizer.backward(loss_fn, batch)` then "
    "`optimizer.step()`"
)


class DeferredError(RuntimeError):
    """A computation on a `Deferred` value other than the ones it offers."""


class Deferred:
    """A value of Paddle's dygraph loop that a compiled train step computes later: a distributed
    model's output, or the loss a loss layer made of it.

    Its gradient exists only for the computations the step knows, so everything else (an
    arithmetic operator, a `jax.numpy` or `numpy` function, indexing, a custom loss) raises a
    `DeferredError` that names the function form to use instead.
    """

    __slots__ = ()

    def with_loss(self, layer: LossLayer, label: Any) -> Deferred:
        """The deferred loss `layer(self, label)`; only a model's output has one."""
        self._refuse(f"{type(layer).__name__}(...)")

    def _refuse(self, operation: str) -> NoReturn:
        raise DeferredError(
            f"{operation} on {self!r}: fleet.distributed_model's outputs are deferred (the "
            "forward, the backward and the update run as one compiled train step), so only "
            "fleetjax.nn's loss layers take them (MSELoss, L1Loss, CrossEntropyLoss, NLLLoss, "
            "BCELoss, BCEWithLogitsLoss); an output offers shape, dtype and numpy() (its "
            "values), a loss backward(), numpy(), item() and optimizer.minimize(loss). For "
            f"anything else, {FUNCTION_FORM}"
        )

    def __getattr__(self, name: str) -> NoReturn:
        if name.startswith("_"):  # protocol probes (numpy's __array_interface__, ...)
            raise AttributeError(name)
        self._refuse(f".{name}")

    def __array__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse("numpy.asarray")

    @property
    def __jax_array__(self) -> NoReturn:
        # A property: JAX looks the method up before it would call it (jit's abstractification
        # then raises its own error, which names no way out).
        self._refuse("a jax.numpy function")


def _refusing(name: str) -> Any:
    def refuse(self: Deferred, *args: Any) -> NoReturn:
        self._refuse(name)

    refuse.__name__ = name
    return refuse


# Arithmetic, comparisons, indexing, iteration and conversions: none has a gradient here.
_NO_GRADIENT = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__",
    "__matmul__", "__rmatmul__", "__neg__", "__pos__", "__abs__", "__lt__", "__le__", "__gt__",
    "__ge__", "__getitem__", "__iter__", "__len__", "__bool__", "__int__", "__index__",
    "__float__", "__complex__",
)  # fmt: skip
for _name in _NO_GRADIENT:
    setattr(Deferred, _name, _refusing(_name))
del _name


# -- the loss layers ---------------------------------------------------------------------------


class LossLayer:
    """A Paddle loss layer: `layer(input, label)` is its loss of arrays, or a deferred loss of a
    distributed model's output. Layers of one class and the same arguments are equal (a
    deferred loss compiles one train step per layer)."""

    def __init__(self, reduction: str, name: str | None) -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"The value of 'reduction' in {type(self).__name__} should be 'sum', 'mean' or "
                f"'none', but received {reduction!r}, which is not allowed."
            )
        if name is not None:
            warn_once(
                f"{type(self).__name__}(name=...) names Paddle's operator in its static "
                "program; JAX has none, so the name is not used"
            )
        self.reduction = reduction

    def __call__(self, input: Any, label: Any) -> Any:
        if isinstance(label, Deferred):
            label._refuse(f"{type(self).__name__}(input, label=...)")
        if isinstance(input, Deferred):
            known = (
                label if hasattr(label, "shape") and hasattr(label, "dtype") else np.asarray(label)
            )
            self.check(jax.ShapeDtypeStruct(input.shape, input.dtype), known)
            return input.with_loss(self, label)
        input, label = jnp.asarray(input), jnp.asarray(label)
        self.check(input, label)
        return self.forward(input, label)

    def check(self, input: Any, label: Any) -> None:
        """Raise (or warn) as Paddle's layer does for this `input` and `label`, before
        anything runs: their shapes, the label's dtype and, where known, its values."""
        _same_shape(self, input, label, broadcast=False)

    def forward(self, input: jax.Array, label: jax.Array) -> jax.Array:
        """The loss of arrays (Paddle's `forward`)."""
        raise NotImplementedError

    def _reduce(self, loss: jax.Array) -> jax.Array:
        if self.reduction == "mean":
            return jnp.mean(loss)
        return jnp.sum(loss) if self.reduction == "sum" else loss

    def _key(self) -> tuple:
        # Arrays (weights) by identity: their values are not hashable.
        return (type(self), *((k, _hashable(v)) for k, v in sorted(vars(self).items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LossLayer) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if v is not None)
        return f"{type(self).__name__}({fields})"

    def _named(self, input: Any, label: Any) -> str:
        return (
            f"{type(self).__name__}: input has shape {list(input.shape)} and label "
            f"{list(label.shape)}"
        )


def _hashable(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool, type(None))) else id(value)


class MSELoss(LossLayer):
    """Paddle's `nn.MSELoss(reduction='mean')`: `(input - label) ** 2`, reduced."""

    def __init__(self, reduction: str = "mean", name: str | None = None) -> None:
        super().__init__(reduction, name)

    def check(self, input: Any, label: Any) -> None:
        _same_shape(self, input, label, broadcast=True)

    def forward(self, input: jax.Array, label: jax.Array) -> jax.Array:
        return self._reduce(jnp.square(input - label))


class L1Loss(LossLayer):
    """Paddle's `nn.L1Loss(reduction='mean')`: `|input - label|`, reduced."""

    def __init__(self, reduction: str = "mean", name: str | None = None) -> None:
        super().__init__(reduction, name)

    def check(self, input: Any, label: Any) -> None:
        _same_shape(self, input, label, broadcast=True)

    def forward(self, input: jax.Array, label: jax.Array) -> jax.Array:
        return self._reduce(jnp.abs(input - label))


class BCELoss(LossLayer):
    """Paddle's `nn.BCELoss(weight=None, reduction='mean')`: binary cross entropy of
    probabilities, `-weight * (label * log(input) + (1 - label) * log(1 - input))`, each log
    clipped at -100 as Paddle's kernel does."""

    def __init__(
        self, weight: Any = None, reduction: str = "mean", name: str | None = None
    ) -> None:
        super().__init__(reduction, name)
        self.weight = weight

    def forward(self, input: jax.Array, label: jax.Array) -> jax.Array:
        log_p = jnp.maximum(jnp.log(input), -100.0)
        log_not_p = jnp.maximum(jnp.log1p(-input), -100.0)
        loss = -(label * log_p + (1 - label) * log_not_p)
        return self._reduce(loss if self.weight is None else loss * self.weight)


class BCEWithLogitsLoss(LossLayer):
    """Paddle's `nn.BCEWithLogitsLoss(weight=None, reduction='mean', pos_weight=None)`:
    `max(logit, 0) - logit * label + log(1 + exp(-|logit|)) * (1 + (pos_weight - 1) * label)`,
    times `weight`, reduced (Paddle's kernel: `pos_weight` scales the log term only)."""

    def __init__(
        self,
        weight: Any = None,
        reduction: str = "mean",
        pos_weight: Any = None,
        name: str | None = None,
    ) -> None:
        super().__init__(reduction, name)
        self.weight, self.pos_weight = weight, pos_weight

    def forward(self, input: jax.Array, label: jax.Array) -> jax.Array:
        log_term = jnp.log1p(jnp.exp(-jnp.abs(input)))
        if self.pos_weight is not None:
            log_term = log_term * ((jnp.asarray(self.pos_weight) - 1) * label + 1)
        loss = jnp.maximum(input, 0) - input * label + log_term
        return self._reduce(loss if self.weight is None else loss * self.weight)


class CrossEntropyLoss(LossLayer):
    """Paddle's `nn.CrossEntropyLoss(weight=None, ignore_index=-100, reduction='mean',
    soft_label=False, axis=-1, use_softmax=True, label_smoothing=0.0)`.

    Hard labels (`[..]` or `[.., 1]` integers) pick `-log_softmax(input)[label]` (`-log(input)`
    with `use_softmax=False`); rows labelled `ignore_index` give 0. With `weight` (one per class)
    each row is scaled by its class's weight, and 'mean' divides by the weights' sum. As in
    Paddle, 'mean' counts only the rows not ignored when `ignore_index >= 0`, and all rows
    otherwise. Soft labels (`soft_label=True`, or `label_smoothing > 0`, which smooths one-hot
    labels to `(1 - e) * onehot + e / classes`) give `-sum(label * log_softmax(input))`.
    'none' keeps the label's shape (`[.., 1]` for soft labels).
    """

    def __init__(
        self,
        weight: Any = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        soft_label: bool = False,
        axis: int = -1,
        use_softmax: bool = True,
        label_smoothing: float = 0.0,
        name: str | None = None,
    ) -> None:
        super().__init__(reduction, name)
        if ignore_index > 0 and soft_label:
            raise ValueError(
                "When soft_label == True, the value of 'ignore_index' in softmax_cross_entropy "
                f"should be '-100', but received {ignore_index}, which is not allowed."
            )
        self.weight, self.ignore_index, self.soft_label = weight, ignore_index, soft_label
        self.axis, self.use_softmax, self.label_smoothing = axis, use_softmax, label_smoothing

    def check(self, input: Any, label: Any) -> None:
        axis = self.axis % max(len(input.shape), 1)
        classes, others = input.shape[axis], _without(input.shape, axis)
        if self.soft_label:
            if tuple(label.shape) != tuple(input.shape):
                raise ValueError(
                    f"{self._named(input, label)}: with soft_label=True the label holds a "
                    f"probability per class, the input's shape"
                )
        else:
            hard = tuple(label.shape) == others or (
                len(label.shape) == len(input.shape)
                and label.shape[axis] == 1
                and _without(label.shape, axis) == others
            )
            if not hard:
                kept = [*input.shape[:axis], 1, *input.shape[axis + 1 :]]
                raise ValueError(
                    f"{self._named(input, label)}: a hard label holds one class index per row: "
                    f"shape {list(others)}, or {kept} (the classes on axis={self.axis})"
                )
            _class_indices(self, label, classes, self.ignore_index, IndexError)
        _class_weights(self, classes)

    def forward(self, input: jax.Array, label: jax.Array) -> jax.Array:
        logits = jnp.moveaxis(input, self.axis, -1)
        log_p = jax.nn.log_softmax(logits) if self.use_softmax else jnp.log(logits)
        keep_dim = label.ndim == input.ndim
        weights = count = None
        if keep_dim:  # [..., 1] for hard labels, [..., classes] for soft ones
            label = jnp.moveaxis(label, self.axis, -1)
        if self.soft_label or self.label_smoothing > 0:
            if not self.soft_label:
                hard = label[..., 0] if keep_dim else label
                onehot = jax.nn.one_hot(hard, logits.shape[-1], dtype=logits.dtype)
                classes = logits.shape[-1]
                label = onehot * (1 - self.label_smoothing) + self.label_smoothing / classes
            loss = -jnp.sum(label * log_p, axis=-1)
            if self.weight is not None:
                weights = label @ jnp.asarray(self.weight)
        else:
            hard = (label[..., 0] if keep_dim else label).astype(jnp.int32)
            valid = hard != self.ignore_index
            safe = jnp.where(valid, hard, 0)
            picked = jnp.take_along_axis(log_p, safe[..., None], axis=-1)[..., 0]
            loss = jnp.where(valid, -_within(picked, hard, logits.shape[-1], valid), 0.0)
            if self.weight is not None:
                weights = jnp.where(valid, jnp.asarray(self.weight)[safe], 0)
            count = valid.sum() if self.ignore_index >= 0 else None
        if weights is not None:
            loss = loss * weights
        if self.reduction == "none":
            soft = self.soft_label or self.label_smoothing > 0
            return jnp.expand_dims(loss, self.axis) if keep_dim or soft else loss
        return _weighted(loss, self.reduction, weights, count)


class NLLLoss(LossLayer):
    """Paddle's `nn.NLLLoss(weight=None, ignore_index=-100, reduction='mean')`: `input` holds
    log-probabilities with the classes on axis 1 (`[N, C]` or `[N, C, d1, ...]`), the loss of a
    row is `-weight[label] * input[label]`, 0 where the label is `ignore_index`, and 'mean'
    divides by the weights' sum over the rows not ignored."""

    def __init__(
        self,
        weight: Any = None,
        ignore_index: int = -100,
        reduction: str = "mean",
        name: str | None = None,
    ) -> None:
        super().__init__(reduction, name)
        self.weight, self.ignore_index = weight, ignore_index

    def check(self, input: Any, label: Any) -> None:
        if len(input.shape) < 2 or tuple(label.shape) != _without(input.shape, 1):
            raise ValueError(
                f"{self._named(input, label)}: NLLLoss takes log-probabilities [N, C] or [N, C, "
                "d1, ...] and one class index per row, [N] or [N, d1, ...]"
            )
        _class_indices(self, label, input.shape[1], self.ignore_index, ValueError)
        _class_weights(self, input.shape[1])

    def forward(self, input: jax.Array, label: jax.Array) -> jax.Array:
        log_p = jnp.moveaxis(input, 1, -1)
        label = label.astype(jnp.int32)
        valid = label != self.ignore_index
        safe = jnp.where(valid, label, 0)
        picked = jnp.take_along_axis(log_p, safe[..., None], axis=-1)[..., 0]
        picked = _within(picked, label, log_p.shape[-1], valid)
        weights = valid.astype(log_p.dtype)
        if self.weight is not None:
            weights = weights * jnp.asarray(self.weight)[safe]
        loss = -picked * weights
        if self.reduction == "none":
            return loss
        return _weighted(loss, self.reduction, weights, None)


def _without(shape: Any, axis: int) -> tuple[int, ...]:
    return (*shape[:axis], *shape[axis + 1 :])


def _same_shape(layer: LossLayer, input: Any, label: Any, broadcast: bool) -> None:
    """Raise `ValueError` unless `input` and `label` have one shape; with `broadcast` (Paddle's
    `MSELoss`, `L1Loss`), warn instead where they broadcast to a third one."""
    if tuple(input.shape) == tuple(label.shape):
        return
    try:
        both = np.broadcast_shapes(tuple(input.shape), tuple(label.shape))
    except ValueError:
        both = None
    if not broadcast or both is None:
        raise ValueError(
            f"{layer._named(input, label)}: they must have the same shape"
            + (" (or shapes that broadcast)" if broadcast else "")
        )
    warnings.warn(
        f"{layer._named(input, label)}, which broadcast to {list(both)}: each input meets "
        "every label it broadcasts against, likely not what was meant (Paddle computes it "
        "silently); give them the same shape",
        UserWarning,
        stacklevel=user_stacklevel(),
    )


def _class_indices(
    layer: LossLayer, label: Any, classes: int, ignore_index: int, error: type[Exception]
) -> None:
    """Raise unless `label` holds integers, each in [0, classes) or `ignore_index` (the
    values where they are known: not while traced). Paddle raises `error` for a value."""
    if not jnp.issubdtype(label.dtype, jnp.integer):
        soft = ", probabilities per class soft_label=True" if hasattr(layer, "soft_label") else ""
        raise TypeError(
            f"{type(layer).__name__}: label has dtype {label.dtype}; hard labels are class "
            f"indices, integers (cast them with .astype('int64'){soft})"
        )
    if isinstance(label, jax.core.Tracer) or (
        isinstance(label, jax.Array) and not label.is_fully_addressable
    ):
        return  # values unknown here, or on other processes too
    values = np.asarray(label)
    bad = (values != ignore_index) & ((values < 0) | (values >= classes))
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise error(
            f"{type(layer).__name__}: label[{', '.join(map(str, where))}] is {values[where]}, "
            f"not a class (0..{classes - 1}) nor ignore_index ({ignore_index})"
        )


def _class_weights(layer: LossLayer, classes: int) -> None:
    weight = getattr(layer, "weight", None)
    if weight is not None and np.shape(weight) != (classes,):
        raise ValueError(
            f"{type(layer).__name__}: weight has shape {list(np.shape(weight))}; it holds one "
            f"weight per class: [{classes}]"
        )


def _within(picked: jax.Array, label: jax.Array, classes: int, kept: jax.Array) -> jax.Array:
    """`picked` where the label is a class, NaN where it is none and not ignored: a traced
    label out of range poisons the loss rather than train another class."""
    inside = (label >= 0) & (label < classes)
    return jnp.where(inside | ~kept, picked, jnp.nan)


def _weighted(
    loss: jax.Array, reduction: str, weights: jax.Array | None, count: jax.Array | None
) -> jax.Array:
    """'sum', or 'mean' over `weights`' sum, else `count` rows, else all rows (0/0 is 0)."""
    total = jnp.sum(loss)
    if reduction == "sum":
        return total
    denominator = jnp.sum(weights) if weights is not None else count
    if denominator is None:
        return jnp.mean(loss)
    return total / (denominator + (denominator == 0))
