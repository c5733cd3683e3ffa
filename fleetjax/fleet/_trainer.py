"""`Trainer`: Paddle's dygraph training loop as a small stateful object over the train step.

Paddle trains with `loss = model(x); loss.backward(); opt.step(); opt.clear_grad()`. In JAX the
forward pass, the backward pass, the communication and the update are one compiled call, the
`TrainStep` of `make_train_step`; a `Trainer` holds its `TrainState` and the model:

    trainer = fleet.Trainer(loss_fn, model, fleet.distributed_optimizer(optimizers.adam(1e-3)))
    for batch in batches:
        loss = trainer.minimize(batch)

Every strategy applies exactly as with the functional step, which it calls once per
`minimize` (or per `backward` + `step`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from fleetjax.distributed_optimizer import DistributedOptimizer
from fleetjax.fleet._dygraph import DistributedModel
from fleetjax.layers import is_table, partition_specs
from fleetjax.optimizers import get_lr, param_names, set_lr
from fleetjax.step import TrainStep, make_train_step
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.train_state import TrainState

__all__ = ["Trainer", "fitted", "learning_rate"]

# Paddle's loop is one backward(), step() and clear_grad() per batch; what to say otherwise.
_HELD = (
    "the gradients of an earlier backward() are still held and not applied: to drop them, "
    "call clear_grad() first (Paddle would add the new gradients to them); to apply them, "
    "step(). To accumulate the gradients of several batches, keep one backward() and one "
    "step() per batch and let the strategy merge them; the optimizer then updates the "
    "parameters on every k_steps-th step():\n\n"
    "    strategy.gradient_merge = True\n"
    "    strategy.gradient_merge_configs = {'k_steps': 4, 'avg': True}\n"
    "    fleet.init(is_collective=True, strategy=strategy)"
)
_APPLIED = (
    "the gradients of the last backward() are still held: call clear_grad() first (Paddle "
    "would add the new gradients to them; step() applied them already). Each batch is "
    "backward, step(), clear_grad()"
)


class Trainer:
    """A model, its optimizer state and a compiled train step, trained in place.

    `minimize(batch)` runs one step of `make_train_step(loss_fn, optimizer, ...)` on `batch`
    and updates the state (and an nnx model's parameters) in place. `backward(batch)`,
    `step()` and `clear_grad()` are Paddle's `loss.backward()`, `opt.step()` and
    `opt.clear_grad()`: `backward` holds the batch, `step` computes its gradients and applies
    them in one compiled call, `clear_grad` drops gradients not applied yet.

    Attributes:
      loss_fn: the loss, `loss_fn(model, batch[, rng])` for an nnx Module, else
        `loss_fn(params, batch[, rng])`.
      train_step: the `TrainStep` it calls.
      state: the `TrainState` (its `params` are the nnx Module's `nnx.Param`s as a pure dict).
      metrics: the metrics of the last step (None before the first).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        model: Any,
        optimizer: DistributedOptimizer | optax.GradientTransformation,
        *,
        strategy: DistributedStrategy | Strategy | None = None,
        mesh: Mesh | None = None,
        has_aux: bool = False,
        has_rng: bool = False,
        param_specs: Any = None,
        seed: int | jax.Array = 0,
        state: TrainState | None = None,
    ) -> None:
        """Build the train step for `loss_fn` and the initial state (or take `state`).

        Args:
          loss_fn: for an nnx Module, `loss_fn(model, batch[, rng])`, called on the model
            with the trained parameters; else `loss_fn(params, batch[, rng])`, as
            `make_train_step` takes it.
          model: a flax nnx Module (its `nnx.Param`s are trained; its other variables, such
            as BatchNorm statistics, are the step's `model_state`, carried from one step to
            the next; a `DistributedModel` trains its module), or a pytree of parameters
            (`PipelineParams` under a pipeline).
          optimizer: one from `fleet.distributed_optimizer`, or any optax transformation.
          strategy, mesh: as `make_train_step` takes them (default: the optimizer's).
          has_aux, has_rng, param_specs: as `make_train_step` takes them; an nnx Module's
            `param_specs` default to its parameters' logical axis names.
          seed: the seed of the step key (`has_rng`).
          state: a `TrainState` to continue from instead of a fresh one (from another
            Trainer or a checkpoint); the model's parameters are then not used.
        """
        self.loss_fn = loss_fn
        model = model.module if isinstance(model, DistributedModel) else model
        self._module = model if isinstance(model, nnx.Module) else None
        step_loss, params, model_state, state_specs = loss_fn, model, None, None
        if self._module is not None:
            graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
            params = _with_tables(param_state, nnx.to_pure_dict(param_state))
            at = mesh if mesh is not None else getattr(optimizer, "mesh", None)
            if param_specs is None:
                param_specs = nnx.to_pure_dict(partition_specs(param_state, mesh=at))
            # The other variables (BatchNorm statistics, nnx.Rngs counters) are the model
            # state that each step carries to the next.
            if jax.tree.leaves(rest):
                model_state = nnx.to_pure_dict(rest)
                state_specs = nnx.to_pure_dict(partition_specs(rest, mesh=at))
            step_loss = _module_loss(loss_fn, graphdef, has_aux, model_state is not None)
        self.train_step: TrainStep = make_train_step(
            step_loss,
            optimizer,
            strategy,
            mesh,
            has_aux=has_aux,
            has_rng=has_rng,
            param_specs=param_specs,
            has_state=model_state is not None,
            state_specs=state_specs,
        )
        self.metrics: dict[str, Any] | None = None
        self._batch: Any = None  # held by backward() for step()
        self._applied = False  # step() applied the held gradients; clear_grad() not called yet
        self.state = state if state is not None else self.train_step.init(params, seed, model_state)

    @property
    def state(self) -> TrainState:
        """The `TrainState`; setting it (a checkpoint's, say) sets the nnx Module's variables."""
        return self._state

    @state.setter
    def state(self, state: TrainState) -> None:
        self._state = state
        if self._module is not None:
            nnx.update(self._module, self._first_replica(state))
            if state.model_state is not None:
                nnx.update(self._module, state.model_state)

    @property
    def params(self) -> Any:
        """The trained parameters (`state.params`; stacked per replica under LocalSGD)."""
        return self.state.params

    @property
    def model(self) -> Any:
        """The nnx Module with the trained parameters, or the parameters pytree; under LocalSGD,
        replica 0's."""
        return self._module if self._module is not None else self._first_replica(self.state)

    # -- Paddle's dygraph optimizer calls --------------------------------------------------------

    def minimize(self, batch: Any) -> jax.Array:
        """One training step on `batch` (forward, backward, communication and update in one
        compiled call); returns the loss. `metrics` holds all the step's metrics.

        Raises:
          RuntimeError: if `backward` or `step` left gradients that `clear_grad` did not drop.
        """
        self._check_no_gradients()
        return self._run(batch)

    def backward(self, batch: Any) -> None:
        """Paddle's `loss.backward()`: the gradients of the loss on `batch` are what the next
        `step()` applies (it computes them, with the update, in one compiled call).

        Raises:
          RuntimeError: if gradients are held already (Paddle would add them up); the message
            shows how gradient merge accumulates several batches' instead.
        """
        self._check_no_gradients()
        self._batch = batch

    def step(self) -> jax.Array:
        """Paddle's `opt.step()`: compute the gradients `backward` asked for and apply them;
        returns the loss.

        Raises:
          RuntimeError: without a `backward` since the last `clear_grad`, or if `step` already
            applied its gradients (Paddle would apply them again).
        """
        if self._batch is None:
            raise RuntimeError(
                "step() already applied the gradients of the last backward(); call "
                "clear_grad() and backward(batch) for new ones"
                if self._applied
                else "step() has no gradients to apply: call backward(batch) first"
            )
        loss = self._run(self._batch)
        self._batch, self._applied = None, True
        return loss

    @property
    def has_gradients(self) -> bool:
        """Whether a `backward` since the last `clear_grad` left gradients (applied or not)."""
        return self._batch is not None or self._applied

    def clear_grad(self) -> None:
        """Paddle's `opt.clear_grad()`: drop the gradients of the last `backward`."""
        self._batch, self._applied = None, False

    # -- optimizer state and learning rate --------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state as a plain nested dict of arrays (copies), keyed by the state's
        field names, sequence positions and parameter names, e.g.
        `sd["0"]["inner_state"]["0"]["mu"]["dense"]["kernel"]`."""
        return _nested(jax.tree.map(lambda x: x.copy(), self.state.opt_state))

    def set_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load an optimizer state from `state_dict` (as `state_dict` returns it, with jax or
        numpy arrays), placed as this trainer's step places it: a state saved on another mesh
        or under another strategy loads if it has the same entries and shapes. Values are cast
        to the state's dtypes.

        Raises:
          TypeError: if `state_dict` is not a mapping.
          ValueError: naming each entry that is missing, extra or of another shape.
        """
        opt_state = _from_nested(state_dict, self.state.opt_state)
        self.state = self.state._replace(opt_state=opt_state)

    def get_lr(self) -> float:
        """The learning rate of the next step (Paddle's `get_lr`).

        Raises:
          ValueError: if the optimizer keeps no learning rate in its state (build it with
            `fleetjax.optimizers.sgd/momentum/adam/adamw`).
        """
        return learning_rate(self.state.opt_state)

    def set_lr(self, value: float) -> None:
        """Use the learning rate `value` from the next step on (Paddle's `set_lr`).

        Raises:
          ValueError: if the optimizer keeps no learning rate in its state, or it follows a
            schedule.
          TypeError: if `value` is not a number.
        """
        old = self.state.opt_state
        new = set_lr(old, value)
        # Per-replica optimizer states keep one copy of the learning rate per replica.
        new = jax.tree.map(lambda n, o: jax.numpy.broadcast_to(n, o.shape), new, old)
        placed = jax.device_put(new, jax.tree.map(lambda x: x.sharding, old))
        self.state = self.state._replace(opt_state=placed)

    # -- internals --------------------------------------------------------------------------------

    def reload_model(self) -> None:
        """Train on from the nnx Module's variables as they are now, changed in place since the
        last step (`nnx.update`, `DistributedModel.set_state_dict`); the optimizer state stays.
        Under LocalSGD every replica takes them.

        Raises:
          TypeError: if the trainer trains a pytree of parameters (set `state` instead).
        """
        if self._module is None:
            raise TypeError("reload_model() reads an nnx Module; this trainer trains a pytree")
        params = _from_module(self._module, nnx.Param, self.state.params)
        model_state = self.state.model_state
        if model_state is not None:
            model_state = _from_module(self._module, nnx.Not(nnx.Param), model_state)
        self.state = self.state._replace(params=params, model_state=model_state)

    def _check_no_gradients(self) -> None:
        if self._batch is not None:
            raise RuntimeError(_HELD)
        if self._applied:
            raise RuntimeError(_APPLIED)

    def _run(self, batch: Any) -> jax.Array:
        self.state, self.metrics = self.train_step(self.state, batch)
        return self.metrics["loss"]

    def _first_replica(self, state: TrainState) -> Any:
        """`state`'s parameters, replica 0's where they are stacked per replica (the
        placement of `state` itself: a Trainer that goes on from another's state made none)."""
        if self.train_step.spec(state).placement.stacked.params:
            return jax.tree.map(lambda x: x[0], state.params)
        return state.params


def _from_module(module: nnx.Module, variables: Any, like: Any) -> Any:
    """`like` (a step's placed arrays, perhaps one per replica) with the values of `module`'s
    `variables` of the same paths, cast and placed like it."""
    values = {path: v[...] for path, v in nnx.to_flat_state(nnx.state(module, variables))}

    def placed(path: Any, x: jax.Array) -> jax.Array:
        keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        value = jax.numpy.broadcast_to(values[keys].astype(x.dtype), x.shape)
        return jax.device_put(value, x.sharding)

    return jax.tree_util.tree_map_with_path(placed, like)


def _with_tables(param_state: nnx.State, params: dict[str, Any]) -> dict[str, Any]:
    """`params` (a pure dict) with the model's sparse tables kept as `SparseTable`s: the step
    trains those by their touched rows (`fleetjax.layers.SparseEmbedding`)."""
    for path, variable in nnx.to_flat_state(param_state):
        if is_table(variable):
            functools.reduce(lambda d, key: d[key], path[:-1], params)[path[-1]] = variable
    return params


def _module_loss(
    loss_fn: Callable[..., Any], graphdef: nnx.GraphDef, has_aux: bool, stateful: bool
) -> Callable[..., Any]:
    """`loss_fn(model, batch, ...)` as a loss of the parameters (a pure dict) and, if
    `stateful`, of the module's other variables, whose new values it then returns as the
    step's model state."""

    def loss(params: dict[str, Any], rest: dict[str, Any], batch: Any, *extra: Any) -> Any:
        model = nnx.merge(graphdef, params, rest)
        out = loss_fn(model, batch, *extra)
        if not stateful:
            return out
        new_rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
        return (*out, new_rest) if has_aux else (out, new_rest)

    if stateful:
        return loss
    return lambda params, batch, *extra: loss(params, {}, batch, *extra)


def learning_rate(opt_state: Any) -> float:
    """The learning rate in `opt_state` as Paddle's `get_lr` returns it: a Python float, the
    shortest decimal that is the stored value (0.2, not the float32's 0.20000000298...)."""
    return float(str(np.ravel(jax.device_get(get_lr(opt_state)))[0]))


# -- optimizer state as a nested dict ------------------------------------------------------------


def _flat(tree: Any) -> dict[str, Any]:
    """{"a/b/c": leaf} for every leaf of `tree`, named by its path."""
    return dict(zip(jax.tree.leaves(param_names(tree)), jax.tree.leaves(tree), strict=True))


def _nested(tree: Any) -> dict[str, Any]:
    """`tree`'s leaves in plain nested dicts, keyed by their paths."""
    out: dict[str, Any] = {}
    for name, leaf in _flat(tree).items():
        *parents, last = name.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return out


def _from_nested(state_dict: Mapping[str, Any], like: Any) -> Any:
    """`like` (placed arrays) with the values of `state_dict`, checked and placed like it."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a nested dict of arrays, got {type(state_dict).__name__}"
        )
    header = (
        "state_dict does not fit this optimizer state (another optimizer, or another "
        "strategy's layout of it)"
    )
    values = fitted(_flat(state_dict), _flat(like), "the optimizer state", header)
    return jax.tree.unflatten(jax.tree.structure(like), list(values.values()))


def fitted(
    given: Mapping[str, Any], wanted: Mapping[str, jax.Array], what: str, header: str
) -> dict[str, jax.Array]:
    """The values of `given` (jax or numpy arrays) for the names of `wanted`, each cast and
    placed like `wanted`'s array, in `wanted`'s order.

    Raises:
      ValueError: `header`, then each name that is missing, extra or of another shape than
        `what` has.
    """
    problems = [f"{name!r} is missing" for name in wanted if name not in given]
    problems += [f"{name!r} is not in {what}" for name in given if name not in wanted]
    problems += [
        f"{name!r} has shape {np.shape(given[name])}, {what}'s is {x.shape}"
        for name, x in wanted.items()
        if name in given and np.shape(given[name]) != x.shape
    ]
    if problems:
        raise ValueError(f"{header}: " + "; ".join(problems))

    def placed(value: Any, x: jax.Array) -> jax.Array:
        value = value if isinstance(value, jax.Array) else np.asarray(value)
        # Cast where it is, before it moves (perhaps to pinned host memory).
        return jax.device_put(
            value if value.dtype == x.dtype else value.astype(x.dtype), x.sharding
        )

    return {name: placed(given[name], x) for name, x in wanted.items()}
