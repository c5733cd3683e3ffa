"""The step as a pure function of its spec, as MaxText's and Levanter's train steps are.

    spec = StepSpec(plan, mesh, placement, optimizer, loss_fn, signature, tables)
    new_state, metrics = train_step(spec, state, batch)      # what `TrainStep` compiles
    new_state, metrics = update(spec, state, batch, key)     # one replica's, or the only one

`StepSpec` is made once per state shape (`TrainStep.spec`) and never changes; `update` reads
nothing else. Sparse tables enter at two seams: the rows a batch touches before the gradient
chain, and their rules after it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from fleetjax._chain import Signature, grad_chain
from fleetjax._checks import init_optimizer
from fleetjax._tables import Rows, Tables
from fleetjax.mesh import constrain, data_axes, restrict
from fleetjax.placement import Loss, Placement, place
from fleetjax.plan import Plan
from fleetjax.train_state import TrainState
from fleetjax.transforms.loss_scale import DynamicLossScale, apply_if_finite
from fleetjax.transforms.per_replica import Agree, per_replica

__all__ = ["StepSpec", "initial_state", "replica_state", "train_step", "update"]


@dataclasses.dataclass(frozen=True, eq=False)
class StepSpec:
    """What one train step is made of, for states of one shape: frozen, made once.

    Attributes:
      plan: the strategy's `Plan`.
      mesh: the device mesh.
      placement: where the state, the gradients and the batch live.
      optimizer: the optimizer that trains (`DistributedOptimizer.rebuilt`: the strategy's
        rebuild of the user's, with gradient merge across calls).
      loss_fn: the user's loss (a `PipelineLayer` under a pipeline).
      signature: what the loss takes and returns.
      tables: the model's sparse tables (None: it has none).
    """

    plan: Plan
    mesh: Mesh
    placement: Placement
    optimizer: optax.GradientTransformation
    loss_fn: Loss
    signature: Signature
    tables: Tables | None = None

    @classmethod
    def make(
        cls,
        plan: Plan,
        mesh: Mesh,
        optimizer: optax.GradientTransformation,
        loss_fn: Loss,
        signature: Signature,
        abstract_state: TrainState,
        tables: Tables | None,
        **specs: Any,
    ) -> StepSpec:
        """The spec for states like `abstract_state` (shapes), its placement computed here
        (`place`, with the `param_specs` and `state_specs` in `specs`); nothing runs."""
        placement = place(
            plan, mesh, abstract_state, optimizer, model=loss_fn, tables=tables, **specs
        )
        return cls(plan, mesh, placement, optimizer, loss_fn, signature, tables)


def replica_state(
    plan: Plan,
    optimizer: optax.GradientTransformation,
    tables: Tables | None,
    params: Any,
    rng: jax.Array,
    model_state: Any,
) -> TrainState:
    """One replica's fresh state: step 0, the optimizer's state of `params` (with sparse
    tables, each table's slots too) and the loss scale AMP starts from."""
    scaling = plan.amp.loss_scaling if plan.amp else None
    loss_scale = None if scaling is None else DynamicLossScale.create(**vars(scaling))
    if tables is None:
        opt_state = init_optimizer(optimizer, params)
    else:
        params, opt_state = tables.init(optimizer, params)
    return TrainState(jnp.zeros((), jnp.int32), params, opt_state, rng, loss_scale, model_state)


def initial_state(spec: StepSpec, params: Any, rng: jax.Array, model_state: Any) -> TrainState:
    """A fresh state as the step keeps it: `replica_state` with the layers in the pipeline's
    stage order and the parts kept per replica copied for every replica (`spec.placement`)."""
    order = spec.placement.stage_order
    if order is not None:
        params, model_state = order.to_pipeline(params), order.to_pipeline(model_state)
    fresh = replica_state(spec.plan, spec.optimizer, spec.tables, params, rng, model_state)
    return spec.placement.stack(fresh)


def train_step(spec: StepSpec, state: TrainState, batch: Any) -> tuple[TrainState, dict]:
    """One step on the global `batch`: the update, or under a per-replica optimizer each
    replica's (`per_replica`), with the key of this step where the loss takes one."""
    key = jax.random.fold_in(state.rng, state.step) if spec.signature.has_rng else None
    placement = spec.placement
    if not placement.per_replica:
        return update(spec, state, batch, key)
    axes = data_axes(spec.mesh)
    over_replicas = jax.tree.map(lambda at: restrict(at.spec, axes), placement.state)
    each = functools.partial(update, spec)
    return per_replica(each, spec.mesh, axes, over_replicas, placement.stacked)(state, batch, key)


def _alone(finite: jax.Array) -> jax.Array:
    return finite


def update(
    spec: StepSpec,
    state: TrainState,
    batch: Any,
    key: jax.Array | None,
    agree: Agree = _alone,
) -> tuple[TrainState, dict[str, Any]]:
    """The update: gradients from the chain (a sparse table's for the rows the batch touches;
    per-replica optimizers reduce their own), then the optimizer, or under loss scaling the
    unscale, the finite check (`agree` makes replicas decide alike) and the step or its skip.

    Returns the new state and the metrics: "loss", the loss's aux entries, loss scaling's and
    the tables' (`Rows.metrics`)."""
    plan, placement, rest = spec.plan, spec.placement, () if key is None else (key,)
    params, loss_fn, rows = state.params, spec.loss_fn, None
    if spec.tables is not None:  # the chain trains each table's touched rows
        rows = spec.tables.touched(
            loss_fn, spec.signature.has_state, params, state.model_state, batch, rest
        )
        params, loss_fn = rows.params, rows.loss_fn
    chain = (loss_fn, plan, spec.mesh, placement, spec.signature, state.loss_scale)
    out, grads = grad_chain(*chain, reduce=not placement.per_replica)(
        params, state.model_state, batch, *rest
    )
    if placement.grads is not None:  # ZeRO-2/3: each device keeps its shard
        grads = constrain(grads, placement.grads)
    opt_state = state.opt_state
    if plan.optimizer_offload:  # fetched from pinned host memory for the update
        opt_state = jax.device_put(opt_state, placement.opt_state_in_update)
    apply = functools.partial(_apply, spec.optimizer, rows, state, opt_state, out.loss)
    if state.loss_scale is None:
        (params, opt_state), loss_scale, extra = apply(grads), None, {}
    else:  # a non-finite gradient leaves parameters and optimizer state unchanged
        kept, scale = (state.params, opt_state), state.loss_scale
        (params, opt_state), loss_scale, extra = apply_if_finite(apply, kept, grads, scale, agree)
    new = TrainState(state.step + 1, params, opt_state, state.rng, loss_scale, out.model_state)
    tables = {} if rows is None else rows.metrics
    return new, {"loss": out.loss, **out.aux, **extra, **tables}


def _apply(
    optimizer: optax.GradientTransformation,
    rows: Rows | None,
    state: TrainState,
    opt_state: Any,
    loss: jax.Array,
    grads: Any,
) -> tuple[Any, Any]:
    """(params, opt_state) after the optimizer's step; `loss` is its `value` (Adaptive
    LocalSGD adapts its interval to it). With tables, each table's rule on its rows too."""
    optimizer = optax.with_extra_args_support(optimizer)
    if rows is not None:
        return rows.apply(optimizer, grads, opt_state, state.params, state.step, loss)
    updates, new_opt = optimizer.update(grads, opt_state, state.params, value=loss)
    return optax.apply_updates(state.params, updates), new_opt
