"""Placement: where the train state, the gradients and the batch live on the mesh.

`place(plan, mesh, abstract_state, optimizer, ...)` computes it once, from shapes alone
(nothing runs, so it works for meshes of compile-only devices too):

* the batch: its leading dimension split over the data axes (`dp` x `sharding`);
* parameters: split by their logical axis names (or `param_specs`) over `mp`, a pipeline's
  stacked layers over `pp`, and under ZeRO stage 3 also over `sharding` (`zero_spec`);
* gradients: as the parameters, under ZeRO stages 2 and 3 also over `sharding` (under a
  pipeline, stage 1 too: it reduce-scatters the whole gradients it accumulates);
* optimizer state: as its parameters, under any ZeRO stage also over `sharding`, in pinned
  host memory under `optimize_offload`;
* model state (batch-norm statistics): by `state_specs` or logical axis names;
* sparse tables (`fleetjax.layers.SparseTable`): rows split over every device, their rule's
  slots likewise (in a `TablesState`), both in pinned host memory for a table made with
  ``memory_kind="pinned_host"``; their gradients (the touched rows) whole;
* under DGC and LocalSGD (per-replica optimizers) the optimizer state, and under LocalSGD
  the parameters, are stacked on a leading replica axis split over the data axes; each
  replica's gradient is its own, so the gradients have no placement.

and the facts beside the shardings: which parts are stacked per replica (`stacked`), whether
each device keeps only its shard of the gradients (`scattered`), a pipeline's `StageOrder`.
`TrainStep`, the gradient chain, `explain`, `auto` and `fleet.distributed_model` all read this
one placement; its inputs (the plan, each tensor's own split in `param_specs`, the tables, the
pipeline model) are the only ways to change it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleetjax._checks import check_opt_state, check_param_specs, check_pipeline_layers
from fleetjax._tables import Tables, in_host_memory
from fleetjax._warnings import warn_once
from fleetjax.layers import is_table, partition_specs
from fleetjax.mesh import (
    ZERO_MIN_ELEMENTS,
    batch_sharding,
    data_axes,
    data_parallel_size,
    replicated,
    spec_axes,
    zero_spec,
)
from fleetjax.plan import Plan
from fleetjax.train_state import TrainState
from fleetjax.transforms.pipeline import (
    PipelineLayer,
    PipelineParams,
    to_model_order,
    to_pipeline_order,
)
from fleetjax.transforms.sparse_rows import without_tables

Loss = Callable[..., Any] | PipelineLayer

__all__ = [
    "Loss",
    "NOT_STACKED",
    "Placement",
    "StageOrder",
    "model_state_shardings",
    "param_shardings",
    "place",
    "stage_order",
    "vpp_degree",
]


@dataclasses.dataclass(frozen=True)
class StageOrder:
    """How a pipeline's stacked layers lie along the `pp` axis: `stages` stages, and under VPP
    (`vpp` > 1) stage s holds the layers of chunks s, s + P, s + 2P, ..., so the step keeps the
    layers in pipeline order (`fleetjax.transforms.pipeline.to_pipeline_order`)."""

    stages: int
    vpp: int

    def to_pipeline(self, tree: PipelineParams | None) -> PipelineParams | None:
        """`tree` (parameters or model state in model order) with its layers in pipeline
        order; abstract leaves (`jax.ShapeDtypeStruct`s) keep their shapes."""
        if tree is None or self.vpp == 1:
            return tree

        def one(x: Any) -> Any:
            return x if isinstance(x, jax.ShapeDtypeStruct) else to_pipeline_order(x, *self)

        return tree._replace(layers=jax.tree.map(one, tree.layers))

    def to_model(self, tree: PipelineParams) -> PipelineParams:
        """`tree` (parameters, gradients or model state in pipeline order) back in model
        order."""
        return tree._replace(layers=to_model_order(tree.layers, *self))

    def __iter__(self) -> Iterator[int]:  # (stages, vpp), as the order functions take them
        return iter((self.stages, self.vpp))


NOT_STACKED = TrainState(False, False, False, False, False, False)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each part of a train step's data lives, and every other fact of its layout: one
    value, computed once by `place`, that the step, the gradient chain, `explain` and `auto`
    read instead of deriving any of it again.

    Attributes:
      state: a `TrainState` of shardings (a prefix of the state's pytree): sparse tables' rows
        and slots as `fleetjax.step`'s `Tables` lay them out.
      grads: the reduced gradients' shardings, like the parameters; None under per-replica
        optimizers (DGC, LocalSGD), where each replica keeps its own full gradient.
      batch: the batch's sharding (every leaf split on its leading dimension).
      opt_state_in_update: where the update reads the optimizer state: as `opt_state`, but an
        offloaded state (`optimize_offload`) in device memory (host tables' slots stay).
      stacked: a `TrainState` of bools: the parts that hold one copy per data-parallel replica,
        stacked on a leading axis of `replicas` (per-replica optimizers: their state, and
        under LocalSGD the parameters).
      replicas: the data-parallel replicas (the data axes' devices).
      scattered: whether each device keeps only its shard of the reduced gradients (ZeRO-2
        and 3 over a `sharding` axis of more than one device; under a pipeline, any stage).
      stage_order: the pipeline's stages and virtual stages (None: no pipeline).
    """

    state: TrainState
    grads: Any | None
    batch: NamedSharding
    opt_state_in_update: Any = None
    stacked: TrainState = NOT_STACKED
    replicas: int = 1
    scattered: bool = False
    stage_order: StageOrder | None = None

    @property
    def params(self) -> Any:
        return self.state.params

    @property
    def opt_state(self) -> Any:
        return self.state.opt_state

    @property
    def model_state(self) -> Any:
        return self.state.model_state

    @property
    def per_replica(self) -> bool:
        """Whether each replica steps its own state (some part is stacked per replica)."""
        return any(self.stacked)

    def stack(self, state: TrainState) -> TrainState:
        """`state` (one replica's) with the stacked parts copied for every replica: each
        replica starts alike."""
        copies = lambda x: jnp.broadcast_to(x, (self.replicas, *x.shape))  # noqa: E731
        return jax.tree.map(
            lambda is_stacked, part: jax.tree.map(copies, part) if is_stacked else part,
            self.stacked,
            state,
        )

    def shapes(self, state: Any) -> Any:
        """`state`'s shapes and dtypes as `jax.ShapeDtypeStruct`s with its shardings: what the
        step is lowered for (a table in host memory traces as one)."""

        def placed(sharding: NamedSharding, part: Any) -> Any:
            shape = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)  # noqa: E731
            return jax.tree.map(shape, part)

        return jax.tree.map(placed, self.state, state)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _shardings(mesh: Mesh, specs: Any, memory_kind: str = "device") -> Any:
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec, memory_kind=memory_kind), specs, is_leaf=_is_spec
    )


