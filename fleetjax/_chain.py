"""The gradient chain: the one place that composes a strategy's gradient transforms.

    autocast --> value_and_grad (or the pipeline) --> micro-batching --> reducer, traced
    under recompute

* `amp.autocast` runs the loss (each part of a `PipelineLayer`) at the plan's precisions;
* the loss, multiplied by the loss scale under AMP loss scaling, is differentiated by
  `value_and_grad`, or by the `pipeline` over `pp`, which accumulates its micro-batches (the
  in-step merge's) and reduces over the data axes itself, with the reducer below where there
  is one;
* `gradient_merge.microbatched` splits the batch into the in-step merge's micro-batches;
* a reducer over the data axes (`grad_allreduce.data_parallel`) where the strategy controls
  the communication: fp16_allreduce, ZeRO-2/3's reduce-scatter, hierarchical all-reduce, or
  in-step merge (reduced once, not once per micro-batch). Otherwise XLA inserts the
  all-reduce itself, and per-replica optimizers (DGC, LocalSGD) communicate themselves;
* all of it is traced in a `recompute.recompute_scope`, where the layers marked with
  `fleetjax.recompute` are rematerialised by the plan's policy, and under
  `mp_configs.recompute_allgather` (`fleetjax.layers.sequence_parallel_options`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from fleetjax.layers import sequence_parallel_options
from fleetjax.mesh import data_axes, data_parallel_size, restrict
from fleetjax.placement import Loss, Placement
from fleetjax.plan import Plan
from fleetjax.transforms import amp, grad_allreduce, gradient_merge, recompute
from fleetjax.transforms.grad_fn import GradFn, Outputs, value_and_grad
from fleetjax.transforms.loss_scale import DynamicLossScale
from fleetjax.transforms.pipeline import PipelineLayer, pipeline


class Signature(NamedTuple):
    """What the user's loss takes and returns (`make_train_step`'s flags)."""

    has_aux: bool = False
    has_rng: bool = False
    has_state: bool = False


def grad_chain(
    loss_fn: Loss,
    plan: Plan,
    mesh: Mesh,
    placement: Placement,
    signature: Signature,
    loss_scale: DynamicLossScale | None = None,
    *,
    reduce: bool = True,
) -> GradFn:
    """The step's gradient function: `(params, model_state, batch[, key]) -> (Outputs, grads)`.

    `reduce=False` leaves the gradients of each device's own rows (per-replica optimizers,
    which run it inside their own `shard_map` over the data axes).
    """
    if plan.amp is not None:
        loss_fn = _autocast(loss_fn, plan.amp.policy, signature.has_state)
    if plan.pipeline is not None:
        grad_fn = _pipelined(loss_fn, plan, mesh, placement, signature, loss_scale)
    else:
        grad_fn = value_and_grad(_normalised(loss_fn, signature, loss_scale))
        merge = plan.in_step_merge
        if merge is not None:
            grad_fn = gradient_merge.microbatched(grad_fn, merge.k_steps, merge.avg)
        reducer = _reducer(plan, mesh, placement) if reduce else None
        if reducer is not None:
            grad_fn = _reduced(grad_fn, reducer, plan, mesh, placement)
    return _recomputed(grad_fn, plan, mesh)


def _reduced(
    grad_fn: GradFn,
    reducer: tuple[grad_allreduce.Reducer, Any],
    plan: Plan,
    mesh: Mesh,
    placement: Placement,
) -> GradFn:
    axes = data_axes(mesh)
    over_data = lambda tree: jax.tree.map(lambda s: restrict(s.spec, axes), tree)  # noqa: E731
    reduce_fn, scattered = reducer
    return grad_allreduce.data_parallel(
        grad_fn,
        mesh,
        axes,
        reduce_fn,
        None if scattered is None else over_data(scattered),
        state_specs=over_data(placement.model_state),
        # The hierarchical ring's results are equal on every replica, which JAX cannot prove.
        check_vma=plan.hierarchical is None,
    )


def _recomputed(grad_fn: GradFn, plan: Plan, mesh: Mesh) -> GradFn:
    """`grad_fn` traced with the layers marked for recompute under the plan's policy, and the
    sequence-parallel layers under `mp_configs.recompute_allgather`."""
    r = plan.recompute

    def traced(*args: Any) -> tuple[Outputs, Any]:
        scope = (
            recompute.recompute_scope(
                r.checkpoints,
                policy=r.policy,
                offload=r.offload,
                checkpoint_shape=r.checkpoint_shape,
                replicas=data_parallel_size(mesh),
            )
            if r is not None
            else contextlib.nullcontext()
        )
        with scope, sequence_parallel_options(recompute_allgather=plan.recompute_allgather):
            return grad_fn(*args)

    return traced


def _autocast(loss_fn: Loss, policy: amp.Policy, has_state: bool) -> Loss:
    if not isinstance(loss_fn, PipelineLayer):
        return amp.autocast(loss_fn, policy)
    # Under O2 (Paddle's pure half precision) the activations between a model's parts are in
    # half precision too, as a whole-model O2 run computes them; a pipeline keeps and sends
    # them so (autocast alone gives each part's outputs back in float32).
    half = policy.dtype if policy.level == "O2" else None
    return dataclasses.replace(
        loss_fn,
        embed=_activations_in(amp.autocast(loss_fn.embed, policy), half, has_state),
        stage=_activations_in(amp.autocast(loss_fn.stage, policy), half, has_state),
        head_loss=amp.autocast(loss_fn.head_loss, policy),
    )


def _activations_in(part: Callable[..., Any], dtype: Any, has_state: bool) -> Callable[..., Any]:
    """`part` (embed or stage) with its floating activations in `dtype` (None: as they are);
    with `has_state` it returns ``(activations, new_state)``, whose state keeps its dtypes."""
    if dtype is None:
        return part

    def cast(tree: Any) -> Any:
        floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)  # noqa: E731
        return jax.tree.map(lambda x: x.astype(dtype) if floating(x) else x, tree)

    @functools.wraps(part)
    def wrapped(*args: Any) -> Any:
        out = part(*args)
        return (cast(out[0]), out[1]) if has_state else cast(out)

    return wrapped


def _normalised(
    loss_fn: Callable[..., Any], signature: Signature, loss_scale: DynamicLossScale | None
) -> Callable[..., tuple[jax.Array, Outputs]]:
    """`loss_fn` as `(params, model_state, batch, *rest) -> (loss to differentiate, Outputs)`,
    whichever of aux and model state it has."""

    def loss(params: Any, model_state: Any, batch: Any, *rest: Any) -> tuple:
        if signature.has_state:  # (loss, new state) or (loss, aux, new state)
            # Rebuilt here, so that flax Variables in it belong to this trace (nnx refuses
            # to update a Variable made at another trace level).
            model_state = jax.tree.map(lambda x: x, model_state)
            out = checked_output(loss_fn(params, model_state, batch, *rest), signature)
            *out, model_state = out
        else:  # loss or (loss, aux)
            out = checked_output(loss_fn(params, batch, *rest), signature)
            out = out if signature.has_aux else (out,)
        value, aux = out if signature.has_aux else (out[0], {})
        scaled = value if loss_scale is None else loss_scale.scale(value)
        return scaled, Outputs(value, aux, model_state)

    return loss


def checked_output(out: Any, signature: Signature) -> Any:
    """`out` after checking that it is what the flags say the loss returns."""
    parts = (1 if signature.has_aux else 0) + (1 if signature.has_state else 0)
    form = [
        "loss",
        *(["aux_dict"] if signature.has_aux else []),
        *(["new_model_state"] if signature.has_state else []),
    ]
    flags = f"has_aux={signature.has_aux}, has_state={signature.has_state}"
    if parts and not (isinstance(out, tuple | list) and len(out) == parts + 1):
        raise TypeError(
            f"with {flags} the loss must return ({', '.join(form)}), got {_describe(out)}"
        )
    value = out[0] if parts else out
    if signature.has_aux and not isinstance(out[1], Mapping):
        raise TypeError(
            f"with has_aux=True the loss must return (loss, aux_dict), a dict of metrics by "
            f"name, but its aux is {_describe(out[1])}: return e.g. (loss, {{'accuracy': acc}})"
        )
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape != () or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"the loss must be a floating-point scalar, got {_describe(value)}"
            + ("" if parts else f" (with {flags} it returns the loss alone)")
        )
    return out


def _describe(x: Any) -> str:
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{x.dtype}{list(x.shape)}"
    return type(x).__name__


def _pipelined(
    model: PipelineLayer,
    plan: Plan,
    mesh: Mesh,
    placement: Placement,
    signature: Signature,
    loss_scale: DynamicLossScale | None,
) -> GradFn:
    """The pipeline's gradient function; it accumulates its micro-batches (in-step gradient
    merge is that) and reduces over the data axes once, through the plan's reducer."""
    model.check_flags(signature.has_rng, signature.has_state)
    config = plan.pipeline
    reducer, scattered = _reducer(plan, mesh, placement)
    spec_of = lambda tree: jax.tree.map(lambda s: s.spec, tree)  # noqa: E731
    value_and_grad_fn = pipeline(
        model.embed,
        model.stage,
        model.head_loss,
        mesh=mesh,
        micro_batch_size=config.micro_batch_size,
        accumulate_steps=config.accumulate_steps,
        schedule_mode=config.schedule_mode,
        vpp_degree=placement.stage_order.vpp,
        has_aux=signature.has_aux,
        has_rng=signature.has_rng,
        has_state=signature.has_state,
        reducer=reducer,
        param_specs=spec_of(placement.params),
        grad_specs=None if scattered is None else spec_of(scattered),
    )
    scale = None if loss_scale is None else loss_scale.loss_scale

    def grad_fn(params: Any, model_state: Any, batch: Any, *key: Any) -> tuple[Outputs, Any]:
        # Rebuilt, so that flax Variables in it belong to this trace (see `_normalised`).
        state = (jax.tree.map(lambda x: x, model_state),) if signature.has_state else ()
        out, grads = value_and_grad_fn(params, *state, batch, *key, loss_scale=scale)
        loss, *rest = out if isinstance(out, tuple) else (out,)
        aux = rest[0] if signature.has_aux else {}
        return Outputs(loss, aux, rest[-1] if signature.has_state else None), grads

    return grad_fn


