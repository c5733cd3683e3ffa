"""Paddle's dygraph loop on the fleet, run by the fleet's compiled train step:

    dp_model = fleet.distributed_model(model)        # a DistributedModel
    loss = nn.MSELoss()(dp_model(x), y)              # a DeferredLoss: nothing has run
    loss.backward()                                  # fleet.backward(loss.loss_fn, loss.batch)
    optimizer.step()                                 # the Trainer's one compiled step
    optimizer.clear_grad()

A deferred loss is the pair Paddle's tape would record, made explicit: `loss_fn(model, batch)`
(the loss layer of the model's call) and `batch` (the call's arrays and the label). The step
that trains it is the one `make_train_step` builds for that function, and its value is the
step's loss; read before the step, it is the forward alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from fleetjax.nn import FUNCTION_FORM, Deferred, LossLayer

__all__ = ["DeferredLoss", "DistributedModel", "Dygraph", "ModelOutput"]


class Dygraph:
    """The dygraph loop of one distributed model on one fleet: which deferred loss `backward`
    holds, which one the last step applied and its value, and the forward alone for values read
    before a step.

    Attributes:
      fleet: the `Fleet` whose Trainer trains the model.
      module: the flax nnx Module (the fleet's model).
      steps: how many steps the fleet took since the model was distributed.
    """

    def __init__(self, fleet: Any, module: nnx.Module) -> None:
        self.fleet, self.module, self.steps = fleet, module, 0
        self._closed = False
        self._pending: DeferredLoss | None = None  # backward() called, step() not yet
        self._applied: tuple[DeferredLoss, jax.Array] | None = None  # the last step's loss
        self._forwards: dict[Callable[..., Any], Callable[..., Any]] = {}

    def close(self) -> None:
        """The fleet distributed another model or was initialised again: refuse new work."""
        self._closed = True

    def stepped(self, value: jax.Array) -> None:
        """The fleet took a step whose loss is `value` (it applied the pending loss, if any)."""
        if self._pending is not None:
            self._applied, self._pending = (self._pending, value), None
        self.steps += 1

    def backward(self, loss: DeferredLoss) -> None:
        """Paddle's `loss.backward()`: the fleet's next `step()` applies this loss's gradients."""
        self._check(loss)
        if loss.layer.reduction == "none":
            raise ValueError(
                f"loss.backward() needs one number, but {loss.layer!r} gives one per element: "
                "use reduction='mean' or 'sum'"
            )
        self.fleet.backward(loss.loss_fn, loss.batch)
        self._pending = loss

    def minimize(self, loss: DeferredLoss) -> jax.Array:
        """Paddle's `optimizer.minimize(loss)`: apply the gradients of `backward()`, or compute
        and apply them when there was none (Paddle's static-graph minimize); returns the loss."""
        self._check(loss)
        if loss is self._pending:
            return self.fleet.step()
        value = self.fleet.minimize(loss.loss_fn, loss.batch)
        self._applied = (loss, value)
        return value

    def value(self, loss: DeferredLoss) -> jax.Array:
        """The loss the step computed for `loss`, or before its step the forward alone."""
        if self._applied is not None and self._applied[0] is loss:
            return self._applied[1]
        return self._forward(loss.loss_fn, loss.batch, loss.output)

    def outputs(self, output: ModelOutput) -> jax.Array:
        """The model's outputs, computed alone (no step)."""
        return self._forward(_call_model, output.batch, output)

    def abstract(self, output: ModelOutput) -> jax.ShapeDtypeStruct:
        """The outputs' shape and dtype (nothing runs)."""
        graphdef, state = nnx.split(self.module)
        fn = lambda state, batch: _call_model(nnx.merge(graphdef, state), batch)  # noqa: E731
        return jax.eval_shape(fn, state, output.batch)

    def _forward(self, fn: Callable[..., Any], batch: Any, made: ModelOutput) -> jax.Array:
        """`fn(model, batch)` on a copy of the model (its variables unchanged: batch-norm
        statistics and random-number counters are the step's to update)."""
        if made.steps != self.steps:
            raise RuntimeError(
                f"{made!r} was made before the last {self.steps - made.steps} step(s): its "
                "value at that point is gone (the step changed the parameters). Read a loss "
                "with numpy() or item() before optimizer.step(), or after the step that "
                "applied it"
            )
        graphdef, state = nnx.split(self.module)
        if fn not in self._forwards:
            self._forwards[fn] = jax.jit(lambda state, b: fn(nnx.merge(graphdef, state), b))
        with jax.set_mesh(self.fleet.mesh):
            return self._forwards[fn](state, batch)

    def _check(self, loss: DeferredLoss) -> None:
        if self._closed:
            raise RuntimeError(
                f"{loss!r} is of a model that a later fleet.init() or fleet.distributed_model() "
                "replaced; call the model that fleet.distributed_model() returned last"
            )


class DistributedModel:
    """What `fleet.distributed_model` returns for a flax nnx Module (Paddle's `DataParallel`):
    calling it gives a deferred `ModelOutput` for Paddle's loss layers; every other attribute
    is the module's (`dp_model.eval()`, `dp_model.linear.kernel`).

    Attributes:
      module: the flax nnx Module, placed on the fleet's mesh (the same object the fleet's
        Trainer trains and updates in place).
    """

    def __init__(self, module: nnx.Module, dygraph: Dygraph) -> None:
        self.module, self._dygraph = module, dygraph

    def __call__(self, *args: Any, **kwargs: Any) -> ModelOutput:
        """The deferred output of `module(*args, **kwargs)` (arrays: the batch the step splits
        over the devices)."""
        return ModelOutput(self._dygraph, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name in ("module", "_dygraph"):  # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"DistributedModel({type(self.module).__name__})"


def _call_model(model: nnx.Module, batch: dict[str, Any]) -> Any:
    return model(*batch["inputs"], **batch["keywords"])


def _checked_arrays(value: Any, what: str) -> Any:
    for path, leaf in jax.tree_util.tree_leaves_with_path(value):
        if not isinstance(leaf, (np.ndarray, np.generic, jax.Array)):
            raise TypeError(
                f"{what}{jax.tree_util.keystr(path)} is a {type(leaf).__name__}: a distributed "
                "model's call and its loss take arrays (the batch the step splits over the "
                "devices); settings that are not data belong in the model"
            )
    return value


class ModelOutput(Deferred):
    """A distributed model's output: the call's arrays, and the model's forward not run yet.

    Paddle's loss layers (`fleetjax.nn`) make a `DeferredLoss` of it; `shape` and `dtype` are
    known without running anything, and `numpy()` runs the forward alone. Anything else raises
    a `fleetjax.nn.DeferredError`.

    Attributes:
      runner: the `Dygraph` that computes it.
      batch: `{"inputs": args, "keywords": kwargs}` of the call.
      steps: the runner's step count when it was made.
    """

    def __init__(self, runner: Dygraph, args: tuple, kwargs: dict[str, Any]) -> None:
        self.runner, self.steps = runner, runner.steps
        self.batch = {
            "inputs": _checked_arrays(tuple(args), "the model's argument "),
            "keywords": _checked_arrays(dict(kwargs), "the model's keyword "),
        }

    def with_loss(self, layer: LossLayer, label: Any) -> DeferredLoss:
        """`layer(self, label)`, deferred."""
        return DeferredLoss(self, layer, _checked_arrays(label, "the loss's label"))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.runner.abstract(self).shape

    @property
    def dtype(self) -> np.dtype:
        return self.runner.abstract(self).dtype

    def numpy(self) -> np.ndarray:
        """The outputs' values: the model's forward alone (the step runs it again)."""
        return np.asarray(self.runner.outputs(self))

    def __repr__(self) -> str:
        return f"ModelOutput({self.runner.module.__class__.__name__}(...))"


@dataclasses.dataclass(frozen=True)
class LayerLoss:
    """`layer(model(*batch["inputs"], **batch["keywords"]), batch["label"])`: a deferred loss
    as the function of the model and the batch that the train step differentiates."""

    layer: LossLayer

    def __call__(self, model: nnx.Module, batch: dict[str, Any]) -> jax.Array:
        return self.layer(_call_model(model, batch), batch["label"])


class DeferredLoss(Deferred):
    """Paddle's loss tensor in the dygraph loop: `layer(output, label)` of a `ModelOutput`.

    `backward()` is Paddle's: the fleet's next `optimizer.step()` (or `optimizer.minimize(loss)`)
    computes the gradient of the whole forward under the strategy and applies it, in the one
    compiled step that `make_train_step(loss_fn, optimizer)` builds. `numpy()` and `item()`
    read its value: the step's loss once the step ran, before it the forward alone (which
    runs the model once more). Any other computation raises a `fleetjax.nn.DeferredError`.

    Attributes:
      output: the model's deferred output.
      layer: the loss layer.
      loss_fn: the loss as `loss_fn(model, batch)` (a `LayerLoss`; equal layers, equal ones).
      batch: the arrays it is computed on: `{"inputs", "keywords", "label"}`.
    """

    def __init__(self, output: ModelOutput, layer: LossLayer, label: Any) -> None:
        self.output, self.layer, self.loss_fn = output, layer, LayerLoss(layer)
        self.batch = {**output.batch, "label": label}
        self.runner, self.steps = output.runner, output.steps

    def backward(self) -> None:
        """Paddle's `loss.backward()`: the next `optimizer.step()` applies this loss's
        gradients (it computes them with the update, in one compiled step).

        Raises:
          RuntimeError: if gradients of an earlier `backward()` are still held (call
            `optimizer.clear_grad()`), or the model was replaced.
          ValueError: for a loss of `reduction='none'`.
        """
        self.runner.backward(self)

    def numpy(self) -> np.ndarray:
        """The loss's value (Paddle's `loss.numpy()`)."""
        return np.asarray(self.runner.value(self))

    def item(self) -> float:
        """The loss's value as a Python float (Paddle's `loss.item()`)."""
        return float(self.numpy())

    def __float__(self) -> float:
        return self.item()

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def __repr__(self) -> str:
        return f"DeferredLoss({self.layer!r} of {self.output!r})"


def not_a_loss(value: Any, call: str) -> TypeError:
    """The error for a `call` given a computed value (an array, a number) as its loss."""
    return TypeError(
        f"{call} got a {type(value).__name__}: a loss computed already has no gradient in JAX. "
        "Pass the deferred loss of a fleetjax.nn loss layer on fleet.distributed_model's "
        f"output (`loss = nn.MSELoss()(dp_model(x), y)`), or {FUNCTION_FORM}"
    )
