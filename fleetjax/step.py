"""`make_train_step`: the one place where a strategy turns a loss into a distributed step.

The step is one `jax.jit` over the global batch. The batch's leading dimension is split over
the data axes (`dp` and `sharding`); parameters and optimizer state are replicated; XLA inserts
the gradient all-reduce because the loss is a mean over a batch that lives on every device.

What the strategy turns on is composed here, in this order (see `_plan.Plan`):

    loss --amp.autocast--> --x loss scale--> value_and_grad (recompute marks inside)
         --gradient_merge.microbatched (in_step)--> --grad_allreduce.data_parallel (fp16)-->
         unscale, finite check --> optimizer (gradient_merge.across_calls) or skip
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleetjax._plan import Plan, read_plan
from fleetjax.mesh import (
    AXES,
    batch_sharding,
    data_axes,
    data_parallel_size,
    mesh_from_strategy,
    replicated,
    strategy_degrees,
)
from fleetjax.optimizers import DistributedOptimizer
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.transforms import amp, grad_allreduce, gradient_merge, recompute

LossFn = Callable[..., Any]
GradFn = Callable[..., tuple[tuple[jax.Array, dict[str, Any]], Any]]


class TrainState(NamedTuple):
    """Everything a step updates, as one pytree (checkpointed as one unit).

    Attributes:
      step: the number of steps taken (int32).
      params: the parameters (float32 master weights under AMP).
      opt_state: the optimizer state.
      rng: raw key data (uint32[2]); step `i` gives the loss `fold_in(rng, i)`.
      loss_scale: AMP's dynamic loss-scaling state, if AMP scales the loss.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: amp.LossScaleState | None = None


