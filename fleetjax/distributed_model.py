"""`fleet.distributed_model`: a model's parameters placed on the mesh as the strategy says, and
its batch norms computing statistics as `sync_batch_norm` says."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from fleetjax._warnings import warn_once
from fleetjax.layers import BatchNorm
from fleetjax.layers.batch_norm import convert_batch_norm
from fleetjax.mesh import data_parallel_size
from fleetjax.placement import model_state_shardings, param_shardings
from fleetjax.plan import Plan, read_plan
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.transforms.pipeline import PipelineParams

__all__ = ["distributed_model"]


def _place_nnx(model: nnx.Module, plan: Plan, mesh: Mesh) -> None:
    """A module's variables placed as a train step places them: its `nnx.Param`s as the
    parameters, the rest (batch-norm statistics) as the model state."""
    params, rest = nnx.state(model, nnx.Param, ...)
    params = jax.device_put(params, param_shardings(plan, mesh, params))
    nnx.update(model, params, jax.device_put(rest, model_state_shardings(mesh, rest)))


def distributed_model(
    model: Any,
    strategy: DistributedStrategy | Strategy,
    mesh: Mesh,
    *,
    param_specs: Any = None,
) -> Any:
    """`model` with its arrays placed on `mesh` as a train step under `strategy` places them
    (Paddle's `fleet.distributed_model`).

    A flax nnx Module is changed in place and returned (the same object, unless it is itself a
    BatchNorm that is converted): its variables are placed by their logical axis names, and
    under a `DistributedStrategy` every `nnx.BatchNorm` becomes a `fleetjax.layers.BatchNorm`
    with the same parameters, statistics and settings, and every BatchNorm computes its
    statistics over all data-parallel replicas if `sync_batch_norm` is True, else over each
    replica's own rows, as Paddle's `BatchNorm` does under data parallelism. (An
    `nnx.BatchNorm` under `jax.jit` normalizes over the whole global batch.) A `Strategy` has no
    `sync_batch_norm`: its BatchNorms are kept, and fleetjax ones laid out for the mesh.

    Flax linen variables (with `nn.LogicallyPartitioned` boxes) and plain pytrees of arrays are
    returned placed; `param_specs` (a pytree of `PartitionSpec`s like them) overrides the
    logical names. Under a pipeline, pass the `PipelineParams` the step trains.

    Raises:
      TypeError: for `param_specs` with an nnx Module, or a model that is not `PipelineParams`
        under a pipeline.
      ValueError: for an `nnx.BatchNorm` that cannot be converted (it averages its statistics
        over a named axis itself, or computes a two-pass variance).
    """
    plan = read_plan(strategy)
    if plan.pipeline is not None and not isinstance(model, PipelineParams):
        raise TypeError(
            "the strategy asks for a pipeline: pass the model's PipelineParams(embed, layers, "
            "head), the parameters the step trains with fleetjax.PipelineLayer, not "
            f"{type(model).__name__}"
        )
    if not isinstance(model, nnx.Module):
        _note_linen_batch_norm(model, plan, mesh)
        return jax.device_put(model, param_shardings(plan, mesh, model, param_specs))
    if param_specs is not None:
        raise TypeError(
            "param_specs is for pytrees of arrays; an nnx Module places its parameters by the "
            "logical axis names they carry (nnx.with_partitioning, fleetjax.layers)"
        )
    model = _convert_batch_norms(model, plan, data_parallel_size(mesh))
    _place_nnx(model, plan, mesh)
    return model


# -- batch norm --------------------------------------------------------------------------------


def _convert_batch_norms(model: nnx.Module, plan: Plan, replicas: int) -> nnx.Module:
    """Every BatchNorm of `model` set to `sync_batch_norm` (nnx ones converted); fleetjax
    BatchNorms of a `Strategy` keep their mode and get one statistics row per replica."""
    sync = plan.sync_batch_norm
    for path, node in list(nnx.iter_graph(model)):
        if isinstance(node, BatchNorm):
            # Paddle converts to SyncBatchNorm, never back: an explicit sync layer stays sync.
            target = node.sync or bool(sync)
            if (node.sync, node.groups) != (target, 1 if target else replicas):
                convert_batch_norm(node, sync=target, replicas=replicas)
        elif isinstance(node, nnx.BatchNorm) and sync is not None:
            converted = _from_flax(node, sync, replicas, path)
            if not path:
                return converted
            _replace(model, path, converted)
    return model


def _from_flax(layer: nnx.BatchNorm, sync: bool, replicas: int, path: tuple) -> BatchNorm:
    """A `fleetjax.layers.BatchNorm` that computes what `layer` does, with `sync` statistics."""
    where = "model" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)
    if layer.axis_name is not None or layer.axis_index_groups is not None:
        raise ValueError(
            f"{where} is an nnx.BatchNorm with axis_name={layer.axis_name!r}: it averages its "
            "statistics over that axis itself, which fleetjax cannot take over. Build it "
            "without axis_name (DistributedStrategy.sync_batch_norm then decides) or use "
            "fleetjax.layers.BatchNorm"
        )
    if not layer.use_fast_variance:
        raise ValueError(
            f"{where} is an nnx.BatchNorm with use_fast_variance=False (a two-pass variance); "
            "fleetjax.layers.BatchNorm computes the variance in one pass from the sum and the "
            "sum of squares, which sync all-reduces together. Build it with "
            "use_fast_variance=True (flax's default)"
        )
    converted = BatchNorm(
        layer.num_features,
        sync=sync,
        replicas=replicas,
        axis=layer.axis,
        momentum=layer.momentum,
        epsilon=layer.epsilon,
        use_running_average=layer.use_running_average,
        use_scale=layer.use_scale,
        use_bias=layer.use_bias,
        dtype=layer.dtype,
        param_dtype=layer.param_dtype,
    )
    if layer.use_scale:
        converted.scale[...] = layer.scale[...]
    if layer.use_bias:
        converted.bias[...] = layer.bias[...]
    for name in ("mean", "var"):  # every replica's row starts from the layer's statistics
        rows = getattr(converted, name)
        rows[...] = jax.numpy.broadcast_to(getattr(layer, name)[...], rows[...].shape)
    return converted


def _replace(model: nnx.Module, path: tuple, new: nnx.Module) -> None:
    """Put `new` at `path` in `model` (attributes by name, nnx.List / nnx.Dict items by key)."""
    parent = model
    for key in path[:-1]:
        parent = parent[key] if isinstance(key, int) else getattr(parent, key)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)


def _note_linen_batch_norm(variables: Any, plan: Plan, mesh: Mesh) -> None:
    """Linen modules cannot be rebuilt from their variables: say what their BatchNorms do."""
    has_stats = isinstance(variables, dict) and "batch_stats" in variables
    local = plan.sync_batch_norm is False
    if has_stats and local and data_parallel_size(mesh) > 1:
        warn_once(
            "fleet.distributed_model cannot convert flax linen BatchNorm layers (only their "
            "variables are given): under jax.jit they normalize over the whole global batch, "
            "as sync_batch_norm=True does, not over each replica's rows as Paddle's BatchNorm "
            "does with sync_batch_norm=False. Use fleetjax.layers.BatchNorm for that"
        )
