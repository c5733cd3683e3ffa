"""Paddle's auto-parallel dygraph loop, as the fleet's `DygraphLoop` on a translated request:

    model = MLP()                                  # weights placed with dist.shard_tensor
    opt = dist.shard_optimizer(AdamW(parameters=model.parameters()), dist.ShardingStage1("dp"))
    for x, y in dist.shard_dataloader(loader, mesh, shard_dims="dp")():
        loss = F.mse_loss(model(x), y)             # deferred, as fleet.distributed_model's
        loss.backward(); opt.step(); opt.clear_grad()

`SemiAutoLoop` is a `DygraphLoop` whose mesh, parameter specs and optimizer are not given but
read: at the layer's first call, each mesh dimension's role from how the parameters, the batch
and the `ShardingStage` use it (`_roles`), which gives the step's mesh (a view of the user's
`ProcessMesh`) and every parameter's `PartitionSpec`; at the first `backward`, the `Strategy`
(ZeRO's stage and degree, gradient merge, AMP from `fleetjax.amp.auto_cast` and the
`GradScaler`, the pipeline of `parallelize`'s `split_spec`, and `to_static`'s own strategy),
which binds the optimizer. From there it is the fleet's loop: one compiled `make_train_step`
per loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

from fleetjax import amp
from fleetjax.auto_parallel import MeshView, ProcessMesh, get_mesh, placements_of, process_mesh_of
from fleetjax.distributed._names import ParamNames, load_paddle_state
from fleetjax.distributed._pipeline import PipelineModel, split_spec_of
from fleetjax.distributed._roles import Uses, param_specs, roles, step_mesh, tensor_placements
from fleetjax.distributed_optimizer import distributed_optimizer
from fleetjax.fleet import DeferredLoss, DygraphLoop, ModelOutput, Trainer
from fleetjax.mesh import data_parallel_size
from fleetjax.nn import LossLayer, bind_runner
from fleetjax.strategy import Strategy

__all__ = ["Request", "SemiAutoLoop", "SemiAutoOutput", "loop_of"]


@dataclasses.dataclass(frozen=True)
class Request:
    """What a user asks of the training besides the tensors' placements.

    Attributes:
      optimizer: the user's optimizer (an optax transformation; `paddle.optimizer.AdamW`'s
        counterpart from `fleetjax.optimizers`).
      stage: the ZeRO stage of `shard_optimizer`'s `ShardingStage1/2/3` (0: none).
      sharding_dim: the mesh dimension it names.
      sharding_mesh: the mesh it names (None: the parameters' or `get_mesh()`'s).
      accumulation: `shard_optimizer`'s `gradient_accumulation_steps`.
      strategy: `to_static`'s `Strategy` (None: the defaults).
    """

    optimizer: optax.GradientTransformation | None
    stage: int = 0
    sharding_dim: str | None = None
    sharding_mesh: ProcessMesh | None = None
    accumulation: int = 1
    strategy: Strategy | None = None


class SemiAutoOutput(ModelOutput):
    """A bound layer's deferred output (a `fleetjax.fleet.ModelOutput` of its loop): its label
    goes where the step's batch goes, as its inputs did."""

    def with_loss(self, layer: LossLayer, label: Any) -> DeferredLoss:
        return super().with_loss(layer, self.runner.on_step_mesh(label))


