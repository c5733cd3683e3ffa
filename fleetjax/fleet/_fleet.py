"""The `Fleet` facade: Paddle's Fleet API as a thin stateful shell over fleetjax's functions."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from fleetjax import _paddle_env, checkpoint, export, xla_flags
from fleetjax._applied import AppliedStrategy, applied_strategy
from fleetjax._warnings import warn_once
from fleetjax.distributed_model import distributed_model
from fleetjax.distributed_optimizer import DistributedOptimizer, distributed_optimizer
from fleetjax.fleet._dygraph import DeferredLoss, DistributedModel, Dygraph, not_a_loss
from fleetjax.fleet._join import default_role_maker, job_mesh, join_processes
from fleetjax.fleet._ps import non_distributed, runtime_call
from fleetjax.fleet._trainer import Trainer, learning_rate
from fleetjax.fleet.base.role_maker import PaddleCloudRoleMaker, Role, RoleMakerBase
from fleetjax.fleet.base.util_factory import UtilBase
from fleetjax.optimizers import set_lr
from fleetjax.plan import mesh_for, prepare
from fleetjax.strategy import DistributedStrategy, Strategy

logger = logging.getLogger("fleetjax")


_WHOLE_STATE = (
    "fleet.{}(mode={}): Paddle's modes choose among its parameter-server table formats; "
    "fleetjax's tables are arrays in the training state, which is saved and loaded whole"
)
_NO_EXECUTOR = (
    "{}= has no meaning in JAX: there is no executor or program; fleet.{} works on the fleet's "
    "Trainer (the model of distributed_model, trained by minimize / backward)"
)


@dataclasses.dataclass(frozen=True)
class FleetOptimizer(DistributedOptimizer):
    """What `fleet.distributed_optimizer` returns: a `DistributedOptimizer` (it goes to
    `make_train_step` or a `Trainer` as any other) with Paddle's dygraph optimizer calls,
    which act on the fleet's `Trainer` as `fleet.minimize`, `fleet.step`, ... do.

    Paddle's `loss = loss_layer(dp_model(x), y); loss.backward(); opt.step(); opt.clear_grad()`
    runs as written with a `fleetjax.nn` loss layer (the loss is deferred: see
    `fleet.distributed_model`), and so does `opt.minimize(loss)`; for any other loss,
    `opt.backward(loss_fn, batch)` and `opt.minimize(loss_fn, batch)` take it as a function of
    the model and the batch. An optimizer that a later `fleet.distributed_optimizer` call
    replaced refuses these calls.

    Attributes:
      fleet: the `Fleet` that made it.
    """

    fleet: Fleet = dataclasses.field(repr=False, compare=False)

    def _bound(self) -> Fleet:
        if self.fleet._optimizer is not self:
            raise RuntimeError(
                "this optimizer was replaced by a later fleet.distributed_optimizer() (or "
                "fleet.init()) call; use the optimizer that call returned"
            )
        return self.fleet

    def minimize(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> jax.Array:
        """Paddle's `opt.minimize(loss)` of a deferred loss, or `minimize(loss_fn, batch)`: one
        step; returns the loss (`fleet.minimize`)."""
        return self._bound().minimize(loss, batch)

    def backward(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> None:
        """Paddle's `loss.backward()` as `opt.backward(loss)` of a deferred loss, or
        `opt.backward(loss_fn, batch)`: `step()` applies its gradients (`fleet.backward`)."""
        self._bound().backward(loss, batch)

    def step(self) -> jax.Array:
        """Paddle's `opt.step()`: apply the gradients `backward` asked for; returns the loss."""
        return self._bound().step()

    def clear_grad(self) -> None:
        """Paddle's `opt.clear_grad()`: drop the gradients of the last `backward`."""
        self._bound().clear_grad()

    def state_dict(self) -> dict[str, Any]:
        """Paddle's `opt.state_dict()` (`fleet.state_dict`)."""
        return self._bound().state_dict()

    def set_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Paddle's `opt.set_state_dict(state_dict)` (`fleet.set_state_dict`)."""
        self._bound().set_state_dict(state_dict)

    def get_lr(self) -> float:
        """Paddle's `opt.get_lr()` (`fleet.get_lr`)."""
        return self._bound().get_lr()

    def set_lr(self, value: float) -> None:
        """Paddle's `opt.set_lr(value)` (`fleet.set_lr`)."""
        self._bound().set_lr(value)