class TrainStep:
    """A compiled training step; make one with `make_train_step`.

    `step.init(params)` places parameters and builds the optimizer state; `step(state, batch)`
    returns `(new_state, metrics)` and donates `state`; `step.lower(state, batch)` gives the
    lowered computation (`.compile().as_text()`, `.compile().memory_analysis()`).
    """

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation,
        strategy: DistributedStrategy | Strategy,
        plan: Plan,
        mesh: Mesh,
        has_aux: bool,
        has_rng: bool,
    ) -> None:
        self.loss_fn = loss_fn
        self.strategy = strategy
        self.plan = plan
        self.mesh = mesh
        self.has_aux = has_aux
        self.has_rng = has_rng
        merge = self.plan.gradient_merge
        if merge is not None and not merge.in_step:
            optimizer = gradient_merge.across_calls(optimizer, merge.k_steps, merge.avg)
        self.optimizer = optimizer
        self.batch_sharding = batch_sharding(mesh)
        self.state_sharding = replicated(mesh)
        self._step = jax.jit(
            self._update,
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, replicated(mesh)),
            donate_argnums=0,
        )
        self._init = jax.jit(self._initial_state, out_shardings=self.state_sharding)

    # -- the pure step ------------------------------------------------------------------------
    def _initial_state(self, params: Any, rng: jax.Array) -> TrainState:
        scaling = self.plan.amp.loss_scaling if self.plan.amp else None
        loss_scale = amp.init_loss_scale(scaling.init_loss_scaling) if scaling else None
        return TrainState(
            jnp.zeros((), jnp.int32), params, self.optimizer.init(params), rng, loss_scale
        )

    def _loss(self, scale: jax.Array | None) -> Callable[..., tuple[jax.Array, Any]]:
        """`(params, batch, *rest) -> (loss to differentiate, (loss, aux))`."""
        loss_fn = self.loss_fn if self.has_aux else lambda *a: (self.loss_fn(*a), {})
        if self.plan.amp is not None:
            loss_fn = amp.autocast(loss_fn, self.plan.amp.policy)

        def scaled(*args: Any) -> tuple[jax.Array, Any]:
            loss, aux = loss_fn(*args)
            return (loss if scale is None else loss * scale), (loss, aux)

        return scaled

    def _grad_fn(self, scale: jax.Array | None) -> GradFn:
        value_and_grad = jax.value_and_grad(self._loss(scale), has_aux=True)

        def grad_fn(params: Any, batch: Any, *rest: Any) -> tuple[tuple[jax.Array, Any], Any]:
            (_, (loss, aux)), grads = value_and_grad(params, batch, *rest)
            return (loss, aux), grads

        plan, axes = self.plan, data_axes(self.mesh)
        explicit = plan.allreduce_dtype is not None
        if plan.gradient_merge is not None and plan.gradient_merge.in_step:
            # Inside the explicit reduction each device splits its own rows.
            micro = None if explicit else NamedSharding(self.mesh, PartitionSpec(None, axes))
            merge = plan.gradient_merge
            grad_fn = gradient_merge.microbatched(grad_fn, merge.k_steps, merge.avg, micro)
        if explicit:
            reducer = grad_allreduce.mean_in(jnp.dtype(plan.allreduce_dtype))
            grad_fn = grad_allreduce.data_parallel(grad_fn, self.mesh, axes, reducer)
        return grad_fn

    def _recompute_scope(self) -> contextlib.AbstractContextManager[Any]:
        r = self.plan.recompute
        if r is None:
            return contextlib.nullcontext()
        return recompute.recompute_scope(
            r.checkpoints,
            policy=r.policy,
            offload=r.offload,
            checkpoint_shape=r.checkpoint_shape,
            replicas=data_parallel_size(self.mesh),
        )

    def _update(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        rest = (jax.random.fold_in(state.rng, state.step),) if self.has_rng else ()
        scale = None if state.loss_scale is None else state.loss_scale.loss_scale
        with self._recompute_scope():
            (loss, aux), grads = self._grad_fn(scale)(state.params, batch, *rest)
        metrics = {"loss": loss, **aux}

        def apply(grads: Any) -> tuple[Any, Any]:
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            return optax.apply_updates(state.params, updates), opt_state

        if state.loss_scale is None:
            params, opt_state = apply(grads)
            return TrainState(state.step + 1, params, opt_state, state.rng), metrics
        grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
        finite = amp.all_finite(grads)
        # A non-finite gradient skips the whole update: params and optimizer state unchanged.
        params, opt_state = jax.lax.cond(
            finite, apply, lambda _: (state.params, state.opt_state), grads
        )
        scaling = self.plan.amp.loss_scaling
        loss_scale = state.loss_scale
        if scaling.dynamic:
            loss_scale = amp.update_loss_scale(
                loss_scale,
                finite,
                incr_every_n_steps=scaling.incr_every_n_steps,
                decr_every_n_nan_or_inf=scaling.decr_every_n_nan_or_inf,
                incr_ratio=scaling.incr_ratio,
                decr_ratio=scaling.decr_ratio,
            )
        metrics |= {"loss_scale": scale, "skipped": ~finite}
        new_state = TrainState(state.step + 1, params, opt_state, state.rng, loss_scale)
        return new_state, metrics

    # -- the public surface --------------------------------------------------------------------
    def init(self, params: Any, seed: int | jax.Array = 0) -> TrainState:
        """The initial state: `params` replicated over the mesh, a fresh optimizer state, and
        the step key from `seed` (an int, or raw key data)."""
        rng = jax.random.PRNGKey(seed) if isinstance(seed, int) else jnp.asarray(seed)
        placed = jax.device_put((params, rng), self.state_sharding)
        return self._init(*placed)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One step on the global `batch` (host data is placed here; see `shard_batch`).

        Returns the new state and metrics: `"loss"`, the aux entries, and under AMP loss
        scaling `"loss_scale"` and `"skipped"` (whether a non-finite gradient skipped it)."""
        return self._step(state, self.shard_batch(batch))

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """The lowered step for `state` and `batch` (only shapes are used; nothing runs)."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                self._global_shape(x), x.dtype, sharding=self.batch_sharding
            ),
            self._checked_batch(batch),
        )
        return self._step.lower(state, abstract)

    def shard_batch(self, batch: Any) -> Any:
        """`batch` as global arrays split over the data axes.

        Host (numpy) arrays are this process's part of the global batch: with one
        process, the whole batch; with several, each passes its own rows and the global batch
        is their concatenation in process order. JAX arrays are global already; they are
        resharded if they are not split that way.
        """
        return jax.tree.map(self._place, self._checked_batch(batch))

    def _place(self, x: Any) -> jax.Array:
        if not isinstance(x, jax.Array):
            return jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(x))
        if x.sharding.is_equivalent_to(self.batch_sharding, x.ndim):
            return x
        return jax.device_put(x, self.batch_sharding)

    def _global_shape(self, x: Any) -> tuple[int, ...]:
        if isinstance(x, jax.Array):
            return x.shape
        return (x.shape[0] * jax.process_count(), *x.shape[1:])

    def _checked_batch(self, batch: Any) -> Any:
        ways = data_parallel_size(self.mesh)
        merge = self.plan.gradient_merge
        micro = merge.k_steps if merge is not None and merge.in_step else 1
        split = " x ".join(f"{a}={self.mesh.shape[a]}" for a in data_axes(self.mesh))

        def check(path: Any, x: Any) -> Any:
            x = x if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)
            name = "batch" + jax.tree_util.keystr(path)
            if x.ndim == 0:
                raise ValueError(f"{name} is a scalar; every batch leaf needs a batch dimension")
            rows = self._global_shape(x)[0]
            if rows % ways:
                raise ValueError(
                    f"{name} has {rows} rows, which do not split evenly over the "
                    f"{ways} data-parallel devices ({split})"
                )
            if rows % (ways * micro):
                raise ValueError(
                    f"{name} has {rows} rows, which do not split into k_steps={micro} "
                    f"micro-batches on each of the {ways} data-parallel devices ({split})"
                )
            return x

        return jax.tree_util.tree_map_with_path(check, batch)


