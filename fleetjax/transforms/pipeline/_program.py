"""The pipeline's SPMD program: one `shard_map` over ``pp`` and the data axes that runs a
timetable tick by tick.

`program` splits the batch into micro-batches and runs the per-stage program (`_stage.Stage`)
as the body of the `shard_map`: per segment of the timetable (warm-up, steady state,
cool-down) a `lax.scan` over its rows.

Each device runs its own data-parallel replica's micro-batches (the data axes are manual, so
the compiler never moves a replica's gradients or activations), accumulates whole float32
gradients of its stage, and reduces them over the data axes once, after the loop, with the
reducer: a reduce-scatter where the gradients are split over ``sharding`` (ZeRO), an
all-reduce otherwise. ``mp`` stays with the compiler (`_layout`). Parameters that the model
converts to half precision before every use are converted once per step, before the loop
(`_casts`); under ZeRO-3 each tick gathers the (converted) shards it runs on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleetjax.mesh import constrain, data_axes, data_parallel_size
from fleetjax.transforms.grad_allreduce import Reducer, mean_in
from fleetjax.transforms.pipeline._layout import AXIS, BY_STAGE, WHOLE, Layout
from fleetjax.transforms.pipeline._model import ModelFunctions, PipelineParams
from fleetjax.transforms.pipeline._shapes import shapes_of
from fleetjax.transforms.pipeline._stage import Stage
from fleetjax.transforms.pipeline._timetable import timetable
from fleetjax.transforms.pipeline.schedules import PipelineSchedule

__all__ = ["AXIS", "program"]


def program(
    model: ModelFunctions,
    schedule: PipelineSchedule,
    mesh: Mesh,
    micro_batch_size: int,
    reducer: Reducer | None = None,
    param_specs: PipelineParams | None = None,
    grad_specs: PipelineParams | None = None,
) -> Callable[..., tuple[tuple[jax.Array, Any], PipelineParams, PipelineParams]]:
    """The pipeline of `model` on `mesh`: ``run(params, model_state, batch, key, loss_scale) ->
    ((loss, aux), new_model_state, grads)``, `key` raw key data, `loss_scale` a float32 scalar
    or None, `model_state` a `PipelineParams` of the parts' states (``()`` for none).

    The loss and metrics are the means over every replica's micro-batches; the gradients are
    the loss's, times `loss_scale` when there is one (the loss and metrics are not scaled),
    reduced over the data axes by `reducer` (default: their mean, an all-reduce) and split as
    `grad_specs` says (`PartitionSpec`s like the parameters, or a prefix of them; default whole
    over the data axes, which a reducer that scatters must not leave them). `param_specs` says
    where the parameters are (default whole over the data axes): a parameter split over a data
    axis (ZeRO-3) is gathered in each tick that uses it. Every micro-batch sees `model_state`;
    of the new states, the floating ones are averaged over every replica's micro-batches and
    the others are the last micro-batch's (of the last replica), as
    `gradient_merge.microbatched` does.
    """
    table = timetable(schedule)
    reducer = reducer if reducer is not None else mean_in(jnp.float32)

    def run(
        params: PipelineParams,
        model_state: PipelineParams,
        batch: Any,
        key: jax.Array,
        loss_scale: jax.Array | None,
    ) -> tuple[tuple[jax.Array, Any], PipelineParams, PipelineParams]:
        micro = micro_batches_of(batch, mesh, micro_batch_size, schedule.micro_batches)
        shapes = shapes_of(model, schedule, params, model_state, micro)
        layout = Layout.of(mesh, params, param_specs, grad_specs)
        scales = () if loss_scale is None else (loss_scale,)

        def per_stage(params: PipelineParams, model_state: PipelineParams, micro: Any, *rest: Any):
            stage = Stage(model, schedule, layout, shapes, params, model_state, micro, *rest)
            carry = stage.start(table)
            for segment in table.segments:
                rows = jnp.asarray(table.table[segment.start : segment.stop])
                carry, _ = lax.scan(functools.partial(stage.tick, segment), carry, rows)
            return stage.results(carry, reducer)

        context = jax.sharding.get_abstract_mesh()  # under auto_axes: this mesh, Auto typed
        by_replica = PartitionSpec(None, layout.data or None)  # [m, replicas, ...]
        (loss, aux), new_state, grads = jax.shard_map(
            per_stage,
            mesh=mesh if context.empty else context,
            axis_names=layout.manual,
            in_specs=(layout.params, BY_STAGE, by_replica, WHOLE, *[WHOLE] * len(scales)),
            out_specs=((WHOLE, WHOLE), BY_STAGE, layout.grads),
            # Values equal on every replica (a hierarchical reducer's ring results) that JAX
            # cannot prove equal; inside, each device's gradients are its own.
            check_vma=False,
        )(params, model_state, micro, key, *scales)
        return (loss, aux), new_state, grads

    return run


def micro_batches_of(batch: Any, mesh: Mesh, micro_batch_size: int, accumulate_steps: int) -> Any:
    """[replicas * m * b, ...] -> [m, replicas, b, ...]. As in Paddle, micro-batch i of a
    replica is rows [i b, (i + 1) b) of that replica's rows.

    Raises:
      ValueError: for leaves of different batch sizes, or a size other than replicas x m x b.
    """
    sizes = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every batch leaf needs the same leading (batch) size, got {sizes}")
    (size,) = sizes
    replicas = data_parallel_size(mesh)
    if size != replicas * micro_batch_size * accumulate_steps:
        needed = replicas * micro_batch_size * accumulate_steps
        raise ValueError(
            f"a pipeline batch has data-parallel replicas x micro_batch_size x accumulate_steps "
            f"= {replicas} x {micro_batch_size} x {accumulate_steps} = {needed} rows, got "
            f"{size}: pass {needed} rows, or change pipeline_configs' micro_batch_size or "
            "accumulate_steps (each replica's rows are accumulate_steps micro-batches)"
        )

    def cut(x: jax.Array) -> jax.Array:
        x = x.reshape(replicas, accumulate_steps, micro_batch_size, *x.shape[1:])
        return x.swapaxes(0, 1)

    by_replica = NamedSharding(mesh, PartitionSpec(None, data_axes(mesh) or None))
    return constrain(jax.tree.map(cut, batch), by_replica)
