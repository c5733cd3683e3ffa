"""Paddle's `paddle.nn` on JAX: the loss layers (`MSELoss`, `L1Loss`, `CrossEntropyLoss`,
`NLLLoss`, `BCELoss`, `BCEWithLogitsLoss`) and their `functional` forms, on arrays or on the
deferred values of Paddle's dygraph loop (`Deferred`), and `Layer`, Paddle's `nn.Layer` as a
flax nnx Module whose subclasses write `forward`.

    loss_fn = nn.MSELoss()
    loss = loss_fn(dp_model(x), y)   # deferred: nothing has run
    loss.backward()                  # the gradient of the whole forward, under the strategy
    optimizer.step()                 # one compiled step: forward, backward, update
    optimizer.clear_grad()
"""

from fleetjax.nn import functional
from fleetjax.nn._layer import Layer, Parameters, bind_runner, named_sublayers, runner_of
from fleetjax.nn._losses import (
    FUNCTION_FORM,
    BCELoss,
    BCEWithLogitsLoss,
    CrossEntropyLoss,
    Deferred,
    DeferredError,
    L1Loss,
    LossLayer,
    MSELoss,
    NLLLoss,
)

__all__ = [
    "FUNCTION_FORM",
    "BCELoss",
    "BCEWithLogitsLoss",
    "CrossEntropyLoss",
    "Deferred",
    "DeferredError",
    "L1Loss",
    "Layer",
    "LossLayer",
    "MSELoss",
    "NLLLoss",
    "Parameters",
    "bind_runner",
    "functional",
    "named_sublayers",
    "runner_of",
]
