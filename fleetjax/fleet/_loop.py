"""The fleet's dygraph loop: Paddle's optimizer calls (`minimize`, `backward`, `step`,
`clear_grad`, `state_dict`, `set_state_dict`, `get_lr`, `set_lr`), each defined once here, on
`DygraphLoop`, and forwarded to it by one table, `DygraphCalls`, which the fleet (`fleet.step()`)
and the optimizer it returns (`opt.step()`) both take.

A loss comes as a deferred loss (`loss = nn.MSELoss()(dp_model(x), y)`: its function of the
model and its batch) or as a function with its batch (`opt.minimize(loss_fn, batch)`); either
way the loop hands the function and the batch to its `Trainer`, which it makes at the first
`minimize` or `backward`, from the model of `fleet.distributed_model` and the optimizer of
`fleet.distributed_optimizer`. Before then it holds what `set_lr` and `set_state_dict` gave,
and the Trainer starts from them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from fleetjax._batch import check_batch
from fleetjax.distributed_optimizer import DistributedOptimizer
from fleetjax.fleet._dygraph import (
    DeferredLoss,
    ModelOutput,
    call_model,
    not_a_loss,
    saved_variables,
    user_name,
)
from fleetjax.fleet._trainer import Trainer, fitted, learning_rate
from fleetjax.optimizers import set_lr

__all__ = ["CALLS", "DygraphCalls", "DygraphLoop"]

_NO_GRADIENTS = (
    "optimizer.step() has no gradients to apply: call loss.backward() first, on the loss of a "
    "fleetjax.nn loss layer (loss = nn.MSELoss()(dp_model(x), y); loss.backward(); "
    "optimizer.step(); optimizer.clear_grad()), or optimizer.backward(loss_fn, batch)"
)


class DygraphLoop:
    """The fleet's training of one model with one optimizer, in Paddle's dygraph calls.

    It makes its `Trainer` at the first `minimize` or `backward`, for that call's loss function
    (another function later makes another Trainer that goes on from the same state). Before
    it, as in Paddle (whose optimizer makes its state at the first step), `get_lr` is the
    optimizer's initial rate, `set_lr` and `set_state_dict` are checked and held for the
    Trainer, which starts from them, and `state_dict` is empty.

    Attributes:
      mesh: the mesh the model is placed on (its forward alone runs there).
      model: the model of `fleet.distributed_model` (None before it).
      param_specs: the `param_specs` given with it.
      optimizer: the optimizer of `fleet.distributed_optimizer` (None before it).
      steps: the steps taken since the model was distributed.
      batch_spec: the shapes of the last batch trained on (Paddle's `save_inference_model`
        names inputs from it).
    """

    def __init__(self, mesh: Mesh | None, model: Any = None, param_specs: Any = None) -> None:
        self.mesh, self.model, self.param_specs = mesh, model, param_specs
        self.optimizer: DistributedOptimizer | None = None
        self.steps = 0
        self.batch_spec: Any = None
        self._trainer: Trainer | None = None
        self._trained_loss: Callable[..., Any] | None = None  # the loss the Trainer trains
        self._pending_lr: float | None = None  # set_lr before the Trainer
        self._pending_state: Mapping[str, Any] | None = None  # set_state_dict before it
        self._held: DeferredLoss | None = None  # backward() called, step() not yet
        self._applied: tuple[DeferredLoss, jax.Array] | None = None  # the last step's loss
        self._forwards: dict[tuple[Callable[..., Any], Any], Callable[..., Any]] = {}
        self._closed = False

    # -- set-up, by the fleet ---------------------------------------------------------------------

    def use_optimizer(self, optimizer: DistributedOptimizer) -> None:
        """Train with `optimizer` from now on: a new Trainer, nothing held for it."""
        self.optimizer, self._trainer = optimizer, None
        self._pending_lr = self._pending_state = None

    def with_model(self, mesh: Mesh, model: Any, param_specs: Any) -> DygraphLoop:
        """The loop of a newly distributed `model`, with this one's optimizer and what it holds
        for a Trainer; this one refuses the losses of its model from now on."""
        loop = DygraphLoop(mesh, model, param_specs)
        loop.optimizer, loop._pending_lr = self.optimizer, self._pending_lr
        loop._pending_state = self._pending_state
        self.close()
        return loop

    def close(self) -> None:
        """The fleet distributed another model or was initialised again: refuse new work."""
        self._closed = True

    @property
    def trainer(self) -> Trainer | None:
        """The `Trainer` that `minimize` and `backward` made (and then use); None before."""
        return self._trainer

    # -- Paddle's calls ---------------------------------------------------------------------------

    def minimize(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> jax.Array:
        """One training step of the distributed model with the distributed optimizer; returns
        the loss. See `Trainer.minimize`.

        `loss` is a deferred loss (Paddle's `minimize(loss)`: it applies the gradients of
        `loss.backward()`, or computes them first if there was none, as Paddle's static-graph
        minimize does), or a function with its `batch`: `loss_fn(model, batch)` for an nnx
        Module, else `loss_fn(params, batch)`; pass the same function every call (another one
        compiles another step). For aux outputs or a PRNG key, make a `fleetjax.fleet.Trainer`.
        """
        if isinstance(loss, DeferredLoss) and batch is None:
            self._check(loss)
            if loss is self._held:
                return self.step()
            trainer = self._trainer_for(loss.loss_fn)
            value = self._stepped(trainer.minimize(self._placed(trainer, loss)), loss.batch)
            self._applied = (loss, value)
            return value
        loss_fn = _loss_function(loss, batch, "minimize")
        return self._stepped(self._trainer_for(loss_fn).minimize(batch), batch)

    def backward(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> None:
        """Paddle's `loss.backward()`: `step()` applies the gradients of the deferred `loss`, or
        of `loss_fn` on `batch`. See `Trainer.backward`.

        Raises:
          RuntimeError: if gradients of an earlier `backward()` are still held (call
            `optimizer.step()`, then `optimizer.clear_grad()`), or the model was replaced.
          ValueError: for a loss of `reduction='none'`, or a batch whose rows do not split over
            the data-parallel devices (named as the model's argument or the loss's label).
        """
        if isinstance(loss, DeferredLoss) and batch is None:
            self._check(loss)
            if loss.layer.reduction == "none":
                raise ValueError(
                    f"loss.backward() needs one number, but {loss.layer!r} gives one per "
                    "element: use reduction='mean' or 'sum'"
                )
            trainer = self._trainer_for(loss.loss_fn)
            trainer.backward(self._placed(trainer, loss))
            self._held, self.batch_spec = loss, _shapes(loss.batch)
            return
        loss_fn = _loss_function(loss, batch, "backward")
        self._trainer_for(loss_fn).backward(batch)
        self.batch_spec = _shapes(batch)

    def step(self) -> jax.Array:
        """Paddle's `opt.step()`: apply the gradients `backward` asked for; returns the loss.
        See `Trainer.step`."""
        if self._trainer is None or not self._trainer.has_gradients:
            raise RuntimeError(_NO_GRADIENTS)
        value = self._stepped(self._trainer.step())
        if self._held is not None:
            self._applied, self._held = (self._held, value), None
        return value

    def clear_grad(self) -> None:
        """Paddle's `opt.clear_grad()`: drop the gradients of the last `backward` (none before
        training). See `Trainer.clear_grad`."""
        if self._trainer is not None:
            self._trainer.clear_grad()
        self._held = None

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state as a nested dict of arrays; empty before the first `minimize` or
        `backward` (Paddle's optimizer makes its state at the first step). See
        `Trainer.state_dict`."""
        if self._trainer is None:
            self._checked_optimizer()
            return {}
        return self._trainer.state_dict()

    def set_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the optimizer state from `state_dict`; before the first `minimize` or `backward`
        it is loaded (and checked) when they make the Trainer, and an empty one loads nothing.
        See `Trainer.set_state_dict`."""
        if self._trainer is not None:
            self._trainer.set_state_dict(state_dict)
            return
        self._checked_optimizer()
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"state_dict must be a nested dict of arrays, got {type(state_dict).__name__}"
            )
        self._pending_state = dict(state_dict) or None

    def get_lr(self) -> float:
        """The learning rate of the next step: before the first one, the optimizer's initial
        rate (or the one `set_lr` gave). See `Trainer.get_lr`."""
        if self._trainer is not None:
            return self._trainer.get_lr()
        opt_state = self._checked_optimizer().init({})  # no parameters: only the rate
        if self._pending_lr is not None:
            opt_state = set_lr(opt_state, self._pending_lr)
        return learning_rate(opt_state)

    def set_lr(self, value: float) -> None:
        """Use the learning rate `value` from the next step on (before the first step, from the
        first). See `Trainer.set_lr`."""
        if self._trainer is not None:
            self._trainer.set_lr(value)
            return
        set_lr(self._checked_optimizer().init({}), value)  # Trainer.set_lr's checks, now
        self._pending_lr = value

    # -- the deferred values' reads ---------------------------------------------------------------

    def value(self, loss: DeferredLoss) -> jax.Array:
        """The loss the step computed for `loss`, or before its step the forward alone."""
        if self._applied is not None and self._applied[0] is loss:
            return self._applied[1]
        return self._forward(loss.loss_fn, loss.batch, loss.output)

    def outputs(self, output: ModelOutput) -> jax.Array:
        """The model's outputs, computed alone (no step)."""
        return self._forward(call_model, output.batch, output)

    def abstract(self, output: ModelOutput) -> jax.ShapeDtypeStruct:
        """The outputs' shape and dtype (nothing runs)."""
        self._checked(output.batch)
        graphdef, state = nnx.split(self.model)
        fn = lambda state, batch: call_model(nnx.merge(graphdef, state), batch)  # noqa: E731
        return jax.eval_shape(fn, state, output.batch)

    def load_model(self, state_dict: Mapping[str, Any]) -> None:
        """Load the model's variables from `state_dict` (`DistributedModel.set_state_dict`); the
        Trainer, if any, trains on from them."""
        variables = saved_variables(self.model)
        header = f"state_dict does not fit {type(self.model).__name__}"
        wanted = {name: v[...] for name, v in variables.items()}
        for name, value in fitted(state_dict, wanted, "the model", header).items():
            variables[name][...] = value
        if self._trainer is not None:
            self._trainer.reload_model()

    # -- internals --------------------------------------------------------------------------------

    def _trainer_for(self, loss_fn: Callable[..., Any]) -> Trainer:
        """The Trainer for `loss_fn`; another loss function gets a new one that goes on from the
        current state."""
        if self._trainer is not None and self._trained_loss == loss_fn:
            return self._trainer
        if self.model is None:
            raise RuntimeError("call fleet.distributed_model(model) before training with the fleet")
        if self.optimizer is None:
            raise RuntimeError(
                "call fleet.distributed_optimizer(optimizer) before training with the fleet"
            )
        trainer = self.make_trainer(loss_fn, None if self._trainer is None else self._trainer.state)
        if self._pending_state is not None:
            trainer.set_state_dict(self._pending_state)
        if self._pending_lr is not None:
            trainer.set_lr(self._pending_lr)
        self._trainer, self._pending_lr, self._pending_state = trainer, None, None
        self._trained_loss = loss_fn
        return trainer

    def make_trainer(self, loss_fn: Callable[..., Any], state: Any) -> Trainer:
        """The `Trainer` of `loss_fn(model, batch)` for the model and the optimizer, going on
        from `state` (a `TrainState`; None: a fresh one)."""
        return Trainer(
            loss_fn, self.model, self.optimizer, param_specs=self.param_specs, state=state
        )

    def _checked_optimizer(self) -> DistributedOptimizer:
        if self.optimizer is None:
            raise RuntimeError("call fleet.distributed_optimizer(optimizer) first")
        return self.optimizer

    def _stepped(self, value: jax.Array, batch: Any = None) -> jax.Array:
        """A step was taken (on `batch`, if given), whose loss is `value`."""
        if batch is not None:
            self.batch_spec = _shapes(batch)
        self.steps += 1
        return value

    def _placed(self, trainer: Trainer, loss: DeferredLoss) -> Any:
        """`loss`'s batch placed for the step."""
        return _in_user_terms(loss.batch, trainer.train_step.shard_batch)

    def _checked(self, batch: Any) -> None:
        """Check that `batch`'s rows split over the data-parallel devices before the model
        sees it (a layer's own check, e.g. BatchNorm's, would name the wrong thing)."""
        _in_user_terms(batch, lambda batch: check_batch(batch, self.mesh))

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
        self._checked(batch)
        graphdef, state = nnx.split(self.model)
        # By graph too: a module switched to eval() (dropout off) has another graph.
        if (fn, graphdef) not in self._forwards:
            self._forwards[fn, graphdef] = jax.jit(lambda s, b: fn(nnx.merge(graphdef, s), b))
        with jax.set_mesh(self.mesh):
            return self._forwards[fn, graphdef](state, batch)

    def _check(self, loss: DeferredLoss) -> None:
        if self._closed or loss.runner is not self:
            raise RuntimeError(
                f"{loss!r} is of a model that a later fleet.init() or fleet.distributed_model() "
                "replaced; call the model that fleet.distributed_model() returned last"
            )