class Fleet:
    """Paddle's `fleet` singleton: initialise once with `init`, then query roles, make
    distributed optimizers and synchronise workers.

    With several worker endpoints (`PADDLE_TRAINER_ENDPOINTS`, as `fleetrun`/`fleetjax-run`
    set), `init` joins all processes with `jax.distributed.initialize` into one global mesh.
    In parameter-server mode (`init(is_collective=False)`) the trainers join so, and a server
    joins nothing: its role queries answer as Paddle's and `init_server()`/`run_server()`
    return (fleetjax's tables live on the trainers; docs/parameter_server.md).

    Paddle 2.0's dygraph calls on the fleet (`minimize`, `step`, `clear_grad`, `state_dict`,
    `set_state_dict`, `get_lr`, `set_lr`), and the same calls on the optimizer that
    `distributed_optimizer` returns, act on the fleet's `Trainer`, which the first `minimize`
    or `backward` makes from the model given to `distributed_model` and that optimizer. Before
    it, as in Paddle (whose optimizer makes its state at the first step), `get_lr` is the
    initial rate, `set_lr` and `set_state_dict` take effect when the Trainer is made, and
    `state_dict` is empty.
    """

    def __init__(self) -> None:
        self._role: RoleMakerBase | None = None
        self._strategy: DistributedStrategy | Strategy | None = None
        self._mesh: Mesh | None = None
        self._xla_flags: tuple[xla_flags.Flag, ...] = ()  # what init put in effect
        self._model: Any = None  # from distributed_model
        self._param_specs: Any = None
        self._optimizer: FleetOptimizer | None = None  # from distributed_optimizer
        self._trainer: Trainer | None = None
        self._dygraph: Dygraph | None = None  # the distributed nnx model's dygraph loop
        # Before the Trainer: what set_lr / set_state_dict gave, and the last batch's shapes.
        self._pending_lr: float | None = None
        self._pending_state: Mapping[str, Any] | None = None
        self._batch_spec: Any = None
        self.util = UtilBase()

    # -- set-up ---------------------------------------------------------------------------
    def init(
        self,
        role_maker: RoleMakerBase | None = None,
        is_collective: bool = True,
        strategy: DistributedStrategy | Strategy | None = None,
        log_level: int | str = "INFO",
    ) -> Fleet:
        """Set up this process: Paddle's `FLAGS_*` environment variables, the XLA flags the
        strategy maps to, its role, `jax.distributed` if several processes, the mesh.

        Call it before any JAX computation: XLA reads its flags (`fleetjax.xla_flags`) and JAX
        its memory fraction (`FLAGS_fraction_of_gpu_memory_to_use`) when JAX starts its
        backend; flags that come later only warn. docs/knobs.md lists the `FLAGS_*` read.

        Args:
          role_maker: default `PaddleCloudRoleMaker(is_collective=True)` (reads the `PADDLE_*`
            variables), or, without them, `JaxProcessRoleMaker()` if the script already called
            `jax.distributed.initialize()` or JAX's cluster detection finds a job of several
            processes (SLURM, Open MPI, Kubernetes), which `init` then joins; in
            parameter-server mode `PaddleCloudRoleMaker(is_collective=False)` (Paddle's
            `TRAINING_ROLE`, `PADDLE_PSERVERS_IP_PORT_LIST`, ... variables).
          is_collective: collective (True, fleetjax's default) or parameter-server mode
            (False, Paddle's default), when no `role_maker` is given.
          strategy: a `DistributedStrategy` or `Strategy` (copied; default plain DP). Its
            degrees shape the mesh.
          log_level: the level of the "fleetjax" logger.

        Raises:
          RuntimeError: if JAX already ran a computation and several processes must join, or
            a scheduler's variables promise several tasks that cannot be joined.
          ValueError: if the strategy's degrees do not fit the devices, or the environment
            describes no valid role.
        """
        if not isinstance(is_collective, bool):
            raise TypeError(f"is_collective must be bool, got {type(is_collective).__name__}")
        strategy = DistributedStrategy() if strategy is None else strategy
        if not isinstance(strategy, (DistributedStrategy, Strategy)):
            raise TypeError(
                "strategy must be a fleetjax.DistributedStrategy or fleetjax.Strategy, "
                f"got {type(strategy).__name__} (a fleet.auto.Strategy converts with "
                "fleetjax.Strategy(strategy))"
            )
        # First: anything below may start JAX's backend (a role maker asking jax for the
        # process index, the mesh), and XLA reads XLA_FLAGS only then.
        strategy = _paddle_env.apply(strategy)
        plan, self._xla_flags = prepare(strategy)  # fails fast on what fleetjax cannot apply
        if role_maker is None:
            collective = default_role_maker
            role_maker = collective() if is_collective else PaddleCloudRoleMaker(False)
        if not isinstance(role_maker, RoleMakerBase):
            raise TypeError(
                f"role_maker must be a fleetjax role maker, got {type(role_maker).__name__}"
            )
        logger.setLevel(log_level)
        self.util._set_role_maker(role_maker)
        self.util._set_strategy(strategy)
        if role_maker.is_distributed:
            join_processes(role_maker)
        server = role_maker.role == Role.SERVER  # a parameter server builds no mesh
        self._mesh = None if server else job_mesh(plan)
        self._role, self._strategy = role_maker, strategy.__copy__()
        self._model = self._param_specs = self._optimizer = self._trainer = None
        self._replace_dygraph(None)
        self._pending_lr = self._pending_state = self._batch_spec = None
        if server:
            index, count = role_maker._server_index(), role_maker._server_num()
            logger.info("fleet: parameter server %d of %d", index, count)
        else:
            index, count = role_maker.worker_index, role_maker.worker_num
            logger.info("fleet: worker %d of %d, mesh %s", index, count, dict(self._mesh.shape))
        return self

    def _checked_role(self) -> RoleMakerBase:
        if self._role is None:
            raise RuntimeError("call fleet.init() first")
        return self._role

    @property
    def mesh(self) -> Mesh:
        """The global device mesh built from the strategy by `init`."""
        role = self._checked_role()
        if self._mesh is None:
            raise RuntimeError(
                f"this process is parameter server {role._server_index()}: fleetjax's sparse "
                "tables live sharded over the trainers' devices, so a server builds no mesh and "
                "trains nothing; branch on fleet.is_server() (init_server(), run_server()) "
                "before building the model"
            )
        return self._mesh

    @property
    def strategy(self) -> DistributedStrategy | Strategy:
        """The strategy in effect (a copy of the one given to `init` or
        `distributed_optimizer`)."""
        self._checked_role()
        assert self._strategy is not None
        return self._strategy

    def distributed_optimizer(
        self,
        optimizer: optax.GradientTransformation,
        strategy: DistributedStrategy | Strategy | None = None,
    ) -> FleetOptimizer:
        """Bind `optimizer` to the fleet's strategy and mesh, for `make_train_step`, with
        Paddle's dygraph calls (`step`, `clear_grad`, `get_lr`, ...) on the fleet's Trainer.

        A `strategy` given here replaces the one from `init` (Paddle's rule), with a warning,
        and the mesh is rebuilt from it.
        """
        self._checked_role()
        if strategy is not None:
            logger.warning(
                "a strategy given to fleet.distributed_optimizer() replaces the one from "
                "fleet.init(); pass it to fleet.init() instead"
            )
            strategy = _paddle_env.apply(strategy)
            plan, self._xla_flags = prepare(strategy)
            self._mesh = mesh_for(plan)
            self._strategy = strategy.__copy__()
            self.util._set_strategy(self._strategy)
        bound = distributed_optimizer(optimizer, self.strategy, self.mesh)
        self._optimizer = FleetOptimizer(**vars(bound), fleet=self)
        self._trainer = self._pending_lr = self._pending_state = None
        return self._optimizer

    def distributed_model(self, model: Any, *, param_specs: Any = None) -> Any:
        """`model` placed on the fleet's mesh as a train step under the fleet's strategy
        places it (Paddle's `distributed_model`); `minimize` and `backward` train it.

        A flax nnx Module is placed in place (under a `DistributedStrategy` its BatchNorms
        compute statistics as `sync_batch_norm` says) and comes back wrapped, as Paddle's
        comes back as a `DataParallel`: a `DistributedModel`, whose call gives a deferred
        output for Paddle's loss layers (`fleetjax.nn`), so that Paddle's dygraph loop runs as
        written; its other attributes are the module's, and `.module` is the module itself.
        Flax linen variables and pytrees of arrays come back placed (`param_specs` overrides
        their logical axis names).
        """
        self._checked_role()
        self._model = distributed_model(model, self.strategy, self.mesh, param_specs=param_specs)
        self._param_specs, self._trainer = param_specs, None
        if not isinstance(self._model, nnx.Module):
            self._replace_dygraph(None)
            return self._model
        self._replace_dygraph(Dygraph(self, self._model))
        return DistributedModel(self._model, self._dygraph)

    def _replace_dygraph(self, dygraph: Dygraph | None) -> None:
        if self._dygraph is not None:
            self._dygraph.close()
        self._dygraph = dygraph

    def applied_strategy(self) -> AppliedStrategy:
        """What the fleet's strategy does on its mesh: the train step's plan, the optimizer's
        rebuild (after `distributed_optimizer`), the XLA flags `init` put in effect and the
        settings without effect, with the reasons (Paddle's `fleet._final_strategy()`).
        `print()` it for a table."""
        return applied_strategy(
            self.strategy, self.mesh, flags_in_effect=self._xla_flags, optimizer=self._optimizer
        )

    # -- Paddle 2.0's dygraph optimizer calls, on the fleet's Trainer -----------------------------
    @property
    def trainer(self) -> Trainer:
        """The `Trainer` that `minimize` and `backward` made (and then use)."""
        if self._trainer is None:
            raise RuntimeError(
                "the fleet has not trained yet: fleet.minimize(loss_fn, batch) or "
                "fleet.backward(loss_fn, batch) makes its Trainer"
            )
        return self._trainer

    def _trainer_for(self, loss_fn: Callable[..., Any]) -> Trainer:
        """The fleet's Trainer for `loss_fn`; another loss function gets a new one that goes on
        from the current state."""
        if self._trainer is not None and self._trainer.loss_fn == loss_fn:
            return self._trainer
        self._checked_role()
        if self._model is None:
            raise RuntimeError("call fleet.distributed_model(model) before training with the fleet")
        if self._optimizer is None:
            raise RuntimeError(
                "call fleet.distributed_optimizer(optimizer) before training with the fleet"
            )
        state = None if self._trainer is None else self._trainer.state
        trainer = Trainer(
            loss_fn, self._model, self._optimizer, param_specs=self._param_specs, state=state
        )
        if self._pending_state is not None:
            trainer.set_state_dict(self._pending_state)
        if self._pending_lr is not None:
            trainer.set_lr(self._pending_lr)
        self._trainer, self._pending_lr, self._pending_state = trainer, None, None
        return trainer

    def _checked_optimizer(self) -> FleetOptimizer:
        self._checked_role()
        if self._optimizer is None:
            raise RuntimeError("call fleet.distributed_optimizer(optimizer) first")
        return self._optimizer

    def _note_batch(self, batch: Any) -> None:
        """Keep the shapes of `batch`: Paddle's form of `save_inference_model` names inputs
        from it."""
        self._batch_spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)

    def minimize(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> jax.Array:
        """One training step of the model from `distributed_model`, with the optimizer from
        `distributed_optimizer`; returns the loss. See `Trainer.minimize`.

        `loss` is a deferred loss (Paddle's `minimize(loss)`: it applies the gradients of
        `loss.backward()`, or computes them first if there was none, as Paddle's static-graph
        minimize does), or a function with its `batch`: `loss_fn(model, batch)` for an nnx
        Module, else `loss_fn(params, batch)`; pass the same function every call (another one
        compiles another step). For aux outputs or a PRNG key, make a `fleetjax.fleet.Trainer`.
        """
        if isinstance(loss, DeferredLoss) and batch is None:
            return loss.runner.minimize(loss)
        value = self._trainer_for(_loss_function(loss, batch, "minimize")).minimize(batch)
        self._note_batch(batch)
        self._note_step(value)
        return value

    def backward(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> None:
        """Paddle's `loss.backward()`: `step()` applies the gradients of the deferred `loss`,
        or of `loss_fn` on `batch`. See `Trainer.backward`."""
        if isinstance(loss, DeferredLoss) and batch is None:
            loss.backward()
            return
        self._trainer_for(_loss_function(loss, batch, "backward")).backward(batch)
        self._note_batch(batch)

    def step(self) -> jax.Array:
        """Apply the gradients `backward` asked for; returns the loss. See `Trainer.step`."""
        value = self.trainer.step()
        self._note_step(value)
        return value

    def _note_step(self, value: jax.Array) -> None:
        if self._dygraph is not None:
            self._dygraph.stepped(value)

    def clear_grad(self) -> None:
        """Drop the gradients of the last `backward` (none before training). See
        `Trainer.clear_grad`."""
        if self._trainer is not None:
            self._trainer.clear_grad()

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

    # -- roles: the role maker's answers, as in Paddle ------------------------------------
    def worker_index(self) -> int:
        return self._checked_role()._worker_index()

    def worker_num(self) -> int:
        return self._checked_role()._worker_num()

    def is_first_worker(self) -> bool:
        return self._checked_role()._is_first_worker()

    def is_worker(self) -> bool:
        return self._checked_role()._is_worker()

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        endpoints = self._checked_role()._get_trainer_endpoints()
        return ",".join(endpoints) if to_string else list(endpoints)

    def node_num(self) -> int:
        return self._checked_role()._node_num()

    def server_num(self) -> int:
        """The parameter servers' count (0 in collective mode)."""
        return self._checked_role()._server_num()

    def server_index(self) -> int:
        """This process's index (Paddle's `current_id`; 0 in collective mode)."""
        return self._checked_role()._server_index()

    def server_endpoints(self, to_string: bool = False) -> list[str] | str:
        """The parameter servers' endpoints (empty in collective mode)."""
        endpoints = self._checked_role()._get_pserver_endpoints()
        return ",".join(endpoints) if to_string else list(endpoints)

    def is_server(self) -> bool:
        return self._checked_role()._is_server()

    def barrier_worker(self) -> None:
        """Wait until every worker process reaches this call (a real cross-process barrier)."""
        self._checked_role()._barrier("worker")

    # -- saving ---------------------------------------------------------------------------
    def save_persistables(
        self,
        executor: Any = None,
        dirname: str | os.PathLike[str] | None = None,
        main_program: Any = None,
        *,
        state: Any = None,
    ) -> None:
        """Save a training state to `dirname`, atomically replacing the last save (orbax; see
        `fleetjax.checkpoint`). Two call forms:

        * Paddle's `save_persistables(executor, dirname, main_program=None)` saves the state of
          the fleet's Trainer (parameters, optimizer state, step). JAX has no executor or
          program: `executor` and `main_program` are accepted and warn once.
        * fleetjax's `save_persistables(dirname, state)` (a path first) saves `state`, e.g.
          the `TrainState` of `make_train_step`.

        Raises:
          RuntimeError: in Paddle's form, if the fleet has not trained yet.
        """
        if isinstance(executor, (str, os.PathLike)):  # fleetjax's form: (dirname, state)
            if dirname is not None and state is not None:
                raise TypeError("save_persistables(dirname, state) got the state twice")
            executor, dirname, state = None, executor, state if dirname is None else dirname
        _no_meaning("save_persistables", executor=executor, main_program=main_program)
        if dirname is None:
            raise TypeError("save_persistables needs dirname")
        if state is None:
            state = self._trained("save_persistables(executor, dirname)").state
        checkpoint.save_persistables(dirname, state)

    def load_persistables(self, dirname: str | os.PathLike[str], target: object) -> object:
        """The state last saved in `dirname`, placed like `target` (any mesh)."""
        return checkpoint.load_persistables(dirname, target)

    def save_inference_model(self, *args: Any, **kwargs: Any) -> None:
        """Export an inference model into `dirname` with `jax.export` (see
        `fleetjax.export.save_inference_model`). Two call forms:

        * fleetjax's `save_inference_model(dirname, fn, params, example_inputs, *,
          dynamic_batch=True, platforms=None)` (a path first) exports `fn(params, *inputs)`.
        * Paddle's `save_inference_model(executor, dirname, feeded_var_names, target_vars,
          main_program=None, export_for_deployment=True)` exports the fleet's trained model.
          `feeded_var_names` name entries of the batch dict the fleet trained on: they are the
          inputs, in that order, with the last batch's shapes (any number of rows).
          `target_vars` are functions `target(model, feeds)`, like the loss functions, of the
          model (in eval mode: BatchNorm's running statistics, no dropout, as Paddle's
          inference program) and the dict of the named inputs; the exported model returns
          their list. `executor` and `main_program` are accepted and warn once.
        """
        if (args and isinstance(args[0], (str, os.PathLike))) or "fn" in kwargs:
            export.save_inference_model(*args, **kwargs)
        else:
            self._save_trained_model(*args, **kwargs)

    def _save_trained_model(
        self,
        executor: Any,
        dirname: str | os.PathLike[str],
        feeded_var_names: Sequence[str],
        target_vars: Sequence[Callable[..., Any]],
        main_program: Any = None,
        export_for_deployment: bool = True,
    ) -> None:
        """Paddle's form of `save_inference_model`, on the fleet's Trainer."""
        _no_meaning("save_inference_model", executor=executor, main_program=main_program)
        if export_for_deployment is not True:
            raise ValueError(
                "save_inference_model: export_for_deployment must be True (Paddle supports "
                f"only True), got {export_for_deployment!r}"
            )
        trainer = self._trained("save_inference_model(executor, dirname, ...)")
        example_inputs = _feeds(self._batch_spec, feeded_var_names)
        if isinstance(target_vars, (str, bytes)) or not all(map(callable, target_vars)):
            raise TypeError(
                "target_vars must be a list of functions target(model, feeds) that compute the "
                f"outputs (JAX has no output variables to name), got {target_vars!r}"
            )
        names, targets = list(feeded_var_names), list(target_vars)
        model_of, params = _pure_model(trainer.model)

        def outputs(params: Any, *inputs: Any) -> list[Any]:
            model, feeds = model_of(params), dict(zip(names, inputs, strict=True))
            return [target(model, feeds) for target in targets]

        export.save_inference_model(dirname, outputs, params, example_inputs)

    def save(
        self,
        dirname: str | os.PathLike[str],
        feed: Sequence[str] = (),
        fetch: Sequence[Callable[..., Any]] = (),
        **configs: Any,
    ) -> None:
        """Paddle's `fleet.save`: with `feed` or `fetch`, the fleet's trained model as an
        inference model (`save_inference_model(None, dirname, feed, fetch)`: `feed` names
        batch entries, `fetch` are functions `target(model, feeds)`); without, its training
        state (`save_persistables(None, dirname)`). In a process alone it warns and saves
        nothing, as Paddle's does. `mode` (Paddle's configs: 0 the whole tables, 1 their
        changed rows, 2 a base model) warns unless 0: the whole state is saved.
        """
        if non_distributed(self._checked_role(), "save"):
            return
        unknown = set(configs) - {"mode"}
        if unknown:
            raise TypeError(f"fleet.save got unknown configs {sorted(unknown)}; Paddle's is mode")
        if configs.get("mode", 0) != 0:
            warn_once(_WHOLE_STATE.format("save", configs["mode"]))
        if feed or fetch:
            self._save_trained_model(None, dirname, feed, fetch)
        else:
            self.save_persistables(None, dirname)

    def load_model(self, path: str | os.PathLike[str], mode: int) -> None:
        """Paddle's `fleet.load_model`: the fleet's Trainer goes on from the training state that
        `fleet.save(path)` (or `save_persistables`) saved. In a process alone it warns and loads
        nothing, as Paddle's does. `mode` (Paddle's 0 checkpoint, 3 batch model, 1 and 2 its
        inference formats) warns unless 0: the whole state loads.
        """
        if non_distributed(self._checked_role(), "load_model"):
            return
        if mode != 0:
            warn_once(_WHOLE_STATE.format("load_model", mode))
        trainer = self._trained("load_model(path, mode)")
        trainer.state = checkpoint.load_persistables(path, trainer.state)
        trainer._sync_model()

    def _trained(self, call: str) -> Trainer:
        if self._trainer is None:
            raise RuntimeError(
                f"{call} saves the fleet's trained model, and the fleet has not trained yet: "
                "train with fleet.minimize(loss_fn, batch) (or the optimizer's minimize / "
                "backward + step) first, or use fleetjax's form with a path first"
            )
        return self._trainer

    def load_inference_model(self, dirname: str | os.PathLike[str]) -> export.InferenceModel:
        """The exported model in `dirname`, callable with plain JAX."""
        return export.load_inference_model(dirname)

    # -- parameter-server runtime (fleetjax.fleet._ps) -------------------------------------
    def init_worker(self, scopes: object = None) -> None:
        """A trainer's start in parameter-server mode: logs and returns (the tables live on
        the trainers' devices; nothing to pull). `scopes` are Paddle's static-graph scopes."""
        del scopes  # JAX has no scopes
        runtime_call(self._checked_role(), "init_worker")

    def init_server(self, *args: object, **kwargs: object) -> None:
        """A server's start in parameter-server mode: logs and returns (it holds no table)."""
        runtime_call(self._checked_role(), "init_server", bool(args or kwargs))

    def run_server(self) -> None:
        """A server's loop in parameter-server mode: logs and returns (nothing to serve)."""
        runtime_call(self._checked_role(), "run_server")

    def stop_worker(self) -> None:
        """A trainer's end in parameter-server mode: logs and returns."""
        runtime_call(self._checked_role(), "stop_worker")


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


def _no_meaning(call: str, **arguments: Any) -> None:
    """Warn once for each Paddle argument given that JAX has no counterpart of."""
    for name, value in arguments.items():
        if value is not None:
            warn_once(_NO_EXECUTOR.format(name, call))


def _feeds(batch_spec: Any, names: Sequence[str]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The shapes of the batch entries `names` (Paddle's `feeded_var_names`)."""
    if isinstance(names, (str, bytes)) or not names:
        raise TypeError(f"feeded_var_names must be a non-empty list of names, got {names!r}")
    if not isinstance(batch_spec, Mapping):
        raise ValueError(
            "feeded_var_names name entries of the batch dict the fleet trains on, but its "
            f"batch is a {type(batch_spec).__name__}; export with "
            "fleet.save_inference_model(dirname, fn, params, example_inputs) instead"
        )
    missing = [name for name in names if name not in batch_spec]
    if missing:
        raise ValueError(
            f"feeded_var_names {missing} are not in the batch the fleet trained on, whose "
            f"entries are {sorted(batch_spec)}"
        )
    return tuple(batch_spec[name] for name in names)


def _pure_model(model: Any) -> tuple[Callable[[Any], Any], Any]:
    """(a function from parameters to the model, its parameters): for an nnx Module, its
    variables but the random-number state as a dict, and the module rebuilt from them in eval
    mode; for a pytree of parameters, itself."""
    if not isinstance(model, nnx.Module):
        return (lambda params: params), model
    graphdef, arrays, rngs = nnx.split(model, nnx.Not(nnx.RngState), ...)

    def model_of(params: Any) -> nnx.Module:
        state = jax.tree.map(lambda x: x, arrays)
        nnx.replace_by_pure_dict(state, params)
        module = nnx.merge(graphdef, state, rngs)
        module.eval()
        return module

    return model_of, nnx.to_pure_dict(arrays)
