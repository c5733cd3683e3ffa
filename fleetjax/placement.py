"""Placement: where the train state, the gradients and the batch live on the mesh.

`place(plan, mesh, abstract_state, optimizer)` computes it once, from shapes alone (nothing
runs, so it works for meshes of compile-only devices too):

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

`TrainStep`, `explain` and `fleet.distributed_model` all read this one placement.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleetjax._checks import check_opt_state, check_param_specs
from fleetjax._warnings import warn_once
from fleetjax.layers import is_table, partition_specs
from fleetjax.layers.sparse_embedding import on_host
from fleetjax.mesh import (
    ZERO_MIN_ELEMENTS,
    batch_sharding,
    data_axes,
    replicated,
    spec_axes,
    zero_spec,
)
from fleetjax.plan import Plan
from fleetjax.train_state import TrainState
from fleetjax.transforms.pipeline import PipelineParams
from fleetjax.transforms.sparse_rows import TablesState, tables, without_tables

__all__ = ["Placement", "model_state_shardings", "param_shardings", "place"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each part of a train step's data lives: `NamedSharding`s shaped like it.

    Attributes:
      state: a `TrainState` of shardings (a prefix of the state's pytree).
      grads: the reduced gradients' shardings, like the parameters; None under per-replica
        optimizers (DGC, LocalSGD), where each replica keeps its own full gradient.
      batch: the batch's sharding (every leaf split on its leading dimension).
      opt_state_in_update: where the update reads the optimizer state: as `opt_state`, but an
        offloaded state (`optimize_offload`) in device memory (host tables' slots stay).
    """

    state: TrainState
    grads: Any | None
    batch: NamedSharding
    opt_state_in_update: Any = None

    @property
    def params(self) -> Any:
        return self.state.params

    @property
    def opt_state(self) -> Any:
        return self.state.opt_state

    @property
    def model_state(self) -> Any:
        return self.state.model_state

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


def _pinned(sharding: NamedSharding) -> NamedSharding:
    """`sharding` in pinned host memory. Compile-only devices have no memory spaces, so their
    shardings drop the kind; one on the mesh's abstract mesh keeps it, and a step lowered for
    them (under `jax.set_mesh`) keeps the array in host memory as XLA does for real devices."""
    host = sharding.with_memory_kind("pinned_host")
    if host.memory_kind == "pinned_host":
        return host
    return NamedSharding(sharding.mesh.abstract_mesh, sharding.spec, memory_kind="pinned_host")


def _host_tables(params: Any, params_at: Any, opt_at: Any = None) -> tuple[Any, Any]:
    """`params_at` and `opt_at` (shardings) with the rows and the slots of the tables made with
    ``memory_kind="pinned_host"`` in pinned host memory."""

    def rows(at: Any, p: Any) -> Any:
        if not (is_table(p) and on_host(p)):
            return at
        return at.replace(_pinned(at.get_value())) if is_table(at) else _pinned(at)

    params_at = jax.tree.map(rows, params_at, params, is_leaf=is_table)
    if isinstance(opt_at, TablesState):
        host = {name for name, table in tables(params).items() if on_host(table)}
        pinned = lambda name, at: jax.tree.map(_pinned, at) if name in host else at  # noqa: E731
        opt_at = opt_at._replace(slots={n: pinned(n, at) for n, at in opt_at.slots.items()})
    return params_at, opt_at


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
    return _host_tables(params, _shardings(mesh, specs))[0]


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


