"""The `Fleet` facade: Paddle's Fleet API as a thin stateful shell over fleetjax's functions."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from fleetjax import _paddle_env, checkpoint, export, xla_flags
from fleetjax._applied import AppliedStrategy, applied_strategy
from fleetjax.distributed_model import distributed_model
from fleetjax.distributed_optimizer import DistributedOptimizer, distributed_optimizer
from fleetjax.fleet._join import default_role_maker, join_processes
from fleetjax.fleet._ps import runtime_call
from fleetjax.fleet._trainer import Trainer
from fleetjax.fleet.base.role_maker import PaddleCloudRoleMaker, Role, RoleMakerBase
from fleetjax.fleet.base.util_factory import UtilBase
from fleetjax.plan import mesh_for, read_plan
from fleetjax.strategy import DistributedStrategy, Strategy

logger = logging.getLogger("fleetjax")


class Fleet:
    """Paddle's `fleet` singleton: initialise once with `init`, then query roles, make
    distributed optimizers and synchronise workers.

    With several worker endpoints (`PADDLE_TRAINER_ENDPOINTS`, as `fleetrun`/`fleetjax-run`
    set), `init` joins all processes with `jax.distributed.initialize` into one global mesh.
    In parameter-server mode (`init(is_collective=False)`) the trainers join so, and a server
    joins nothing: its role queries answer as Paddle's and `init_server()`/`run_server()`
    return (fleetjax's tables live on the trainers; docs/parameter_server.md).

    Paddle 2.0's dygraph calls on the fleet (`minimize`, `step`, `clear_grad`, `state_dict`,
    `set_state_dict`, `get_lr`, `set_lr`) act on the fleet's `Trainer`, which the first
    `minimize` or `backward` makes from the model given to `distributed_model` and the
    optimizer from `distributed_optimizer`.
    """

    def __init__(self) -> None:
        self._role: RoleMakerBase | None = None
        self._strategy: DistributedStrategy | Strategy | None = None
        self._mesh: Mesh | None = None
        self._xla_flags: tuple[xla_flags.Flag, ...] = ()  # what init put in effect
        self._model: Any = None  # from distributed_model
        self._param_specs: Any = None
        self._optimizer: DistributedOptimizer | None = None  # from distributed_optimizer
        self._trainer: Trainer | None = None
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
          role_maker: default `PaddleCloudRoleMaker()` (reads the `PADDLE_*` variables), or,
            without them, `JaxProcessRoleMaker()` if the script already called
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
                "fleetjax.Strategy()._from_legacy_strategy(strategy))"
            )
        # First: anything below may start JAX's backend (a role maker asking jax for the
        # process index, the mesh), and XLA reads XLA_FLAGS only then.
        strategy = _paddle_env.apply(strategy)
        plan = read_plan(strategy)  # fail fast on settings fleetjax cannot apply
        self._xla_flags = xla_flags.apply(plan.xla_flags, plan.strategy)
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
        self._mesh = None if server else mesh_for(plan)
        self._role, self._strategy = role_maker, strategy.__copy__()
        self._model = self._param_specs = self._optimizer = self._trainer = None
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
    ) -> DistributedOptimizer:
        """Bind `optimizer` to the fleet's strategy and mesh, for `make_train_step`.

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
            plan = read_plan(strategy)
            self._xla_flags = xla_flags.apply(plan.xla_flags, plan.strategy)
            self._mesh = mesh_for(plan)
            self._strategy = strategy.__copy__()
            self.util._set_strategy(self._strategy)
        self._optimizer = distributed_optimizer(optimizer, self.strategy, self.mesh)
        self._trainer = None
        return self._optimizer

    def distributed_model(self, model: Any, *, param_specs: Any = None) -> Any:
        """`model` placed on the fleet's mesh as a train step under the fleet's strategy
        places it (Paddle's `distributed_model`).

        A flax nnx Module comes back as the same object, its variables placed and, under a
        `DistributedStrategy`, its BatchNorms computing statistics as `sync_batch_norm` says;
        flax linen variables and pytrees of arrays come back placed (`param_specs` overrides
        their logical axis names). `minimize` and `backward` train this model.
        """
        self._checked_role()
        self._model = distributed_model(model, self.strategy, self.mesh, param_specs=param_specs)
        self._param_specs, self._trainer = param_specs, None
        return self._model

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
        if self._trainer is not None and self._trainer.loss_fn is loss_fn:
            return self._trainer
        self._checked_role()
        if self._model is None:
            raise RuntimeError("call fleet.distributed_model(model) before training with the fleet")
        if self._optimizer is None:
            raise RuntimeError(
                "call fleet.distributed_optimizer(optimizer) before training with the fleet"
            )
        state = None if self._trainer is None else self._trainer.state
        self._trainer = Trainer(
            loss_fn, self._model, self._optimizer, param_specs=self._param_specs, state=state
        )
        return self._trainer

    def minimize(self, loss_fn: Callable[..., Any], batch: Any) -> jax.Array:
        """One training step of the model from `distributed_model` on `batch`, with the
        optimizer from `distributed_optimizer`; returns the loss. See `Trainer.minimize`.

        `loss_fn(model, batch)` for an nnx Module, else `loss_fn(params, batch)`; pass the same
        function every call (another one compiles another step). For aux outputs or a PRNG
        key, make a `fleetjax.fleet.Trainer`."""
        return self._trainer_for(loss_fn).minimize(batch)

    def backward(self, loss_fn: Callable[..., Any], batch: Any) -> None:
        """Paddle's `loss.backward()`: `step()` applies the gradients of `loss_fn` on `batch`.
        See `Trainer.backward`."""
        self._trainer_for(loss_fn).backward(batch)

    def step(self) -> jax.Array:
        """Apply the gradients `backward` asked for; returns the loss. See `Trainer.step`."""
        return self.trainer.step()

    def clear_grad(self) -> None:
        """Drop the gradients of the last `backward`. See `Trainer.clear_grad`."""
        self.trainer.clear_grad()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state as a nested dict of arrays. See `Trainer.state_dict`."""
        return self.trainer.state_dict()

    def set_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the optimizer state from `state_dict`. See `Trainer.set_state_dict`."""
        self.trainer.set_state_dict(state_dict)

    def get_lr(self) -> float:
        """The learning rate of the next step. See `Trainer.get_lr`."""
        return self.trainer.get_lr()

    def set_lr(self, value: float) -> None:
        """Use the learning rate `value` from the next step on. See `Trainer.set_lr`."""
        self.trainer.set_lr(value)

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
    def save_persistables(self, dirname: str | os.PathLike[str], state: object) -> None:
        """Save `state` (e.g. a `TrainState`) to `dirname`, atomically replacing the last save
        (Paddle's `save_persistables`, without its executor and program arguments).
        See `fleetjax.checkpoint`."""
        checkpoint.save_persistables(dirname, state)

    def load_persistables(self, dirname: str | os.PathLike[str], target: object) -> object:
        """The state last saved in `dirname`, placed like `target` (any mesh)."""
        return checkpoint.load_persistables(dirname, target)

    def save_inference_model(
        self, dirname: str | os.PathLike[str], fn, params, example_inputs, **kwargs
    ) -> None:
        """Export `fn(params, *inputs)` with `jax.export` into `dirname` (Paddle's
        `save_inference_model`); see `fleetjax.export.save_inference_model`."""
        export.save_inference_model(dirname, fn, params, example_inputs, **kwargs)

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