def _check_mesh(mesh: Mesh, strategy: DistributedStrategy | Strategy) -> None:
    """`mesh` must use fleetjax's axis names and have the sizes the strategy asks for."""
    unknown = [a for a in mesh.axis_names if a not in AXES]
    if unknown:
        raise ValueError(
            f"mesh axes {unknown} are not fleetjax axes; name mesh axes from {', '.join(AXES)}"
        )
    for axis, degree in strategy_degrees(strategy).items():
        size = mesh.shape.get(axis, 1)
        asked = degree != (-1 if axis == "dp" else 1)
        if asked and degree != size:
            raise ValueError(
                f"the strategy asks for {axis} degree {degree}, but the mesh's {axis} axis "
                f"has size {size}"
            )


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    strategy: DistributedStrategy | Strategy | None = None,
    mesh: Mesh | None = None,
    *,
    has_aux: bool = False,
    has_rng: bool = False,
) -> TrainStep:
    """A jitted training step for `loss_fn(params, batch)` under `strategy`.

    Args:
      loss_fn: `loss_fn(params, batch[, rng]) -> scalar` (or `(scalar, aux_dict)` with
        `has_aux=True`; the aux entries join the metrics). It sees the global batch, so a mean
        over it is the data-parallel loss. Under a recompute strategy, mark its layers with
        `fleetjax.recompute` and name activations with `fleetjax.checkpoint_name`.
      optimizer: any optax transformation, or one from `fleet.distributed_optimizer`.
      strategy: a `DistributedStrategy` or `Strategy`; default the optimizer's, else plain
        data parallel.
      mesh: default the optimizer's, else built from the strategy over all devices.
      has_aux: whether `loss_fn` returns `(loss, aux_dict)`.
      has_rng: whether `loss_fn` takes a third argument, a fresh PRNG key each step (for
        dropout and the like), derived from `state.rng` and `state.step`.

    Raises:
      NotImplementedError: if the strategy turns on a feature this version cannot apply.
      ValueError: if the strategy's settings contradict each other or `mesh` does not fit.
    """
    if isinstance(optimizer, DistributedOptimizer):
        strategy = strategy if strategy is not None else optimizer.strategy
        mesh = mesh if mesh is not None else optimizer.mesh
    strategy = strategy if strategy is not None else DistributedStrategy()
    plan = read_plan(strategy)
    if mesh is None:
        mesh = mesh_from_strategy(strategy)
    else:
        _check_mesh(mesh, strategy)
    return TrainStep(loss_fn, optimizer, strategy, plan, mesh, has_aux, has_rng)