def _loss_function(loss: Any, batch: Any, call: str) -> Callable[..., Any]:
    """`loss` if it is a loss function given with its batch, else the error that says why not."""
    if isinstance(loss, DeferredLoss):
        raise TypeError(
            f"{call}(loss) of a deferred loss takes no batch: its arrays are in the loss already"
        )
    if not callable(loss):
        raise not_a_loss(loss, f"{call}()")
    if batch is None:
        raise TypeError(
            f"{call}(loss_fn, batch) needs the batch: the step calls loss_fn(model, batch)"
        )
    return loss


def _shapes(batch: Any) -> Any:
    """The shapes of `batch`: Paddle's form of `save_inference_model` names inputs from it."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)


class DygraphCalls:
    """Paddle's dygraph optimizer calls, each forwarded to the `DygraphLoop` of
    `_dygraph_loop()`: `Fleet` and `FleetOptimizer` take them from here."""

    def _dygraph_loop(self) -> DygraphLoop:
        """The loop the calls act on (the fleet's)."""
        raise NotImplementedError

    def minimize(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> jax.Array:
        """Paddle's `minimize(loss)`, or `minimize(loss_fn, batch)`: one step; returns the loss
        (`DygraphLoop.minimize`)."""
        return self._dygraph_loop().minimize(loss, batch)

    def backward(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> None:
        """Paddle's `loss.backward()` as `backward(loss)`, or `backward(loss_fn, batch)`:
        `step()` applies its gradients (`DygraphLoop.backward`)."""
        self._dygraph_loop().backward(loss, batch)

    def step(self) -> jax.Array:
        """Paddle's `step()`: apply the gradients `backward` asked for; returns the loss
        (`DygraphLoop.step`)."""
        return self._dygraph_loop().step()

    def clear_grad(self) -> None:
        """Paddle's `clear_grad()`: drop the gradients of the last `backward`
        (`DygraphLoop.clear_grad`)."""
        self._dygraph_loop().clear_grad()

    def state_dict(self) -> dict[str, Any]:
        """Paddle's `state_dict()`: the optimizer state (`DygraphLoop.state_dict`)."""
        return self._dygraph_loop().state_dict()

    def set_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Paddle's `set_state_dict(state_dict)` (`DygraphLoop.set_state_dict`)."""
        self._dygraph_loop().set_state_dict(state_dict)

    def get_lr(self) -> float:
        """Paddle's `get_lr()` (`DygraphLoop.get_lr`)."""
        return self._dygraph_loop().get_lr()

    def set_lr(self, value: float) -> None:
        """Paddle's `set_lr(value)` (`DygraphLoop.set_lr`)."""
        self._dygraph_loop().set_lr(value)


# Paddle's dygraph optimizer calls, as the table names them.
CALLS = tuple(name for name in vars(DygraphCalls) if not name.startswith("_"))


def _in_user_terms(batch: Any, check: Callable[[Any], Any]) -> Any:
    """`check(batch)`, its error naming the model's arguments and the loss's label as the user
    wrote them (not as the leaves of the batch they are put in)."""
    try:
        return check(batch)
    except (TypeError, ValueError) as e:
        text = str(e)
        for path, _ in jax.tree_util.tree_leaves_with_path(batch):
            name = "batch" + jax.tree_util.keystr(path)
            if text.startswith(f"{name} "):
                text = user_name(path) + text[len(name) :]
        raise type(e)(text) from None