def _tensor_specs(plan: Plan, mesh: Mesh, params: Any, param_specs: Any) -> Any:
    """The parameters' split over the non-data axes: `param_specs`, by default from the
    parameters' logical axis names, with a pipeline's stacked layers split over `pp`."""
    if param_specs is not None:
        check_param_specs(param_specs, params)
    specs = param_specs if param_specs is not None else partition_specs(params, mesh=mesh)
    if plan.pipeline is None:
        return specs
    if not isinstance(specs, PipelineParams):
        raise TypeError(
            "the strategy asks for a pipeline: the parameters must be the PipelineParams("
            f"embed, layers, head) the pipeline trains, not {type(specs).__name__}"
        )
    return _by_stage(specs)


def _by_stage(specs: PipelineParams) -> PipelineParams:
    """`specs` with the stacked layers' leading (layer) axis split over `pp`."""
    by_stage = lambda spec: PartitionSpec("pp", *tuple(spec)[1:])  # noqa: E731
    return specs._replace(layers=jax.tree.map(by_stage, specs.layers, is_leaf=_is_spec))


def _check_mp_used(mesh: Mesh, specs: Any) -> None:
    split = {a for s in jax.tree.leaves(specs, is_leaf=_is_spec) for a in spec_axes(s)}
    if mesh.shape.get("mp", 1) > 1 and "mp" not in split:
        raise ValueError(
            f"the mesh has an mp axis of size {mesh.shape['mp']}, but no parameter is "
            "split over it, so every mp device would compute the same: give parameters "
            "logical axis names (fleetjax.layers) or pass param_specs"
        )


