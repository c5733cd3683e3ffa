"""Paddle's `to_static` and `DistModel`: a layer, its loss, its optimizer and a `Strategy` as
one compiled step per call.

    dm = dist.to_static(model, loader, nn.MSELoss(), opt, strategy=strategy)
    dm.train()
    for x, y in loader():
        loss = dm(x, y)              # one optimizer step
    dm.eval(); loss = dm(x, y)       # the loss alone
    dm.predict(); out = dm(x)        # the outputs

A `DistModel` trains through the same loop as Paddle's dygraph calls (`SemiAutoLoop`, the
fleet's `DygraphLoop`), with the strategy's sections applied: both give the same compiled step,
so the same losses, step for step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from fleetjax._warnings import warn_once
from fleetjax.distributed._loop import Request, SemiAutoLoop
from fleetjax.distributed._names import ParamNames, load_paddle_state, paddle_names
from fleetjax.distributed._shard import ShardDataloader, ShardOptimizer
from fleetjax.fleet import Trainer
from fleetjax.nn import LossLayer
from fleetjax.strategy import Strategy

__all__ = ["DistModel", "to_static"]

_MODES = ("train", "eval", "predict")


class FunctionLoss(LossLayer):
    """A loss function `loss(output, label)` as a loss layer (equal for the same function)."""

    def __init__(self, fn: Callable[[Any, Any], Any]) -> None:
        super().__init__("mean", None)
        self.fn = fn

    def forward(self, input: Any, label: Any) -> Any:
        return self.fn(input, label)


class DistModel:
    """Paddle's `paddle.distributed.DistModel` (made by `to_static`): `train()`, `eval()`,
    `predict()` set the mode; called, it runs one step (train: forward, backward and update,
    returning the loss; eval: the loss; predict: the outputs). In train and eval modes the
    last argument is the label and the others the model's inputs, as Paddle splits a loader's
    batch; in predict mode all are inputs.

    The default mode is Paddle's: train with a loss and an optimizer, eval with a loss alone,
    predict otherwise. `state_dict(mode)` and `set_state_dict` use Paddle's names.
    """

    def __init__(
        self,
        layer: nnx.Module,
        loader: Iterable[Any] | None,
        loss: Any = None,
        optimizer: Any = None,
        strategy: Strategy | None = None,
        metrics: Any = None,
        input_spec: Any = None,
    ) -> None:
        if not isinstance(layer, nnx.Module):
            raise TypeError(f"to_static takes a flax nnx Module, got {type(layer).__name__}")
        if strategy is not None and not isinstance(strategy, Strategy):
            raise TypeError(
                f"to_static's strategy must be a dist.Strategy (fleetjax.Strategy), got "
                f"{type(strategy).__name__}"
            )
        if metrics is not None:
            raise NotImplementedError(
                "DistModel's metrics: compute them from dm.predict()'s outputs (fleetjax's "
                "steps return the loss)"
            )
        self._layer = layer
        self._loss = loss if loss is None or isinstance(loss, LossLayer) else FunctionLoss(loss)
        self._has_optimizer = optimizer is not None
        self._loop = SemiAutoLoop(layer, _request(optimizer, strategy))
        self._mode: str | None = None
        if optimizer is not None and loss is not None:
            self.train()
        elif loss is not None:
            self.eval()
        else:
            self.predict()

    # -- modes -------------------------------------------------------------------------------------

    def train(self) -> None:
        """Paddle's `train()`: calls update the parameters and return the loss."""
        self._mode = "train"
        self._layer.train()

    def eval(self) -> None:
        """Paddle's `eval()`: calls return the loss."""
        self._mode = "eval"
        self._layer.eval()

    def predict(self) -> None:
        """Paddle's `predict()`: calls return the model's outputs."""
        self._mode = "predict"
        self._layer.eval()

    def __call__(self, *args: Any) -> Any:
        """One step in the current mode (see the class).

        Raises:
          ValueError: Paddle's messages for a mode without what it needs (train: a loss and an
            optimizer; eval: a loss) or a batch without a label.
          TypeError: for an argument that is not an array or a list of them.
        """
        if self._mode == "train" and (not self._has_optimizer or self._loss is None):
            raise ValueError("Please set optimizer and loss function before training.")
        if self._mode == "eval" and self._loss is None:
            raise ValueError("Please set loss function before evaluation.")
        feeds = _flattened(args)
        if self._mode == "predict":
            return self._loop.outputs(self._loop.call(self._layer, tuple(feeds), {}))
        if len(feeds) < 2:
            raise ValueError(
                f"DistModel in {self._mode} mode takes the model's inputs and the label (the "
                f"last argument), got {len(feeds)} argument(s)"
            )
        output = self._loop.call(self._layer, tuple(feeds[:-1]), {})
        loss = output.with_loss(self._loss, feeds[-1])
        if self._mode == "train":
            return self._loop.minimize(loss)
        return self._loop.value(loss)

    @property
    def trainer(self) -> Trainer | None:
        """The fleet's `Trainer` of the train mode (None before its first step): its
        `train_step` is the compiled step (`fleetjax.explain(dm.trainer.train_step, batch)`)."""
        return self._loop.trainer

    # -- state -------------------------------------------------------------------------------------

    def state_dict(self, mode: str = "all", split_fusion: bool = True) -> dict[str, jax.Array]:
        """Paddle's `state_dict(mode)`: "param", the layer's parameters by their dotted paths
        ("fc1.kernel"); "opt", the optimizer state by Paddle's names (`fc1.kernel_moment1_0`,
        `learning_rate_0`, ...; empty before the first step); "all", both. The arrays read
        as the user placed them (`placements`, `process_mesh`)."""
        if mode not in ("all", "opt", "param"):
            raise ValueError(f"state_dict's mode must be 'all', 'opt' or 'param', got {mode!r}")
        out: dict[str, jax.Array] = {}
        if mode in ("all", "param"):
            out |= {
                ".".join(map(str, p)): v[...]
                for p, v in nnx.to_flat_state(nnx.state(self._layer, nnx.Param))
            }
        trainer = self._loop.trainer
        if mode in ("all", "opt") and trainer is not None:
            out |= paddle_names(trainer.state.opt_state, self._param_names())
        return out

    def set_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Paddle's `set_state_dict`: load a `state_dict()` (any mesh's; numpy too): the
        parameters into the layer, the optimizer's entries into its state (before the first
        step, when the step makes it).

        Raises:
          ValueError: naming each entry that is missing, extra or of another shape.
        """
        params = {k: v for k, v in state_dict.items() if k in self.state_dict("param")}
        rest = {k: v for k, v in state_dict.items() if k not in params}
        if params:
            self._loop.load_model({**self.state_dict("param"), **params})
        if not rest:
            return
        trainer = self._loop.trainer
        if trainer is None:
            self._loop.pending_paddle_state = rest
            return
        load_paddle_state(trainer, rest, self._param_names())

    def _param_names(self) -> ParamNames:
        return self._loop.param_names()


def _flattened(args: tuple) -> list[Any]:
    """Paddle's feeds: list and tuple arguments flattened."""
    feeds: list[Any] = []
    for item in args:
        if isinstance(item, list | tuple):
            feeds += list(item)
        elif isinstance(item, jax.Array | np.ndarray | Mapping):
            feeds.append(item)
        else:
            raise TypeError(
                f"The inputs of DistModel should be list or tensor, but got {type(item)}"
            )
    return feeds


