"""`make_train_step`: the one place where a strategy turns a loss into a distributed step.

The step is one `jax.jit` over the global batch. The batch's leading dimension is split over
the data axes (`dp` and `sharding`); parameters and optimizer state are replicated; XLA inserts
the gradient all-reduce because the loss is a mean over a batch that lives on every device.

What the strategy turns on is composed here, in this order (see `_plan.Plan`):

    loss --amp.autocast--> --x loss scale--> value_and_grad (recompute marks inside)
         --gradient_merge.microbatched (in_step)--> --grad_allreduce.data_parallel (fp16)-->
         unscale, finite check --> optimizer (gradient_merge.across_calls) or skip

Optimizers that do their own communication (DGC, LocalSGD) run per data-parallel replica:
the whole update is one `shard_map` over the data axes, each device computing its local
gradient and updating its own optimizer state, stored stacked on a leading replica axis.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleetjax import xla_flags
from fleetjax._plan import Plan, read_plan
from fleetjax.layers import partition_specs
from fleetjax.mesh import (
    AXES,
    batch_sharding,
    constrain,
    data_axes,
    data_parallel_size,
    mesh_from_strategy,
    replicated,
    strategy_degrees,
    zero_spec,
)
from fleetjax.mesh._placement import spec_axes
from fleetjax.optimizers import DistributedOptimizer, optimizer_for_strategy
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.transforms import amp, grad_allreduce, gradient_merge, recompute
from fleetjax.transforms.pipeline import PipelineLayer, PipelineParams, pipeline, to_pipeline_order

LossFn = Callable[..., Any]
# (params, model_state, batch, *rest) -> ((loss, aux, new model_state), grads)
GradFn = Callable[..., tuple[tuple[jax.Array, dict[str, Any], Any], Any]]


class TrainState(NamedTuple):
    """Everything a step updates, as one pytree (checkpointed as one unit).

    Attributes:
      step: the number of steps taken (int32).
      params: the parameters (float32 master weights under AMP). Under LocalSGD each
        data-parallel replica trains its own: they are stacked on a leading replica axis.
      opt_state: the optimizer state (stacked per replica under DGC and LocalSGD).
      rng: raw key data (uint32[2]); step `i` gives the loss `fold_in(rng, i)`.
      loss_scale: AMP's dynamic loss-scaling state, if AMP scales the loss.
      model_state: the model's variables that are not trained by gradients (batch-norm
        running statistics and the like), with `make_train_step(..., has_state=True)`.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    loss_scale: amp.LossScaleState | None = None
    model_state: Any = None


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
        param_specs: Any = None,
        has_state: bool = False,
        state_specs: Any = None,
    ) -> None:
        if plan.pipeline is not None:
            if not isinstance(loss_fn, PipelineLayer):
                raise TypeError(
                    "the strategy asks for a pipeline, which needs the model cut into stages: "
                    "pass fleetjax.PipelineLayer(embed, stage, head_loss) as the loss, with "
                    f"PipelineParams, not {type(loss_fn).__name__}"
                )
            if has_state:
                raise ValueError("the pipeline takes no model state yet")
        self.loss_fn = loss_fn
        self.param_specs = param_specs
        self.strategy = strategy
        self.plan = plan
        self.mesh = mesh
        self.has_aux = has_aux
        self.has_rng = has_rng
        self.has_state = has_state
        self.state_specs = state_specs
        merge = self.plan.gradient_merge
        if merge is not None and not merge.in_step:
            optimizer = gradient_merge.across_calls(optimizer, merge.k_steps, merge.avg)
        self.optimizer = optimizer
        self.batch_sharding = batch_sharding(mesh)
        self._axes = data_axes(mesh)
        self._replicas = data_parallel_size(mesh)
        self.state_sharding: TrainState | None = None  # known once a state is seen
        self.abstract_state: TrainState | None = None  # shapes and dtypes, likewise
        self._step: Any = None
        self._runs: dict[int, Any] = {}  # `run`'s compiled scans, by number of steps
        # XLA:CPU runs simulated devices' collectives on a shared thread pool; with several
        # steps queued, device threads of a later step can take the pool while an all-reduce of
        # an earlier one waits for its last participant, and XLA aborts after 40 s (jaxlib
        # 0.10.2, 8 devices on 2 cores). So on CPU one step runs at a time.
        self._one_at_a_time = mesh.devices.flat[0].platform == "cpu" and mesh.devices.size > 1

    def _state_shardings(self, state: Any) -> TrainState:
        """Where each part of a state (real or abstract) lives: parameters and optimizer
        state as the ZeRO stage says (`zero_spec`, over `param_specs`), or, under DGC and
        LocalSGD, stacked per replica. Also sets the gradients' placement."""
        mesh, plan = self.mesh, self.plan
        rep = replicated(mesh)
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        shard = lambda spec, memory="device": NamedSharding(mesh, spec, memory_kind=memory)  # noqa: E731
        if plan.per_replica:
            stacked = shard(PartitionSpec(self._axes))
            params = jax.tree.map(lambda _: stacked if plan.replica_params else rep, state.params)
            opt_state = jax.tree.map(lambda _: stacked, state.opt_state)
            self._grad_sharding = None
        else:
            specs = self._param_specs(state.params)
            zero = specs
            if plan.sharding_stage:
                zero = jax.tree.map(
                    lambda spec, x: zero_spec(spec, x.shape, mesh),
                    specs,
                    state.params,
                    is_leaf=is_spec,
                )
            opt_specs = optax.tree_utils.tree_map_params(
                self.optimizer,
                lambda _, spec: spec,
                state.opt_state,
                zero,
                transform_non_params=lambda _: PartitionSpec(),
                is_leaf=is_spec,
            )
            memory = "pinned_host" if plan.optimizer_offload else "device"
            opt_state = jax.tree.map(lambda spec: shard(spec, memory), opt_specs, is_leaf=is_spec)
            params = jax.tree.map(
                shard, zero if plan.sharding_stage == 3 else specs, is_leaf=is_spec
            )
            self._grad_specs = zero if plan.sharding_stage >= 2 else specs
            self._grad_sharding = jax.tree.map(shard, self._grad_specs, is_leaf=is_spec)
        self._model_state_specs = self._state_specs(state.model_state)
        return TrainState(
            step=rep,
            params=params,
            opt_state=opt_state,
            rng=rep,
            loss_scale=None if state.loss_scale is None else rep,
            model_state=jax.tree.map(shard, self._model_state_specs, is_leaf=is_spec),
        )

    def _state_specs(self, model_state: Any) -> Any:
        """The model state's placement: `state_specs`, by default read from logical axis names
        (a local `fleetjax.layers.BatchNorm`'s statistics split over the data axes; plain
        arrays replicated)."""
        if self.state_specs is not None:
            return self.state_specs
        return partition_specs(model_state, mesh=self.mesh)

    def _param_specs(self, params: Any) -> Any:
        """The parameters' placement over the non-data axes: `param_specs`, by default read from
        the parameters' logical axis names (flax partitioning metadata; plain arrays are
        replicated), with a pipeline's stacked layers split over `pp` on their leading axis."""
        specs = self.param_specs
        if specs is None:
            specs = partition_specs(params, mesh=self.mesh)
        split = {a for s in jax.tree.leaves(specs, is_leaf=_is_spec) for a in spec_axes(s)}
        if self.mesh.shape.get("mp", 1) > 1 and "mp" not in split:
            raise ValueError(
                f"the mesh has an mp axis of size {self.mesh.shape['mp']}, but no parameter is "
                "split over it, so every mp device would compute the same: give parameters "
                "logical axis names (fleetjax.layers) or pass param_specs"
            )
        if self.plan.pipeline is None:
            return specs
        by_stage = lambda spec: PartitionSpec("pp", *tuple(spec)[1:])  # noqa: E731
        layers = jax.tree.map(
            by_stage, specs.layers, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )
        return PipelineParams(specs.embed, layers, specs.head)

    def _compiled_step(self, state: Any) -> Any:
        if self._step is None:
            self.state_sharding = self._state_shardings(state)
            self.abstract_state = jax.eval_shape(lambda s: s, state)
            self._step = jax.jit(
                self._update,
                in_shardings=(self.state_sharding, self.batch_sharding),
                out_shardings=(self.state_sharding, replicated(self.mesh)),
                donate_argnums=0,
            )
        return self._step

    # -- the pure step ------------------------------------------------------------------------
    def _initial_state(self, params: Any, rng: jax.Array, model_state: Any = None) -> TrainState:
        scaling = self.plan.amp.loss_scaling if self.plan.amp else None
        loss_scale = amp.init_loss_scale(scaling.init_loss_scaling) if scaling else None
        opt_state = self.optimizer.init(params)
        if self.plan.per_replica:  # every replica starts from the same state
            opt_state = self._stack(opt_state)
        if self.plan.replica_params:
            params = self._stack(params)
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, rng, loss_scale, model_state)

    def _stack(self, tree: Any) -> Any:
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (self._replicas, *x.shape)), tree)

    def _loss(self, scale: jax.Array | None) -> Callable[..., tuple[jax.Array, Any]]:
        """`(params, model_state, batch, *rest) -> (loss to differentiate, (loss, aux,
        model_state))`, whichever of aux and model state the user's loss has."""
        loss_fn = self.loss_fn
        if self.plan.amp is not None:
            loss_fn = amp.autocast(loss_fn, self.plan.amp.policy)

        def scaled(params: Any, model_state: Any, batch: Any, *rest: Any) -> tuple:
            if self.has_state:  # (loss, new state) or (loss, aux, new state)
                # Rebuilt here, so that flax Variables in it belong to this trace (nnx refuses
                # to update a Variable made at another trace level).
                model_state = jax.tree.map(lambda x: x, model_state)
                *out, model_state = loss_fn(params, model_state, batch, *rest)
            else:  # loss or (loss, aux)
                out = loss_fn(params, batch, *rest)
                out = out if self.has_aux else (out,)
            loss, aux = out if self.has_aux else (out[0], {})
            return (loss if scale is None else loss * scale), (loss, aux, model_state)

        return scaled

    def _vpp_degree(self) -> int:
        asked, model = self.plan.pipeline.vpp_degree, self.loss_fn.num_virtual_pipeline_stages
        if asked > 1 and model > 1 and asked != model:
            raise ValueError(
                f"Strategy.pipeline.vpp_degree={asked} but the PipelineLayer has "
                f"num_virtual_pipeline_stages={model}"
            )
        return max(asked, model)

    def _pipeline_grad_fn(self, scale: jax.Array | None) -> GradFn:
        """The pipeline's gradient function, with AMP applied to each of the model's parts."""
        model, config = self.loss_fn, self.plan.pipeline
        parts = (model.embed, model.stage, model.head_loss)
        if self.plan.amp is not None:
            parts = tuple(amp.autocast(f, self.plan.amp.policy) for f in parts)
        embed, stage, head_loss = parts
        if scale is not None:
            # The loss scale rides with the head's parameters (its gradient is dropped): a
            # value closed over by the pipeline's shard_map could not be typed on Explicit axes.
            head_loss = functools.partial(_scaled_head, head_loss, self.has_aux)
        value_and_grad = pipeline(
            embed,
            stage,
            head_loss,
            mesh=self.mesh,
            micro_batch_size=config.micro_batch_size,
            accumulate_steps=config.accumulate_steps,
            schedule_mode=config.schedule_mode,
            vpp_degree=self._vpp_degree(),
            has_aux=self.has_aux,
            has_rng=self.has_rng,
        )

        def grad_fn(params: Any, model_state: None, batch: Any, *rng: Any) -> tuple[tuple, Any]:
            if scale is not None:
                params = params._replace(head=(params.head, scale))
            out, grads = value_and_grad(params, batch, *rng)
            loss, aux = out if self.has_aux else (out, {})
            if scale is None:
                return (loss, aux, None), grads
            return (loss / scale, aux, None), grads._replace(head=grads.head[0])

        return grad_fn

    def _grad_fn(self, scale: jax.Array | None, local: bool = False) -> GradFn:
        """The gradient function: data parallel over the mesh, or, with `local`, of one
        device's own rows (inside the per-replica shard_map)."""
        if self.plan.pipeline is not None:
            return self._pipeline_grad_fn(scale)
        value_and_grad = jax.value_and_grad(self._loss(scale), has_aux=True)

        def grad_fn(params: Any, model_state: Any, batch: Any, *rest: Any) -> tuple[tuple, Any]:
            (_, out), grads = value_and_grad(params, model_state, batch, *rest)
            return out, grads

        plan, axes = self.plan, self._axes
        zero2 = plan.sharding_stage >= 2 and "sharding" in axes and self.mesh.shape["sharding"] > 1
        zero2 = zero2 and plan.pipeline is None  # the pipeline reduces over the data axes itself
        merge = plan.gradient_merge if plan.gradient_merge and plan.gradient_merge.in_step else None
        # Micro-batch gradients accumulate on each device and are reduced once (under GSPMD,
        # XLA would all-reduce every micro-batch's gradient inside the loop).
        explicit = (
            plan.allreduce_dtype is not None
            or zero2
            or plan.hierarchical is not None
            or (merge is not None and self._replicas > 1)
        )
        if merge is not None:
            grad_fn = gradient_merge.microbatched(grad_fn, merge.k_steps, merge.avg)
        if explicit and not local:
            state = self._over_data(self._model_state_specs)
            if zero2:  # each device ends with only its shard of the reduced gradient
                specs = jax.tree.map(
                    _over(axes), self._grad_specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
                )
                reducer = grad_allreduce.scatter_mean(specs)
            elif plan.hierarchical is not None:
                # A node is, by default, the replicas of one process (Paddle: of one machine).
                per_node = plan.hierarchical.ranks_per_node or max(
                    1, self._replicas // jax.process_count()
                )
                dtype = jnp.dtype(plan.allreduce_dtype or jnp.float32)
                reducer = grad_allreduce.hierarchical_mean(self._replicas, per_node, dtype)
                return grad_allreduce.data_parallel(
                    grad_fn, self.mesh, axes, reducer, state_specs=state, check_vma=False
                )
            else:
                dtype = jnp.dtype(plan.allreduce_dtype or jnp.float32)
                reducer, specs = grad_allreduce.mean_in(dtype), None
            grad_fn = grad_allreduce.data_parallel(
                grad_fn, self.mesh, axes, reducer, specs, state_specs=state
            )
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

    def _apply(
        self,
        params: Any,
        opt_state: Any,
        loss_scale: amp.LossScaleState | None,
        loss: jax.Array,
        grads: Any,
        agree: Callable[[jax.Array], jax.Array],
    ) -> tuple[Any, Any, amp.LossScaleState | None, dict[str, Any]]:
        """The optimizer step on `grads`, or under loss scaling the unscale, the finite check
        (`agree` makes all replicas decide alike) and the step or its skip.

        Returns (params, opt_state, loss_scale, extra metrics)."""
        optimizer = optax.with_extra_args_support(self.optimizer)

        def step(grads: Any) -> tuple[Any, Any]:
            # `value` is the loss, which Adaptive LocalSGD adapts its interval to.
            updates, new_opt = optimizer.update(grads, opt_state, params, value=loss)
            return optax.apply_updates(params, updates), new_opt

        if loss_scale is None:
            return (*step(grads), None, {})
        scale = loss_scale.loss_scale
        grads = jax.tree.map(lambda g: g / scale.astype(g.dtype), grads)
        finite = agree(amp.all_finite(grads))
        # A non-finite gradient skips the whole update: params and optimizer state unchanged.
        new_params, new_opt = jax.lax.cond(finite, step, lambda _: (params, opt_state), grads)
        scaling = self.plan.amp.loss_scaling
        if scaling.dynamic:
            loss_scale = amp.update_loss_scale(
                loss_scale,
                finite,
                incr_every_n_steps=scaling.incr_every_n_steps,
                decr_every_n_nan_or_inf=scaling.decr_every_n_nan_or_inf,
                incr_ratio=scaling.incr_ratio,
                decr_ratio=scaling.decr_ratio,
            )
        return new_params, new_opt, loss_scale, {"loss_scale": scale, "skipped": ~finite}

    def _update(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        if self.plan.per_replica:
            return self._update_per_replica(state, batch)
        rest = (jax.random.fold_in(state.rng, state.step),) if self.has_rng else ()
        scale = None if state.loss_scale is None else state.loss_scale.loss_scale
        with self._recompute_scope():
            (loss, aux, model_state), grads = self._grad_fn(scale)(
                state.params, state.model_state, batch, *rest
            )
        # ZeRO-2/3: each device keeps its shard of the gradient (a reduce-scatter).
        grads = constrain(grads, self._grad_sharding)
        opt_state = state.opt_state
        if self.plan.optimizer_offload:  # fetched from pinned host memory for the update
            opt_state = jax.device_put(
                opt_state,
                jax.tree.map(lambda s: s.with_memory_kind("device"), self.state_sharding.opt_state),
            )
        params, opt_state, loss_scale, extra = self._apply(
            state.params, opt_state, state.loss_scale, loss, grads, lambda finite: finite
        )
        new_state = TrainState(
            state.step + 1, params, opt_state, state.rng, loss_scale, model_state
        )
        return new_state, {"loss": loss, **aux, **extra}

    def _update_per_replica(
        self, state: TrainState, batch: Any
    ) -> tuple[TrainState, dict[str, Any]]:
        """One update with every data-parallel replica stepping its own optimizer state."""
        axes, plan = self._axes, self.plan
        mean = lambda tree: jax.tree.map(lambda x: jax.lax.pmean(x, axes), tree)  # noqa: E731
        unstack = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        restack = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731

        def local(params, opt_state, loss_scale, model_state, batch, rng, step_index) -> tuple:
            if plan.replica_params:
                params = unstack(params)
            scale = None if loss_scale is None else loss_scale.loss_scale
            key = jax.random.fold_in(jax.random.fold_in(rng, step_index), jax.lax.axis_index(axes))
            with self._recompute_scope():
                (loss, aux, model_state), grads = self._grad_fn(scale, local=True)(
                    params, model_state, batch, *((key,) if self.has_rng else ())
                )

            def agree(finite: jax.Array) -> jax.Array:
                return jax.lax.pmin(finite.astype(jnp.int32), axes) == 1

            params, opt_state, loss_scale, extra = self._apply(
                params, unstack(opt_state), loss_scale, loss, grads, agree
            )
            if plan.replica_params:
                params = restack(params)
            metrics = {"loss": mean(loss), **mean(aux), **extra}
            return params, restack(opt_state), loss_scale, model_state, metrics

        stacked, rep = PartitionSpec(axes), PartitionSpec()
        params_spec = stacked if plan.replica_params else rep
        # Axes of size 1 are manual too (nothing to partition; see grad_allreduce). The
        # parameter updates of DGC are equal on every replica but typed per replica, so the
        # replication of the outputs is not checked.
        manual = frozenset(axes) | {a for a in self.mesh.axis_names if self.mesh.shape[a] == 1}
        model_spec = self._over_data(self._model_state_specs)
        params, opt_state, loss_scale, model_state, metrics = jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(params_spec, stacked, rep, model_spec, stacked, rep, rep),
            out_specs=(params_spec, stacked, rep, model_spec, rep),
            axis_names=manual,
            check_vma=False,
        )(
            state.params,
            state.opt_state,
            state.loss_scale,
            state.model_state,
            batch,
            state.rng,
            state.step,
        )
        new_state = TrainState(
            state.step + 1, params, opt_state, state.rng, loss_scale, model_state
        )
        return new_state, metrics

    def _over_data(self, specs: Any) -> Any:
        """`specs` as a `shard_map` over the data axes sees them: only their data axes."""
        return jax.tree.map(_over(self._axes), specs, is_leaf=_is_spec)

    # -- the public surface --------------------------------------------------------------------
    def init(self, params: Any, seed: int | jax.Array = 0, model_state: Any = None) -> TrainState:
        """The initial state: `params` placed over the mesh, a fresh optimizer state, the step
        key from `seed` (an int, or raw key data), and, with `has_state`, the `model_state`
        (batch-norm statistics and the like) placed by `state_specs`."""
        self._check_model_state(model_state)
        rng = jax.random.PRNGKey(seed) if isinstance(seed, int) else jnp.asarray(seed)
        if self.plan.pipeline is not None and self._vpp_degree() > 1:
            # Stage s holds chunks s, s + P, ...: the layers are kept in that order (see
            # fleetjax.transforms.pipeline.to_model_order to go back).
            layers = to_pipeline_order(params.layers, self.mesh.shape["pp"], self._vpp_degree())
            params = params._replace(layers=layers)
        self.abstract_state = self.abstract_init(params, rng, model_state)
        shardings = self._state_shardings(self.abstract_state)
        # Each device receives only its part (under ZeRO-3, 1/N of each parameter).
        params_in = shardings.params
        if self.plan.replica_params:  # stacked per replica only inside init
            params_in = jax.tree.map(lambda _: replicated(self.mesh), params)
        placed = jax.device_put(
            (params, rng, model_state),
            (params_in, replicated(self.mesh), shardings.model_state),
        )
        with jax.set_mesh(self.mesh):
            return jax.jit(self._initial_state, out_shardings=shardings)(*placed)

    def _check_model_state(self, model_state: Any) -> None:
        if self.has_state and model_state is None:
            raise ValueError(
                "make_train_step(..., has_state=True) needs the model state: "
                "step.init(params, model_state=...)"
            )
        if not self.has_state and model_state is not None:
            raise ValueError(
                "a model_state was given, but the step was made without has_state=True, so "
                "the loss would never see it"
            )

    def abstract_init(
        self, params: Any, seed: int | jax.Array = 0, model_state: Any = None
    ) -> TrainState:
        """The shapes and dtypes of `init(params, seed, model_state)`'s state
        (`jax.ShapeDtypeStruct`s; nothing is computed or placed), e.g. to `lower` the step
        without real data."""
        self._check_model_state(model_state)
        rng = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
        return jax.eval_shape(self._initial_state, params, rng, model_state)

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One step on the global `batch` (host data is placed here; see `shard_batch`).

        Returns the new state and metrics: `"loss"`, the aux entries, and under AMP loss
        scaling `"loss_scale"` and `"skipped"` (whether a non-finite gradient skipped it).
        On accelerators the call returns at once (JAX's asynchronous dispatch); on simulated
        CPU devices it returns when the step is done."""
        # Layers constrain activations by logical name against the ambient mesh.
        with jax.set_mesh(self.mesh):
            out = self._compiled_step(state)(state, self.shard_batch(batch))
        return jax.block_until_ready(out) if self._one_at_a_time else out

    def run(self, state: TrainState, batches: Sequence[Any]) -> tuple[TrainState, dict[str, Any]]:
        """Several optimizer steps in one compiled call, a `lax.scan` of the step over
        `batches`, with one host round trip (Paddle's
        `execution_strategy.num_iteration_per_run`).

        `batches` holds exactly `num_iteration_per_run` batches (any number under a `Strategy`,
        which has no such knob), each as `__call__` takes it. Returns the state after the last
        step and the metrics of every step, stacked on a leading axis.
        """
        batches = list(batches)
        expected = self.plan.iterations_per_run
        if expected is not None and len(batches) != expected:
            raise ValueError(
                f"run() got {len(batches)} batches, but DistributedStrategy.execution_strategy"
                f".num_iteration_per_run={expected}: pass that many, or change it"
            )
        if not batches:
            raise ValueError("run() got no batches")
        with jax.set_mesh(self.mesh):
            out = self._compiled_run(state, len(batches))(state, self.shard_batch(batches))
        return jax.block_until_ready(out) if self._one_at_a_time else out

    def _compiled_run(self, state: TrainState, steps: int) -> Any:
        if steps not in self._runs:
            self._compiled_step(state)  # the state's placement

            def scan(state: TrainState, batches: list[Any]) -> tuple[TrainState, Any]:
                stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
                return jax.lax.scan(self._update, state, stacked)

            self._runs[steps] = jax.jit(
                scan,
                in_shardings=(self.state_sharding, [self.batch_sharding] * steps),
                out_shardings=(self.state_sharding, replicated(self.mesh)),
                donate_argnums=0,
            )
        return self._runs[steps]

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """The lowered step for `state` and `batch` (only shapes are used; nothing runs)."""
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                self._global_shape(x), x.dtype, sharding=self.batch_sharding
            ),
            self._checked_batch(batch),
        )
        with jax.set_mesh(self.mesh):
            return self._compiled_step(state).lower(state, abstract)

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
        split = lambda: " x ".join(f"{a}={self.mesh.shape[a]}" for a in self._axes)  # noqa: E731

        def check(path: Any, x: Any) -> Any:
            x = x if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)
            name = "batch" + jax.tree_util.keystr(path)
            if x.ndim == 0:
                raise ValueError(f"{name} is a scalar; every batch leaf needs a batch dimension")
            rows = self._global_shape(x)[0]
            if rows % ways:
                raise ValueError(
                    f"{name} has {rows} rows, which do not split evenly over the "
                    f"{ways} data-parallel devices ({split()})"
                )
            if rows % (ways * micro):
                raise ValueError(
                    f"{name} has {rows} rows, which do not split into k_steps={micro} "
                    f"micro-batches on each of the {ways} data-parallel devices ({split()})"
                )
            return x

        return jax.tree_util.tree_map_with_path(check, batch)


def _scaled_head(
    head_loss: Callable[..., Any],
    has_aux: bool,
    head: tuple[Any, jax.Array],
    x: Any,
    batch: Any,
    *rng: Any,
) -> Any:
    """`head_loss` on `head` = (its parameters, the loss scale), its loss times the scale."""
    params, scale = head
    out = head_loss(params, x, batch, *rng)
    return (out[0] * scale, out[1]) if has_aux else out * scale


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _over(axes: tuple[str, ...]) -> Callable[[PartitionSpec], PartitionSpec]:
    """`spec` with only the entries for mesh `axes` (what a shard_map over them sees)."""

    def keep(spec: PartitionSpec) -> PartitionSpec:
        def entry(e: Any) -> Any:
            names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
            kept = tuple(a for a in names if a in axes)
            return None if not kept else kept[0] if len(kept) == 1 else kept

        return PartitionSpec(*(entry(e) for e in spec))

    return keep


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
    param_specs: Any = None,
    has_state: bool = False,
    state_specs: Any = None,
) -> TrainStep:
    """A jitted training step for `loss_fn(params, batch)` under `strategy`.

    Args:
      loss_fn: `loss_fn(params, batch[, rng]) -> scalar` (or `(scalar, aux_dict)` with
        `has_aux=True`; the aux entries join the metrics). It sees the global batch, so a mean
        over it is the data-parallel loss. Under a recompute strategy, mark its layers with
        `fleetjax.recompute` and name activations with `fleetjax.checkpoint_name`.
      optimizer: any optax transformation, or one from `fleet.distributed_optimizer`. Under
        lars, lamb and dgc it is rebuilt as Paddle does (pass `fleetjax.optimizers.momentum`
        or `adam`); localsgd wraps it.
      strategy: a `DistributedStrategy` or `Strategy`; default the optimizer's, else plain
        data parallel.
      mesh: default the optimizer's, else built from the strategy over all devices.
      has_aux: whether `loss_fn` returns `(loss, aux_dict)` (a `PipelineLayer`: whether its
        `head_loss` does; under a pipeline the metrics are averaged over the micro-batches).
      has_rng: whether `loss_fn` takes a third argument, a fresh PRNG key each step (for
        dropout and the like), derived from `state.rng` and `state.step` (a `PipelineLayer`:
        whether its functions take a key last; see `fleetjax.transforms.pipeline.part_keys`).
      param_specs: a pytree of `PartitionSpec`s like the parameters, over the mesh's `mp`
        (and `pp`) axes: how parameters are split for tensor parallelism. Default: from the
        parameters' logical axis names (`fleetjax.layers.partition_specs`; plain arrays are
        replicated). ZeRO adds the `sharding` axis on top.
      has_state: whether the model has variables that the loss updates but gradients do not
        train (batch-norm running statistics): the loss is then
        `loss_fn(params, model_state, batch[, rng])` and returns `(loss, new_model_state)`, or
        `(loss, aux_dict, new_model_state)` with `has_aux`; `TrainState.model_state` keeps it
        (give the first to `step.init(params, model_state=...)`). Under in-step gradient
        merge the micro-batches' new float states are averaged.
      state_specs: `PartitionSpec`s like the model state (default: from its logical axis
        names, e.g. a local `fleetjax.layers.BatchNorm`'s statistics split over the data
        axes; plain arrays replicated).

    Raises:
      NotImplementedError: if the strategy turns on a feature this version cannot apply.
      ValueError: if the strategy's settings contradict each other or `mesh` does not fit.
    """
    if isinstance(optimizer, DistributedOptimizer):
        strategy = strategy if strategy is not None else optimizer.strategy
        mesh = mesh if mesh is not None else optimizer.mesh
    strategy = strategy if strategy is not None else DistributedStrategy()
    if isinstance(strategy, DistributedStrategy) and strategy.auto:
        raise ValueError(
            "DistributedStrategy.auto=True: the planner needs the parameters and an example "
            "batch, which make_train_step does not see; call "
            "plan = fleetjax.auto.plan(loss_fn, optimizer, params, batch, strategy=strategy), "
            "then step = plan.make_train_step() (or edit plan.strategy first)"
        )
    plan = read_plan(strategy)
    xla_flags.apply(strategy)  # before the mesh starts JAX's backend; fleet.init did it already
    if mesh is None:
        mesh = mesh_from_strategy(strategy)
    else:
        _check_mesh(mesh, strategy)
    if isinstance(optimizer, DistributedOptimizer) and optimizer.strategy == strategy:
        optimizer = optimizer.inner  # already rebuilt for this strategy
    else:
        user = optimizer.user if isinstance(optimizer, DistributedOptimizer) else optimizer
        optimizer = optimizer_for_strategy(
            user, strategy, data_parallel_size(mesh), data_axes(mesh)
        )
    return TrainStep(
        loss_fn,
        optimizer,
        strategy,
        plan,
        mesh,
        has_aux,
        has_rng,
        param_specs,
        has_state,
        state_specs,
    )