def _zero_specs(plan: Plan, mesh: Mesh, specs: Any, params: Any) -> Any:
    """`specs` also split over `sharding` where ZeRO's rule finds a dimension (any stage);
    warns once for each large tensor that stays whole on every device. Sparse tables keep
    theirs (their rows are split over every device already)."""
    if not plan.sharding_stage:
        return specs

    def split(path: Any, spec: Any, x: Any) -> Any:
        if is_table(x):
            return spec
        zero, degree = zero_spec(spec, x.shape, mesh), mesh.shape.get("sharding", 1)
        if zero == spec and degree > 1 and math.prod(x.shape) >= ZERO_MIN_ELEMENTS:
            warn_once(
                f"ZeRO stage {plan.sharding_stage}: params{jax.tree_util.keystr(path)} "
                f"{list(x.shape)} has no dimension that splits over sharding={degree}, so every "
                "device keeps all of it (and its optimizer state); pad a dimension to a "
                f"multiple of {degree}"
            )
        return zero

    is_leaf = lambda s: _is_spec(s) or is_table(s)  # noqa: E731
    return jax.tree_util.tree_map_with_path(split, specs, params, is_leaf=is_leaf)


def param_shardings(plan: Plan, mesh: Mesh, params: Any, param_specs: Any = None) -> Any:
    """Where a train step's `init` takes `params` (arrays or `jax.ShapeDtypeStruct`s): split
    for tensor and pipeline parallelism and, under ZeRO stage 3, over `sharding`; replicated
    under per-replica optimizers (each replica's copy is made inside `init`)."""
    if plan.per_replica:
        return jax.tree.map(lambda _: replicated(mesh), params)
    specs = _tensor_specs(plan, mesh, params, param_specs)
    if plan.sharding_stage == 3:
        specs = _zero_specs(plan, mesh, specs, params)
    return in_host_memory(params, _shardings(mesh, specs))[0]


def model_state_shardings(
    mesh: Mesh, model_state: Any, state_specs: Any = None, *, pipeline: bool = False
) -> Any:
    """Where the model state lives: `state_specs`, by default read from logical axis names
    (a local `fleetjax.layers.BatchNorm`'s statistics split over the data axes; plain arrays
    replicated). Under a `pipeline` the layers' states (a `PipelineParams` model state) are
    split over `pp` like the layers' parameters: each with its layer's stage."""
    specs = state_specs if state_specs is not None else partition_specs(model_state, mesh=mesh)
    if pipeline and isinstance(specs, PipelineParams):
        specs = _by_stage(specs)
    return _shardings(mesh, specs)


def _opt_state_specs(optimizer: optax.GradientTransformation, opt_state: Any, specs: Any) -> Any:
    """The optimizer state's specs: each copy of the parameter tree in it as `specs`, the rest
    (step counts and the like) replicated. Traced, so that the optimizer's `init`, which optax
    runs to find the parameter trees, computes nothing."""
    found = []

    def trace() -> None:
        found.append(
            optax.tree_utils.tree_map_params(
                optimizer,
                lambda _, spec: spec,
                opt_state,
                specs,
                transform_non_params=lambda _: PartitionSpec(),
                is_leaf=_is_spec,
            )
        )

    jax.eval_shape(trace)
    return found[0]


def _opt_specs(
    optimizer: optax.GradientTransformation,
    opt_state: Any,
    params: Any,
    specs: Any,
    tables: Tables | None,
) -> Any:
    """The optimizer state's specs; with sparse tables (a `TablesState`) the dense part's as
    the optimizer keeps it, and the tables' slots as `tables` lays them out."""
    if tables is None:
        check_opt_state(optimizer, opt_state, params)
        return _opt_state_specs(optimizer, opt_state, specs)
    check_opt_state(optimizer, opt_state.dense, without_tables(params))
    dense = _opt_state_specs(optimizer, opt_state.dense, without_tables(specs, params))
    return tables.opt_specs(dense, opt_state, params, specs)


def vpp_degree(plan: Plan, model: PipelineLayer | None) -> int:
    """The pipeline's virtual stages: the strategy's `vpp_degree` or the model's
    `num_virtual_pipeline_stages`, which must agree where both are set."""
    asked = plan.pipeline.vpp_degree
    own = 1 if model is None else model.num_virtual_pipeline_stages
    if asked > 1 and own > 1 and asked != own:
        raise ValueError(
            f"Strategy.pipeline.vpp_degree={asked} but the PipelineLayer has "
            f"num_virtual_pipeline_stages={own}"
        )
    return max(asked, own)