def _request(optimizer: Any, strategy: Strategy | None) -> Request:
    """The request of `to_static`'s optimizer (a `shard_optimizer`'s, or a plain one) and
    strategy."""
    if isinstance(optimizer, ShardOptimizer):
        stage = optimizer.request.stage
        sharding = strategy.sharding if strategy is not None else None
        if stage and sharding is not None and sharding.enable and sharding.stage != stage:
            warn_once(
                f"to_static's Strategy.sharding.stage={strategy.sharding.stage} replaces "
                f"the optimizer's ShardingStage{stage}: the strategy given last applies"
            )
        return dataclasses.replace(optimizer.request, strategy=strategy)
    if optimizer is not None and not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"to_static's optimizer must be an optimizer (fleetjax.optimizers, optax) or "
            f"dist.shard_optimizer's, got {type(optimizer).__name__}"
        )
    return Request(optimizer, strategy=strategy)


def to_static(
    layer: nnx.Module,
    loader: Iterable[Any] | ShardDataloader | None = None,
    loss: Any = None,
    optimizer: Any = None,
    strategy: Strategy | None = None,
    input_spec: Any = None,
) -> DistModel:
    """Paddle's `paddle.distributed.to_static`: the layer (parameters placed with
    `shard_tensor`, `shard_layer` or `parallelize`), its loss (a `fleetjax.nn` loss layer or
    any `loss(output, label)`), its optimizer (`shard_optimizer`'s or a plain one) and a
    `Strategy` (sharding, gradient merge, AMP, pipeline) as a `DistModel`. JAX compiles every
    step, so there is no static program to convert to: the `DistModel` trains through the
    same loop as the dygraph calls, and gives the same losses. `input_spec` is not needed (the
    first batch gives the shapes) and warns.
    """
    if input_spec is not None:
        warn_once("to_static's input_spec is not used: the first batch gives the step its shapes")
    return DistModel(layer, loader, loss, optimizer, strategy)
