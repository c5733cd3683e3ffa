"""The `Fleet` facade: Paddle's Fleet API as a thin stateful shell over fleetjax's functions.

`Fleet` sets the process up (`init`, the mesh, the strategy) and binds the model and the
optimizer to them; its other calls live in their own modules: Paddle's dygraph calls on its
`DygraphLoop` (fleetjax/fleet/_loop.py, forwarded by one table, `DygraphCalls`), the role queries
(`_roles.py`), saving and loading (`_saving.py`) and the parameter-server calls (`_ps.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import optax
from flax import nnx
from jax.sharding import Mesh

from fleetjax import _paddle_env, xla_flags
from fleetjax._applied import AppliedStrategy, applied_strategy
from fleetjax.distributed_model import distributed_model
from fleetjax.distributed_optimizer import DistributedOptimizer, distributed_optimizer
from fleetjax.fleet._dygraph import DistributedModel
from fleetjax.fleet._join import default_role_maker, job_mesh, join_processes
from fleetjax.fleet._loop import CALLS, DygraphCalls, DygraphLoop
from fleetjax.fleet._ps import ParameterServerCalls
from fleetjax.fleet._saving import Saving
from fleetjax.fleet._trainer import Trainer
from fleetjax.fleet.base.role_maker import PaddleCloudRoleMaker, Role, RoleMakerBase
from fleetjax.fleet.base.util_factory import UtilBase
from fleetjax.plan import mesh_for, prepare
from fleetjax.strategy import DistributedStrategy, Strategy

__all__ = ["Fleet", "FleetOptimizer"]

logger = logging.getLogger("fleetjax")


@dataclasses.dataclass(frozen=True)
class FleetOptimizer(DistributedOptimizer, DygraphCalls):
    """What `fleet.distributed_optimizer` returns: a `DistributedOptimizer` (it goes to
    `make_train_step` or a `Trainer` as any other) with Paddle's dygraph optimizer calls
    (`minimize`, `backward`, `step`, `clear_grad`, `state_dict`, `set_state_dict`, `get_lr`,
    `set_lr`), which are those of the fleet's `DygraphLoop`, as `fleet.minimize`, `fleet.step`,
    ... are.

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

    @classmethod
    def _elsewhere(cls, name: str) -> str | None:
        if name not in CALLS:
            return None
        return (
            "Paddle's dygraph calls act on a model's training state, which this value does not "
            "hold; use the optimizer that fleet.distributed_optimizer returns (after "
            "fleet.init), whose calls act on the fleet's Trainer, or a fleetjax.fleet.Trainer"
        )

    def _dygraph_loop(self) -> DygraphLoop:
        if self.fleet._optimizer is not self:
            raise RuntimeError(
                "this optimizer was replaced by a later fleet.distributed_optimizer() (or "
                "fleet.init()) call; use the optimizer that call returned"
            )
        return self.fleet._dygraph_loop()


class Fleet(DygraphCalls, Saving, ParameterServerCalls):
    """Paddle's `fleet` singleton: initialise once with `init`, then query roles, make
    distributed optimizers and synchronise workers.

    With several worker endpoints (`PADDLE_TRAINER_ENDPOINTS`, as `fleetrun`/`fleetjax-run`
    set), `init` joins all processes with `jax.distributed.initialize` into one global mesh.
    In parameter-server mode (`init(is_collective=False)`) the trainers join so, and a server
    joins nothing: its role queries answer as Paddle's and `init_server()`/`run_server()`
    return (fleetjax's tables live on the trainers; docs/parameter_server.md).

    Paddle 2.0's dygraph calls on the fleet (`minimize`, `backward`, `step`, `clear_grad`,
    `state_dict`, `set_state_dict`, `get_lr`, `set_lr`), and the same calls on the optimizer
    that `distributed_optimizer` returns, are those of the fleet's `DygraphLoop`: they act on
    its `Trainer`, which the first `minimize` or `backward` makes from the model given to
    `distributed_model` and that optimizer. Before it, as in Paddle (whose optimizer makes its
    state at the first step), `get_lr` is the initial rate, `set_lr` and `set_state_dict` take
    effect when the Trainer is made, and `state_dict` is empty.
    """

    def __init__(self) -> None:
        self._role: RoleMakerBase | None = None
        self._strategy: DistributedStrategy | Strategy | None = None
        self._mesh: Mesh | None = None
        self._xla_flags: tuple[xla_flags.Flag, ...] = ()  # what init put in effect
        self._optimizer: FleetOptimizer | None = None  # from distributed_optimizer
        self._loop = DygraphLoop(None)  # the model of distributed_model, trained
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
        self._optimizer = None
        self._loop.close()
        self._loop = DygraphLoop(self._mesh)
        if server:
            index, count = role_maker._server_index(), role_maker._server_num()
            logger.info("fleet: parameter server %d of %d", index, count)
        else:
            index, count = role_maker.worker_index, role_maker.worker_num
            logger.info("fleet: worker %d of %d, mesh %s", index, count, dict(self._mesh.shape))
        return self

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
        self._loop.use_optimizer(self._optimizer)
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
        model = distributed_model(model, self.strategy, self.mesh, param_specs=param_specs)
        self._loop = self._loop.with_model(self.mesh, model, param_specs)
        return DistributedModel(model, self._loop) if isinstance(model, nnx.Module) else model

    def applied_strategy(self) -> AppliedStrategy:
        """What the fleet's strategy does on its mesh: the train step's plan, the optimizer's
        rebuild (after `distributed_optimizer`), the XLA flags `init` put in effect and the
        settings without effect, with the reasons (Paddle's `fleet._final_strategy()`).
        `print()` it for a table."""
        return applied_strategy(
            self.strategy, self.mesh, flags_in_effect=self._xla_flags, optimizer=self._optimizer
        )

    @property
    def trainer(self) -> Trainer:
        """The `Trainer` that `minimize` and `backward` made (and then use)."""
        trainer = self._dygraph_loop().trainer
        if trainer is None:
            raise RuntimeError(
                "the fleet has not trained yet: loss.backward() (or fleet.minimize(loss_fn, "
                "batch), fleet.backward(loss_fn, batch)) makes its Trainer"
            )
        return trainer

    def _dygraph_loop(self) -> DygraphLoop:
        self._checked_role()
        return self._loop