def stage_order(
    plan: Plan, mesh: Mesh, model: PipelineLayer | None, abstract_state: TrainState
) -> StageOrder:
    """The pipeline's stage order for `model` (a `PipelineLayer`; None: as the plan alone
    says) on `mesh`, after checking that its parameters and model state split into the
    stages' chunks.

    Raises:
      ValueError: if the model was cut for another number of stages, the two vpp degrees
        disagree, or a layers' tree does not split into pp x vpp equal chunks.
    """
    vpp, stages = vpp_degree(plan, model), mesh.shape["pp"]
    if model is not None and model.num_stages is not None and model.num_stages != stages:
        raise ValueError(
            f"the PipelineLayer was cut for num_stages={model.num_stages}, but the mesh's pp "
            f"axis (pp_degree) has {stages}"
        )
    check_pipeline_layers(abstract_state.params, stages, vpp, "params")
    if abstract_state.model_state is not None:
        check_pipeline_layers(abstract_state.model_state, stages, vpp, "model_state")
    return StageOrder(stages, vpp)


def _stacked(plan: Plan) -> TrainState:
    """The parts of the state a per-replica optimizer keeps per replica: its state, and
    under LocalSGD the parameters."""
    if not plan.per_replica:
        return NOT_STACKED
    return NOT_STACKED._replace(params=plan.replica_params, opt_state=True)


def _grads_scattered(plan: Plan, mesh: Mesh) -> bool:
    """Whether each device keeps only its shard of the reduced gradients: ZeRO-2 and 3, and
    under a pipeline any stage (it accumulates its stage's whole gradients anyway and
    reduce-scatters them once per step, as Megatron's distributed optimizer does)."""
    if plan.per_replica or mesh.shape.get("sharding", 1) == 1:
        return False
    return plan.sharding_stage >= 2 or bool(plan.pipeline is not None and plan.sharding_stage)


def place(
    plan: Plan,
    mesh: Mesh,
    abstract_state: TrainState,
    optimizer: optax.GradientTransformation,
    *,
    model: Loss | None = None,
    tables: Tables | None = None,
    param_specs: Any = None,
    state_specs: Any = None,
) -> Placement:
    """The `Placement` of a train step under `plan` on `mesh`, for a state with the shapes of
    `abstract_state` (`jax.ShapeDtypeStruct`s; a per-replica part stacked or not) and its
    `optimizer`. Nothing is computed.

    The layout's inputs: the plan (its degrees and switches), the parameters' own split
    (`param_specs`, a `PartitionSpec` per tensor given by the user, else their logical axis
    names), the model state's (`state_specs`), the step's sparse tables (`tables`, which lay
    out their rows and slots) and, under a pipeline, the `model` (a `PipelineLayer`: its
    virtual stages).

    Raises:
      ValueError: if the mesh has an `mp` axis but no parameter is split over it, or a
        pipeline's layers do not split into its stages.
      TypeError: if the plan has a pipeline and the parameters are not `PipelineParams`.
    """
    rep = replicated(mesh)
    params = abstract_state.params
    stacked, scattered = _stacked(plan), _grads_scattered(plan, mesh)
    order = None if plan.pipeline is None else stage_order(plan, mesh, model, abstract_state)
    if plan.per_replica:
        per_replica = NamedSharding(mesh, PartitionSpec(data_axes(mesh)))
        params_at = jax.tree.map(lambda _: per_replica if stacked.params else rep, params)
        opt_at = in_update = jax.tree.map(lambda _: per_replica, abstract_state.opt_state)
        grads = None
    else:
        specs = _tensor_specs(plan, mesh, params, param_specs)
        _check_mp_used(mesh, specs)
        zero = _zero_specs(plan, mesh, specs, params)
        opt_specs = _opt_specs(optimizer, abstract_state.opt_state, params, zero, tables)
        params_at = _shardings(mesh, zero if plan.sharding_stage == 3 else specs)
        memory = "pinned_host" if plan.optimizer_offload else "device"
        in_update = in_host_memory(params, params_at, _shardings(mesh, opt_specs))[1]
        params_at, opt_at = in_host_memory(params, params_at, _shardings(mesh, opt_specs, memory))
        grad_specs = zero if scattered else specs
        if tables is not None:
            grad_specs = tables.grad_specs(grad_specs, params)
        grads = _shardings(mesh, grad_specs)
    state = TrainState(
        step=rep,
        params=params_at,
        opt_state=opt_at,
        rng=rep,
        loss_scale=None if abstract_state.loss_scale is None else rep,
        model_state=model_state_shardings(
            mesh, abstract_state.model_state, state_specs, pipeline=plan.pipeline is not None
        ),
    )
    replicas = data_parallel_size(mesh)
    return Placement(
        state, grads, batch_sharding(mesh), in_update, stacked, replicas, scattered, order
    )