def _slot_specs(opt_state: TablesState, params: Any, specs: Any) -> tuple[dict, dict | None]:
    """(slots, geo) specs of a `TablesState`: split over the axes of their table's rows, which
    `specs` (shaped like `params`) give."""
    row_axes = {}

    def note(table: Any, spec: Any) -> None:
        if is_table(table):
            spec = spec.get_value() if is_table(spec) else spec  # nnx keeps the wrapper
            name = table.get_metadata()["table_name"]
            if not isinstance(spec, PartitionSpec) or not spec:
                raise ValueError(
                    f"param_specs gives sparse table {name!r} {spec!r}, which splits none of its "
                    "axes; a table's rows are split over the mesh, its spec names their axes "
                    "first (fleetjax.layers.partition_specs gives each table's)"
                )
            row_axes[name] = PartitionSpec(spec[0])

    jax.tree.map(note, params, specs, is_leaf=is_table)

    def by_name(tree: dict[str, Any]) -> dict[str, Any]:
        return {name: jax.tree.map(lambda _, s=row_axes[name]: s, v) for name, v in tree.items()}

    return by_name(opt_state.slots), None if opt_state.geo is None else by_name(opt_state.geo)


def _opt_specs(optimizer: optax.GradientTransformation, opt_state: Any, params: Any, specs: Any):
    """The optimizer state's specs; with sparse tables (a `TablesState`) the dense part's as
    the optimizer keeps it, the tables' slots split as their rows."""
    if not isinstance(opt_state, TablesState):
        check_opt_state(optimizer, opt_state, params)
        return _opt_state_specs(optimizer, opt_state, specs)
    check_opt_state(optimizer, opt_state.dense, without_tables(params))
    dense = _opt_state_specs(optimizer, opt_state.dense, without_tables(specs, params))
    return TablesState(dense, *_slot_specs(opt_state, params, specs))


def _rows_whole(specs: Any, params: Any) -> Any:
    """`specs` with a sparse table's gradient (its touched rows) whole on every device."""

    def whole(spec: Any, x: Any) -> Any:  # shaped as the gradient: a SparseTable of rows
        return x.replace(PartitionSpec()) if is_table(x) else spec

    return jax.tree.map(whole, specs, params, is_leaf=lambda s: _is_spec(s) or is_table(s))


def place(
    plan: Plan,
    mesh: Mesh,
    abstract_state: TrainState,
    optimizer: optax.GradientTransformation,
    *,
    param_specs: Any = None,
    state_specs: Any = None,
) -> Placement:
    """The `Placement` of a train step under `plan` on `mesh`, for a state with the shapes of
    `abstract_state` (`jax.ShapeDtypeStruct`s) and its `optimizer`. Nothing is computed.

    Raises:
      ValueError: if the mesh has an `mp` axis but no parameter is split over it.
      TypeError: if the plan has a pipeline and the parameters are not `PipelineParams`.
    """
    rep = replicated(mesh)
    params = abstract_state.params
    if plan.per_replica:
        stacked = NamedSharding(mesh, PartitionSpec(data_axes(mesh)))
        params_at = jax.tree.map(lambda _: stacked if plan.replica_params else rep, params)
        opt_at = in_update = jax.tree.map(lambda _: stacked, abstract_state.opt_state)
        grads = None
    else:
        specs = _tensor_specs(plan, mesh, params, param_specs)
        _check_mp_used(mesh, specs)
        zero = _zero_specs(plan, mesh, specs, params)
        memory = "pinned_host" if plan.optimizer_offload else "device"
        opt_specs = _opt_specs(optimizer, abstract_state.opt_state, params, zero)
        params_at = _shardings(mesh, zero if plan.sharding_stage == 3 else specs)
        in_update = _host_tables(params, params_at, _shardings(mesh, opt_specs))[1]
        params_at, opt_at = _host_tables(params, params_at, _shardings(mesh, opt_specs, memory))
        # A pipeline accumulates its stage's whole gradients anyway and reduce-scatters them
        # once per step under any ZeRO stage (as Megatron's distributed optimizer does).
        scattered = plan.sharding_stage >= 2 or (plan.pipeline is not None and plan.sharding_stage)
        grads = _shardings(mesh, _rows_whole(zero if scattered else specs, params))
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
    return Placement(state, grads, batch_sharding(mesh), in_update)