def _reducer(
    plan: Plan, mesh: Mesh, placement: Placement
) -> tuple[grad_allreduce.Reducer, Any] | None:
    """The explicit reducer over the data axes, with the gradients' placement when it leaves
    each device a shard (`placement.scattered`), or None where XLA's own collectives do
    (ZeRO-3 outside a pipeline: a reducer's `shard_map` would gather every parameter at its
    entry, the whole model at once; XLA gathers each where it is used and reduce-scatters its
    gradient). A pipeline always reduces its gradients itself, once after its loop (by
    default their mean)."""
    pipelined = plan.pipeline is not None
    if plan.sharding_stage == 3 and not pipelined:
        return None
    if placement.scattered:  # each device ends with its shard
        grads = placement.grads
        specs = jax.tree.map(lambda s: restrict(s.spec, data_axes(mesh)), grads)
        return grad_allreduce.scatter_mean(specs), grads
    replicas = data_parallel_size(mesh)
    dtype = jnp.dtype(plan.allreduce_dtype or jnp.float32)
    if plan.hierarchical is not None:
        # A node is, by default, the replicas of one process (Paddle: of one machine).
        per_node = plan.hierarchical.ranks_per_node or max(1, replicas // jax.process_count())
        return grad_allreduce.hierarchical_mean(replicas, per_node, dtype), None
    # Micro-batch gradients accumulate on each device and are reduced once (under GSPMD,
    # XLA would all-reduce every micro-batch's gradient inside the loop).
    merged = plan.in_step_merge is not None and replicas > 1
    if pipelined or plan.allreduce_dtype is not None or merged:
        return grad_allreduce.mean_in(dtype), None
    return None
