"""The gradient function every gradient transform takes and returns.

    grad_fn(params, model_state, batch, *rest) -> (Outputs(loss, aux, model_state), grads)

`rest` is empty or the step's PRNG key. Transforms wrap a `GradFn` into another
(`gradient_merge.microbatched`, `grad_allreduce.data_parallel`); `value_and_grad` makes the
first one from a loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax


class Outputs(NamedTuple):
    """What a gradient function returns beside the gradients."""

    loss: jax.Array  # the (unscaled) loss
    aux: dict[str, Any]  # metrics the loss reports
    model_state: Any  # the model state after this batch (None without one)


GradFn = Callable[..., tuple[Outputs, Any]]


def value_and_grad(loss: Callable[..., tuple[jax.Array, Outputs]]) -> GradFn:
    """The `GradFn` of `loss(params, model_state, batch, *rest) -> (value, Outputs)`: the
    gradients of `value` (the loss to differentiate, e.g. scaled) with respect to `params`."""
    differentiate = jax.value_and_grad(loss, has_aux=True)

    def grad_fn(params: Any, model_state: Any, batch: Any, *rest: Any) -> tuple[Outputs, Any]:
        (_, outputs), grads = differentiate(params, model_state, batch, *rest)
        return outputs, grads

    return grad_fn
