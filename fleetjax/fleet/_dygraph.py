"""Paddle's dygraph loop on the fleet, run by the fleet's compiled train step:

    dp_model = fleet.distributed_model(model)        # a DistributedModel
    loss = nn.MSELoss()(dp_model(x), y)              # a DeferredLoss: nothing has run
    loss.backward()                                  # the fleet's loop holds it
    optimizer.step()                                 # the Trainer's one compiled step
    optimizer.clear_grad()

A deferred loss is the pair Paddle's tape would record, made explicit: `loss_fn(model, batch)`
(the loss layer of the model's call) and `batch` (the call's arrays and the label). The step
that trains it is the one `make_train_step` builds for that function, and its value is the
step's loss; read before the step, it is the forward alone. The loop that trains it is
`fleetjax.fleet.DygraphLoop` (the deferred values' `runner`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

import jax
import numpy as np
from flax import nnx
from flax.nnx import graph

from fleetjax.nn import FUNCTION_FORM, Deferred, LossLayer

__all__ = [
    "DeferredLoss",
    "DistributedModel",
    "ModelOutput",
    "call_model",
    "not_a_loss",
    "saved_variables",
    "user_name",
]


class Runner(Protocol):
    """What trains a distributed model and computes its deferred values (the fleet's
    `DygraphLoop`)."""

    model: Any
    steps: int

    def backward(self, loss: DeferredLoss) -> None: ...
    def value(self, loss: DeferredLoss) -> jax.Array: ...
    def outputs(self, output: ModelOutput) -> jax.Array: ...
    def abstract(self, output: ModelOutput) -> jax.ShapeDtypeStruct: ...
    def load_model(self, state_dict: Mapping[str, Any]) -> None: ...


class DistributedModel:
    """What `fleet.distributed_model` returns for a flax nnx Module (Paddle's `DataParallel`):
    calling it gives a deferred `ModelOutput` for Paddle's loss layers; every other attribute
    is the module's (`dp_model.eval()`, `dp_model.linear.kernel`).

    flax nnx's functions see the module: `nnx.state(dp_model)`, `nnx.split(dp_model, nnx.Param,
    ...)` and `nnx.update(dp_model, state)` read and write its variables, and `nnx.merge` of
    its split makes a copy of the module.

    Attributes:
      module: the flax nnx Module, placed on the fleet's mesh (the same object the fleet's
        Trainer trains and updates in place).
    """

    def __init__(self, module: nnx.Module, runner: Runner) -> None:
        self.module, self._runner = module, runner

    def __call__(self, *args: Any, **kwargs: Any) -> ModelOutput:
        """The deferred output of `module(*args, **kwargs)` (arrays: the batch the step splits
        over the devices)."""
        return ModelOutput(self._runner, args, kwargs)

    def parameters(self) -> list[nnx.Param]:
        """Paddle's `parameters()`: the module's `nnx.Param` variables (its trained ones, kept
        up to date by each step), in the order of `nnx.state`."""
        return [v for _, v in nnx.to_flat_state(nnx.state(self.module, nnx.Param))]

    def state_dict(self) -> dict[str, jax.Array]:
        """Paddle's `state_dict()`: the module's parameters and statistics (its variables but
        random-number state), by their dotted paths, e.g. `"l1.kernel"`."""
        return {name: v[...] for name, v in saved_variables(self.module).items()}

    def set_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Paddle's `set_state_dict(state_dict)`: load the module's parameters and statistics
        from a `state_dict()` (jax or numpy arrays; any mesh's), placed and cast as they are;
        training goes on from them.

        Raises:
          TypeError: if `state_dict` is not a mapping.
          ValueError: naming each entry that is missing, extra or of another shape (Paddle
            skips those with a warning).
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict of arrays, got {type(state_dict).__name__}")
        self._runner.load_model(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name in ("module", "_runner"):  # not set yet (copy, pickle)
            raise AttributeError(name)
        return getattr(self.module, name)

    def __repr__(self) -> str:
        return f"DistributedModel({type(self.module).__name__})"


def saved_variables(module: nnx.Module) -> dict[str, nnx.Variable]:
    """`module`'s variables but random-number state (what Paddle's `state_dict` has), by their
    dotted paths."""
    state = nnx.state(module, nnx.Not(nnx.RngState))
    return {".".join(map(str, path)): v for path, v in nnx.to_flat_state(state)}


def _module(node: Any) -> Any:
    """The module of a graph node of a `DistributedModel` (`nnx.merge` makes plain modules)."""
    return node.module if isinstance(node, DistributedModel) else node


def _impl(node: Any) -> Any:
    return graph.get_node_impl(_module(node))


def _flatten(model: DistributedModel) -> tuple[Any, tuple[type, Any]]:
    nodes, metadata = _impl(model).flatten(model.module)
    return nodes, (type(model.module), metadata)


# flax nnx's functions walk a DistributedModel as its module, and merging makes a module.
graph.register_graph_node_type(
    DistributedModel,
    flatten=_flatten,
    set_key=lambda node, key, value: _impl(node).set_key(_module(node), key, value),
    pop_key=lambda node, key: _impl(node).pop_key(_module(node), key),
    create_empty=lambda metadata: graph.get_node_impl_for_type(metadata[0]).create_empty(
        metadata[1]
    ),
    clear=lambda node: _impl(node).clear(_module(node)),
    init=lambda node, items: _impl(node).init(_module(node), items),
)


def call_model(model: nnx.Module, batch: dict[str, Any]) -> Any:
    return model(*batch["inputs"], **batch["keywords"])


def user_name(path: tuple[Any, ...]) -> str:
    """How the user wrote the leaf at `path` of a deferred batch: `dp_model(x)`'s `x` is
    `batch['inputs'][0]`, "the distributed model's argument 0"."""
    part = path[0].key
    if part == "label":
        return "the loss's label" + jax.tree_util.keystr(tuple(path[1:]))
    key, *rest = path[1:]
    what = f"argument {key.idx}" if part == "inputs" else f"keyword argument {key.key}"
    return f"the distributed model's {what}" + jax.tree_util.keystr(tuple(rest))


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
      runner: the `DygraphLoop` that computes it.
      batch: `{"inputs": args, "keywords": kwargs}` of the call.
      steps: the runner's step count when it was made.
    """

    def __init__(self, runner: Runner, args: tuple, kwargs: dict[str, Any]) -> None:
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
        return f"ModelOutput({self.runner.model.__class__.__name__}(...))"


@dataclasses.dataclass(frozen=True)
class LayerLoss:
    """`layer(model(*batch["inputs"], **batch["keywords"]), batch["label"])`: a deferred loss
    as the function of the model and the batch that the train step differentiates."""

    layer: LossLayer

    def __call__(self, model: nnx.Module, batch: dict[str, Any]) -> jax.Array:
        return self.layer(call_model(model, batch), batch["label"])


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
            `optimizer.step()`, then `optimizer.clear_grad()`; the message shows how gradient
            merge accumulates several batches), or the model was replaced.
          ValueError: for a loss of `reduction='none'`, or a batch whose rows do not split
            over the data-parallel devices.
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