class SemiAutoLoop(DygraphLoop):
    """The fleet's dygraph loop for one layer, its mesh, parameter specs and optimizer read from
    the user's request (see the module). Bound to the layer: the layer's calls give its
    deferred outputs.

    Attributes:
      layer: the layer it trains (`model`).
      request: what the user asked for.
      view: the step's mesh as a view of the user's `ProcessMesh` (None before the first call).
      autocast: the `fleetjax.amp.auto_cast` the first call was made under (None: none).
      scaler: the `GradScaler` that scaled a loss (None: none).
    """

    def __init__(self, layer: nnx.Module, request: Request) -> None:
        super().__init__(None, layer, None)
        self.request = request
        self.view: MeshView | None = None
        self.autocast: amp.AutoCast | None = None
        self.scaler: amp.GradScaler | None = None
        self.pipeline: PipelineModel | None = None
        self._bound_to: tuple | None = None  # the autocast and scaler the optimizer was made for
        self._first_batch: Any = None  # the first loss's batch (a pipeline's parts are read on it)
        self.pending_paddle_state: Mapping[str, Any] | None = None  # DistModel.set_state_dict's
        bind_runner(layer, self)

    @property
    def layer(self) -> nnx.Module:
        return self.model

    # -- the layer's calls ------------------------------------------------------------------------

    def call(self, layer: nnx.Module, args: tuple, kwargs: dict[str, Any]) -> SemiAutoOutput:
        """`layer(*args, **kwargs)`, deferred (the layer's first call settles the layout)."""
        if self.view is None:
            self._settle_layout((args, kwargs))
        cast = amp.current_autocast()
        if self._bound_to is not None and cast != self.autocast:
            raise RuntimeError(
                f"{type(layer).__name__} was trained under {self.autocast} and is now called "
                f"under {cast}: one compiled step trains it; keep one auto_cast for its losses"
            )
        self.autocast = cast
        return SemiAutoOutput(self, self.on_step_mesh(args), self.on_step_mesh(kwargs))

    def use_scaler(self, scaler: amp.GradScaler) -> None:
        """`GradScaler.scale(loss)`: the step scales this layer's losses as `scaler` says."""
        if self._bound_to is not None and self.scaler is not scaler:
            raise RuntimeError(
                "the step was compiled without this GradScaler: scale every loss of the layer "
                "with one GradScaler, from the first backward() on"
            )
        self.scaler = scaler

    def on_step_mesh(self, tree: Any) -> Any:
        """`tree`'s arrays placed on the user's mesh moved onto the step's (free: the same
        devices in the same order); host arrays stay (the step places them)."""
        view = self.view

        def moved(x: Any) -> Any:
            if not isinstance(x, jax.Array) or view is None:
                return x
            if process_mesh_of(x) is None or x.sharding.mesh == view.mesh:
                return x
            placements = tensor_placements(x, view.process_mesh, "an input of the layer")
            spec = _user_spec(placements, view, np.shape(x))
            return jax.device_put(x, NamedSharding(view.mesh, view.to_step(spec)))

        return jax.tree.map(moved, tree)

    # -- training ---------------------------------------------------------------------------------

    def backward(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> None:
        self._settle_optimizer(loss, batch)
        super().backward(loss, batch)

    def minimize(self, loss: DeferredLoss | Callable[..., Any], batch: Any = None) -> jax.Array:
        self._settle_optimizer(loss, batch)
        return super().minimize(loss, batch)

    def step(self) -> jax.Array:
        value = super().step()
        self._written_back()
        return value

    def make_trainer(self, loss_fn: Callable[..., Any], state: Any) -> Trainer:
        """The loop's Trainer; under `parallelize`'s `split_spec`, of the layer cut into a
        pipeline (its parameters as `PipelineParams`, written back to the layer after each
        step)."""
        if self.pipeline is None:
            trainer = super().make_trainer(loss_fn, state)
        else:
            model, params, specs = self.pipeline.for_loss(
                loss_fn, self.layer, self.param_specs, self._first_batch
            )
            trainer = Trainer(model, params, self.optimizer, param_specs=specs, state=state)
        if self.pending_paddle_state is not None:
            load_paddle_state(trainer, self.pending_paddle_state, self.param_names())
            self.pending_paddle_state = None
        return trainer

    def param_names(self) -> ParamNames:
        """The layer's dotted parameter names of each path of the step's parameters."""
        if self.pipeline is not None:
            return self.pipeline.param_names
        return lambda path: [(".".join(map(str, path)), None)]

    def _written_back(self) -> None:
        if self.pipeline is not None and self.trainer is not None:
            self.pipeline.write_back(self.layer, self.trainer.state.params)

    # -- settling ---------------------------------------------------------------------------------

    def _settle_layout(self, inputs: Any) -> None:
        """The step's mesh and the parameter specs, from the parameters' placements, the
        inputs' and the request; the layer's variables moved onto the step's mesh."""
        params = {name: v[...] for name, v in _flat(nnx.state(self.layer, nnx.Param)).items()}
        mesh = self._process_mesh(params, inputs)
        placements = {n: tensor_placements(x, mesh, f"parameter {n}") for n, x in params.items()}
        split = split_spec_of(self.layer)
        uses = Uses(
            data=_data_dims(inputs, mesh),
            weights={
                mesh.dim_names[i]: f"parameter {n}"
                for n, held in reversed(placements.items())
                for i, p in enumerate(held)
                if p.is_shard()
            },
            sharding=self._sharding_dim(mesh, inputs),
            pipeline=None if split is None else split.dim,
        )
        view = step_mesh(roles(mesh, uses))
        specs = param_specs(params, view, placements)
        self.view, self.mesh = view, view.mesh
        self.param_specs = _nested(specs, nnx.to_pure_dict(nnx.state(self.layer, nnx.Param)))
        if split is not None:
            self.pipeline = PipelineModel(split, self.layer, view)
        _place_layer(self.layer, view, specs)

    def _process_mesh(self, params: Mapping[str, Any], inputs: Any) -> ProcessMesh:
        """The one `ProcessMesh` the training runs on: the parameters', the inputs', the
        `ShardingStage`'s, `parallelize`'s or `get_mesh()`'s."""
        split = split_spec_of(self.layer)
        for found in (
            *(process_mesh_of(x) for x in params.values()),
            *(process_mesh_of(x) for x in jax.tree.leaves(inputs)),
            self.request.sharding_mesh,
            None if split is None else split.mesh,
            get_mesh(),
        ):
            if found is not None:
                return found
        raise ValueError(
            f"no ProcessMesh for {type(self.layer).__name__}: place a parameter or the batch "
            "with dist.shard_tensor / dist.shard_dataloader, give the ShardingStage a mesh, or "
            "dist.set_mesh(mesh)"
        )

    def _sharding_dim(self, mesh: ProcessMesh, inputs: Any) -> tuple[str, str] | None:
        """The dimension ZeRO shards over: the `ShardingStage`'s, or for a `Strategy` with
        `sharding.enable` the one data dimension (Paddle's static engine shards over dp)."""
        request = self.request
        if request.sharding_dim is not None:
            return request.sharding_dim, f"ShardingStage{request.stage}"
        strategy = request.strategy
        if strategy is None or not strategy.sharding.enable:
            return None
        data = list(_data_dims(inputs, mesh)) or [
            d for d in mesh.dim_names if mesh.get_dim_size(d) == strategy.sharding.degree
        ]
        if len(data) != 1:
            raise ValueError(
                f"Strategy.sharding.enable=True with degree {strategy.sharding.degree}: "
                f"which mesh dim of {mesh} does ZeRO shard over? Name it: "
                "dist.shard_optimizer(opt, dist.ShardingStage1('<dim>', mesh)), or split the "
                "batch over one dim (dist.shard_dataloader(..., shard_dims='<dim>'))"
            )
        return data[0], "Strategy.sharding"

    def _settle_optimizer(self, loss: Any, batch: Any) -> None:
        """Bind the optimizer to the strategy the request, the autocast and the scaler make
        (once: the first backward or minimize)."""
        if self.view is None:
            raise RuntimeError(
                f"{type(self.layer).__name__} has not been called yet: compute the loss of its "
                "output first (loss = loss_fn(model(x), y))"
            )
        made_for = (self.autocast, self.scaler)
        if self._bound_to is not None:
            if made_for != self._bound_to:
                raise RuntimeError(
                    "AMP changed after the first backward(): a GradScaler or auto_cast must be "
                    "there from the first step (one compiled step trains the layer)"
                )
            return
        if self.request.optimizer is None:
            raise RuntimeError(
                f"no optimizer trains {type(self.layer).__name__}: make one with "
                "parameters=model.parameters() and pass it to dist.shard_optimizer"
            )
        self._first_batch = loss.batch if isinstance(loss, DeferredLoss) else batch
        rows = _rows(loss, batch)
        strategy = build_strategy(self.request, self.view, self.autocast, self.scaler, rows)
        self.use_optimizer(distributed_optimizer(self.request.optimizer, strategy, self.view.mesh))
        self._bound_to = made_for


def loop_of(layer: Any) -> SemiAutoLoop | None:
    """The auto-parallel loop bound to `layer` (None: none)."""
    from fleetjax.nn import runner_of

    runner = runner_of(layer) if isinstance(layer, nnx.Module) else None
    return runner if isinstance(runner, SemiAutoLoop) else None


def build_strategy(
    request: Request,
    view: MeshView,
    autocast: amp.AutoCast | None,
    scaler: amp.GradScaler | None,
    rows: int | None,
) -> Strategy:
    """The `Strategy` of the request on `view`'s mesh: `to_static`'s own (copied), with ZeRO
    from the `ShardingStage` (its degree: the sharding dimension's size), gradient merge across
    calls from `gradient_accumulation_steps`, AMP from `auto_cast` and the `GradScaler`, and a
    pipeline of the `pp` dimension's stages.

    Raises:
      ValueError: where the strategy and the request disagree (a sharding degree that is not
        the sharding dimension's size, gradient merge asked twice).
    """
    strategy = request.strategy.__copy__() if request.strategy is not None else Strategy()
    mesh = view.mesh
    sharding = mesh.shape["sharding"]
    if strategy.sharding.enable:  # to_static's strategy: its stage applies (warned there)
        if strategy.sharding.degree != sharding:
            raise ValueError(
                f"Strategy.sharding.degree={strategy.sharding.degree}, but ZeRO's mesh dim "
                f"{view.dim_of('sharding')!r} has {sharding} devices: set the degree to {sharding}"
            )
    elif request.stage:
        strategy.sharding.enable, strategy.sharding.stage = True, request.stage
        strategy.sharding.degree = sharding
    if request.accumulation > 1:
        if strategy.gradient_merge.enable:
            raise ValueError(
                f"gradient merge asked twice: shard_optimizer's gradient_accumulation_steps="
                f"{request.accumulation} and Strategy.gradient_merge (k_steps="
                f"{strategy.gradient_merge.k_steps}); keep one"
            )
        merge = strategy.gradient_merge
        merge.enable, merge.k_steps, merge.avg = True, request.accumulation, True
        merge.mode = "across_calls"
    amp.apply(strategy, autocast, scaler)
    if mesh.shape["pp"] > 1:
        _pipeline_section(strategy, mesh.shape["pp"], rows, data_parallel_size(mesh))
    return strategy


def _pipeline_section(strategy: Strategy, stages: int, rows: int | None, replicas: int) -> None:
    """The pipeline section for `stages` stages: its degree from the mesh, and a micro-batch
    size from the batch where the strategy leaves it at its default."""
    pipe = strategy.pipeline
    if pipe.is_set("pp_degree") and pipe.pp_degree not in (1, stages):
        raise ValueError(
            f"Strategy.pipeline.pp_degree={pipe.pp_degree}, but split_spec cuts the model over "
            f"a mesh dim of {stages} devices"
        )
    pipe.enable, pipe.pp_degree = True, stages
    merge = strategy.gradient_merge
    steps = merge.k_steps if merge.enable and merge.mode == "in_step" else pipe.accumulate_steps
    if not pipe.is_set("micro_batch_size") and rows is not None:
        pipe.micro_batch_size = max(rows // replicas // steps, 1)


def _rows(loss: Any, batch: Any) -> int | None:
    """The batch's rows (its first leaf's), where the loss or the batch says."""
    found = loss.batch if isinstance(loss, DeferredLoss) else batch
    leaves = jax.tree.leaves(found)
    return int(np.shape(leaves[0])[0]) if leaves and np.ndim(leaves[0]) else None


def _data_dims(inputs: Any, mesh: ProcessMesh) -> dict[str, str]:
    """The mesh dimensions the batch's arrays split their rows over (`Shard(0)`).

    Raises:
      ValueError: for an input split along another of its dimensions (fleetjax splits a
        batch by rows).
    """
    found: dict[str, str] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(inputs):
        if not isinstance(x, jax.Array) or process_mesh_of(x) is None:
            continue
        what = "the layer's input" + jax.tree_util.keystr(path[1:])
        for i, p in enumerate(tensor_placements(x, mesh, what)):
            if p.is_shard() and p.get_dim() % max(np.ndim(x), 1) != 0:
                raise ValueError(
                    f"{what} is placed {placements_of(x)}: split along its dim {p.get_dim()} "
                    f"over mesh dim {mesh.dim_names[i]!r}, but fleetjax splits a batch by its "
                    "rows (Shard(0)) over the data-parallel dims"
                )
            if p.is_shard():
                found.setdefault(mesh.dim_names[i], f"{what}, placed Shard(0) over it,")
    return found


def _user_spec(placements: Any, view: MeshView, shape: tuple[int, ...]) -> Any:
    from fleetjax.auto_parallel import partition_spec

    pm = view.process_mesh
    return partition_spec(placements, pm.dim_names, pm.shape, shape, "an input of the layer")


def _flat(state: nnx.State) -> dict[str, Any]:
    return {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}


def _nested(flat: Mapping[str, Any], like: Any) -> Any:
    """`flat` (by dotted name) in the nested structure of `like` (a pure dict)."""
    paths = jax.tree_util.tree_flatten_with_path(like)
    names = [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p) for p, _ in paths[0]]
    return jax.tree.unflatten(paths[1], [flat[n] for n in names])


def _place_layer(layer: nnx.Module, view: MeshView, specs: Mapping[str, Any]) -> None:
    """The layer's variables on the step's mesh: its parameters by `specs`, the rest whole."""
    for name, variable in _flat(nnx.state(layer, nnx.Not(nnx.RngState))).items():
        spec = specs.get(name, jax.sharding.PartitionSpec())
        value = variable[...]
        if isinstance(value, jax.Array | np.ndarray):
            variable.set_value(jax.device_put(value, NamedSharding(view.mesh, spec)))
