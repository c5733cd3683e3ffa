"""`pipeline`: Paddle's pipeline parallelism (`pipeline`, `pipeline_configs`) as one SPMD program.

The model is ``embed -> stage (once per layer) -> head_loss``. The layers' parameters are
stacked on a leading layer axis split over the mesh axis ``pp``: each of the P stages owns L / P
consecutive layers or, with V virtual stages (VPP), V chunks of L / (P V) layers taken
round-robin. Each data-parallel replica's rows are cut into ``accumulate_steps`` micro-batches of
``micro_batch_size`` rows; the loss is the mean of the micro-batch losses, as in Paddle.

One `jax.shard_map` over ``pp`` alone runs a `lax.scan` over the ticks of a schedule table (see
`pipeline_schedule`). In a tick every stage runs, each under its own `lax.cond`, the forward
and then the backward the table gives it (under the zero-bubble schedules ZBH1 and ZBVPP the
backward's input-gradient half B, then a weight-gradient half W, of the same or an earlier
micro-batch: `_split`); then activations `ppermute` to the next stage and cotangents to the
previous one. A forward keeps its `jax.vjp` residuals in a buffer slot until
its backward reads them. Under 1F1B the buffer is a ring of 2 P - 1 slots whatever m is
(Paddle's MPMD 1F1B holds P: here a hop between stages costs a whole tick), so activation memory
does not grow with the number of micro-batches; under FThenB it holds all m.

The `shard_map` is also over the data axes (``dp``, ``sharding``): each device runs its own
replica's micro-batches and accumulates its own gradients, which are reduced over the data axes
once, after the pipeline's loop, by a `reducer` (an all-reduce; a reduce-scatter under ZeRO;
`fp16_allreduce`'s half-precision all-reduce). ``mp`` stays with the compiler. The loop is cut
into a warm-up, a steady state and a cool-down, so a tick sends only what some stage needs.
Parameters that the model converts to half precision (AMP) before every use are converted once
per step, and the kept residuals of a recomputed stage are its layers' inputs alone.

The parts, each a module: `_model` (`PipelineParams`, `PipelineLayer`, the parts' keys and the
layers' order), `_layers` (Paddle's `LayerDesc` list form of a `PipelineLayer`), `schedules`
(the schedule tables and `SCHEDULE_MODES`, Paddle's spellings of them), `_simulation` (how a
table is made), `_timetable` (a schedule made executable: the buffer slot of every value kept
across ticks, and its segments),
`_program` (the `shard_map`), `_layout` (its axes and specs), `_shapes` (what it is built
for), `_casts` (weights cast once per step), `_stage` (the per-stage program: a tick's forward
half and its backward half), `_chunk` (a chunk's layers forward and backward), `_split` (a
layer's backward cut into B and W), `_values` (buffers and sums). This module checks the
arguments and runs the program, on Auto axes.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, PartitionSpec

from fleetjax.transforms.grad_allreduce import Reducer
from fleetjax.transforms.pipeline._layers import LayerDesc, SharedLayerDesc
from fleetjax.transforms.pipeline._model import (
    NO_KEY,
    ModelFunctions,
    PipelineLayer,
    PipelineParams,
    part_keys,
    raw_key,
    to_model_order,
    to_pipeline_order,
)
from fleetjax.transforms.pipeline._program import AXIS, program
from fleetjax.transforms.pipeline.schedules import (
    SCHEDULE_MODES,
    PipelineSchedule,
    pipeline_schedule,
)

__all__ = [
    "SCHEDULE_MODES",
    "LayerDesc",
    "PipelineLayer",
    "PipelineParams",
    "PipelineSchedule",
    "SharedLayerDesc",
    "part_keys",
    "pipeline",
    "pipeline_schedule",
    "to_model_order",
    "to_pipeline_order",
]


def pipeline(
    embed: Callable[[Any, Any], Any],
    stage: Callable[[Any, Any], Any],
    head_loss: Callable[[Any, Any, Any], jax.Array],
    *,
    mesh: Mesh,
    micro_batch_size: int,
    accumulate_steps: int,
    schedule_mode: str = "1F1B",
    vpp_degree: int = 1,
    has_aux: bool = False,
    has_rng: bool = False,
    has_state: bool = False,
    reducer: Reducer | None = None,
    param_specs: PipelineParams | None = None,
    grad_specs: PipelineParams | None = None,
) -> Callable[..., tuple[Any, PipelineParams]]:
    """The loss and gradients of a layered model, pipelined over the mesh axis ``pp``.

    Paddle's `pipeline` with `pipeline_configs` (`micro_batch_size`, `accumulate_steps`,
    `schedule_mode`) and `Strategy.pipeline.vpp_degree`.

    Args:
      embed: ``embed(params.embed, micro_batch) -> activations`` (an array or a pytree), run by
        the first stage; it runs again in that stage's backward (its residuals are not kept).
      stage: ``stage(layer_params, activations) -> activations`` for one layer, with the same
        shapes and dtypes out as in; wrap it in `jax.checkpoint` to recompute inside stages.
      head_loss: ``head_loss(params.head, activations, micro_batch) -> scalar`` (or, with
        `has_aux`, ``-> (scalar, aux)``), run by the last stage.
      mesh: a mesh with a ``pp`` axis; the others (``dp``, ``sharding``, ``mp``) are left to
        the compiler, and the batch is split over ``dp`` x ``sharding``.
      micro_batch_size: rows in a micro-batch of one data-parallel replica.
      accumulate_steps: micro-batches per step, m.
      schedule_mode: "1F1B" (default), "Eager1F1B", "FThenB" (or "F-then-B"), "VPP", or the
        zero-bubble "ZBH1" and "ZBVPP" (see `pipeline_schedule`).
      vpp_degree: model chunks per stage for "VPP" and "ZBVPP" (at least 2; then m >=
        pp_degree).
      has_aux: whether `head_loss` also returns a pytree of metrics (accuracy, ...): they come
        back in float32, averaged over the micro-batches and replicas as the loss is.
      has_rng: whether `embed`, `stage` and `head_loss` take a PRNG key (raw key data) as
        their last argument, for dropout and the like: each part of each micro-batch of each
        replica gets its own, derived from the step's key by `part_keys`.
      has_state: whether the model has variables the loss updates but gradients do not train
        (batch-norm statistics): a `PipelineParams` of the parts' states, the layers' stacked
        on the layer axis and split over ``pp`` like their parameters. Each function then takes
        its part's state after its parameters and returns its new state last:
        ``embed(params, state, micro_batch) -> (activations, new_state)``, ``stage(params,
        state, activations) -> (activations, new_state)``, ``head_loss(params, state,
        activations, micro_batch) -> (loss, new_state)`` (``(loss, aux, new_state)`` with
        `has_aux`). Every micro-batch sees the state given; of the new states, the floating
        ones are averaged over every replica's micro-batches (as in-step gradient merge
        averages its micro-batches') and the others are the last micro-batch's.
      reducer: how each data-parallel replica's gradients (the mean over its micro-batches)
        are reduced over the data axes, e.g. `grad_allreduce.mean_in(jnp.float16)` for
        Paddle's `fp16_allreduce` or `grad_allreduce.scatter_mean(specs)` for ZeRO; it runs at
        the end of each stage's program, inside the `shard_map`. Default: their mean
        (`grad_allreduce.mean_in(jnp.float32)`, an all-reduce).
      param_specs: where the parameters are (`PartitionSpec`s, or a prefix of them, in a
        `PipelineParams`); default whole on the data axes and the layers split over ``pp``.
        A parameter split over a data axis (ZeRO-3) is gathered in each tick that runs it.
      grad_specs: where the reducer leaves the gradients (as `param_specs`): split over
        ``sharding`` where it reduce-scatters them; default whole on the data axes.

    Returns:
      ``value_and_grad(params, batch[, key], *, loss_scale=None) -> (loss, grads)`` for a
      `PipelineParams` and a batch (and, with `has_rng`, the step's PRNG key) whose leaves have
      ``micro_batch_size * accumulate_steps`` rows per data-parallel replica: the loss is the
      mean of the micro-batch losses (over all replicas), and the gradients are exactly its
      gradients, in a `PipelineParams` with the layers' split over ``pp``. With `has_aux`,
      ``((loss, aux), grads)``. With a `loss_scale` (a float32 scalar; AMP's loss scaling),
      the head's loss is multiplied by it before the backward, so the backward runs on scaled
      cotangents and the gradients come back times `loss_scale`; the loss and aux do not.
      With `has_state`, ``value_and_grad(params, model_state, batch[, key])`` returns
      ``((loss, new_model_state), grads)`` (``((loss, aux, new_model_state), grads)`` with
      `has_aux`).

    Raises:
      ValueError: for a mesh without ``pp``, an unknown schedule, or counts Paddle does not
        allow; when called, for a batch of the wrong size, layers that do not split into
        pp_degree x vpp_degree chunks, a `stage` that changes the activations' shape, a part
        whose new model state differs from its state in structure, shape or dtype, or a
        `loss_scale` that is not a scalar.
    """
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh must have a 'pp' axis for the pipeline, got axes {mesh.axis_names}")
    size = micro_batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {size!r}")
    schedule = pipeline_schedule(schedule_mode, mesh.shape[AXIS], accumulate_steps, vpp_degree)
    flags = {"has_aux": has_aux, "has_rng": has_rng, "has_state": has_state}
    model = ModelFunctions.of(embed, stage, head_loss, **flags)
    run = program(model, schedule, mesh, size, reducer, param_specs, grad_specs)

    def value_and_grad(
        params: PipelineParams, *args: Any, loss_scale: jax.Array | None = None
    ) -> tuple[Any, PipelineParams]:
        state = args[0] if has_state else PipelineParams((), (), ())
        batch, *key = args[1:] if has_state else args
        for name, value in (("params", params), ("model_state", state)):
            if not isinstance(value, PipelineParams):
                raise TypeError(
                    f"{name} must be a fleetjax PipelineParams(embed, layers, head), "
                    f"got {type(value).__name__}"
                )
        if len(key) != has_rng:
            form = f"params, {'model_state, ' * has_state}batch{', key' * has_rng}"
            raise TypeError(
                f"the pipeline was made with has_rng={has_rng}, has_state={has_state}: call it "
                f"as value_and_grad({form})"
            )
        key = jnp.asarray(NO_KEY) if not key else raw_key(key[0])
        inputs = (params, state, batch, key, _scalar(loss_scale))
        (loss, aux), new_state, grads = _on_auto_axes(run, mesh, *inputs)
        out = (loss, *[aux] * has_aux, *[new_state] * has_state)
        return (out if len(out) > 1 else loss), grads

    return value_and_grad


def _on_auto_axes(
    run: Callable[..., tuple[Any, PipelineParams, PipelineParams]],
    mesh: Mesh,
    params: PipelineParams,
    model_state: PipelineParams,
    *args: Any,
) -> tuple[Any, PipelineParams, PipelineParams]:
    """``run(params, model_state, *args)`` on the mesh's Auto axes.

    On Explicit axes the pipeline runs on Auto ones (as jnp runs a sharded gather), its buffers
    and branches then typed alike; the new model state and the gradients come back placed as
    the model state and the params.
    """
    explicit = tuple(
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    )
    if not explicit:
        return run(params, model_state, *args)
    placed = lambda tree: jax.tree.map(lambda x: jax.typeof(x).sharding.spec, tree)  # noqa: E731
    out = (PartitionSpec(), placed(model_state), placed(params))
    auto = jax.sharding.auto_axes(run, axes=explicit, out_sharding=out)
    outside_jit = jax.sharding.get_abstract_mesh().empty
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if outside_jit else nullcontext():
        return auto(params, model_state, *args)


def _scalar(loss_scale: Any) -> jax.Array | None:
    """`loss_scale` as a float32 scalar (None stays None).

    Raises:
      ValueError: if it is not a scalar.
    """
    if loss_scale is None:
        return None
    scale = jnp.asarray(loss_scale, jnp.float32)
    if scale.shape != ():
        raise ValueError(f"loss_scale must be a scalar, got an array of shape {scale.shape}")
    return scale
