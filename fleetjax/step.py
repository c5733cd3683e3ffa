"""`make_train_step`: a loss and an optimizer under a strategy become one distributed step.

    strategy --read_plan--> Plan --mesh_for--> Mesh
    Plan + Mesh + abstract state --place--> Placement
    loss + Plan + Placement --grad_chain--> gradient function
    gradients + optimizer + loss scale --update--> TrainStep (init, __call__, run, lower)

One `jax.jit` over the global batch, split over the data axes; the state lives where the
`Placement` says, and XLA inserts the collectives except where the chain's reducer or a
per-replica optimizer (`transforms.per_replica`) sends them itself. See docs/architecture.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from fleetjax import _liveness
from fleetjax._batch import BatchShapes, abstract_batch, check_batch, place_batch
from fleetjax._chain import Loss, Signature, grad_chain, stage_order
from fleetjax._checks import check_model_state, check_params, check_state
from fleetjax._tables import init_state, step_rows
from fleetjax.distributed_optimizer import bind
from fleetjax.mesh import (
    batch_sharding,
    constrain,
    data_axes,
    data_parallel_size,
    replicated,
    restrict,
)
from fleetjax.placement import Placement, param_shardings, place
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.train_state import TrainState
from fleetjax.transforms import gradient_merge
from fleetjax.transforms.loss_scale import DynamicLossScale, apply_if_finite
from fleetjax.transforms.per_replica import per_replica
from fleetjax.transforms.pipeline import PipelineLayer

__all__ = ["TrainStep", "make_train_step"]


class TrainStep:
    """A compiled training step; make one with `make_train_step`.

    `init(params)` places the parameters and builds the state; `step(state, batch)` returns
    `(new_state, metrics)` and donates `state`; `lower(state, batch)` works from
    `jax.ShapeDtypeStruct`s alone (compile-only devices too).

    Attributes:
      loss_fn, optimizer, strategy, plan, mesh: what the step was made from (`optimizer` is
        what trains: the strategy's rebuild of the user's, with gradient merge across calls).
      signature: what the loss takes and returns (`has_aux`, `has_rng`, `has_state`).
      abstract_state: the state's shapes and dtypes, once a state was seen.
    """

    def __init__(
        self,
        loss_fn: Loss,
        optimizer: Any,
        signature: Signature,
        param_specs: Any = None,
        state_specs: Any = None,
    ) -> None:
        self.loss_fn, self.signature = loss_fn, signature
        self.strategy, self.plan, self.mesh = optimizer.strategy, optimizer.plan, optimizer.mesh
        inner, merge = optimizer.inner, self.plan.gradient_merge
        if merge is not None and not merge.in_step:
            inner = gradient_merge.across_calls(inner, merge.k_steps, merge.avg)
        self.optimizer: optax.GradientTransformation = inner
        self._param_specs, self._state_specs = param_specs, state_specs
        self.batch_sharding = batch_sharding(self.mesh)  # the batch split over the data axes
        self.abstract_state: TrainState | None = None
        self._placement: Placement | None = None
        self._compiled: dict[int | None, Any] = {}  # by steps per call (None: __call__)
        self._issued: TrainState | None = None  # the last state handed out: checked already
        self._shapes = BatchShapes()  # the batch shapes compiled for
        # XLA:CPU runs simulated devices' collectives on one thread pool: a queued step can take
        # it while an all-reduce of the last one waits, and XLA aborts after 40 s (jaxlib
        # 0.10.2, 8 devices on 2 cores). So on CPU one step runs at a time.
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        self._one_at_a_time = on_cpu and self.mesh.devices.size > 1

    # -- placement -------------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        """Where the state, the gradients and the batch live (known once a state was seen:
        after `init`, `abstract_init` or `lower`)."""
        if self._placement is None:
            raise ValueError(
                "the placement is known once the step has seen a state: call "
                "step.init(params) or step.abstract_init(params) first"
            )
        return self._placement

    def _see(self, state: Any) -> Placement:
        """The placement for `state` (real or abstract), computed once per state shape."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        if self._placement is None or abstract != self.abstract_state:
            self.abstract_state = abstract
            specs = {"param_specs": self._param_specs, "state_specs": self._state_specs}
            self._placement = place(self.plan, self.mesh, abstract, self.optimizer, **specs)
            self._compiled.clear()
        return self._placement

    # -- the pure step ---------------------------------------------------------------------
    def _initial_state(self, params: Any, rng: jax.Array, model_state: Any) -> TrainState:
        scaling = self.plan.amp.loss_scaling if self.plan.amp else None
        loss_scale = None if scaling is None else DynamicLossScale.create(**vars(scaling))
        stack = lambda tree: jax.tree.map(  # noqa: E731 (every replica starts alike)
            lambda x: jnp.broadcast_to(x, (data_parallel_size(self.mesh), *x.shape)), tree
        )
        params, opt_state = init_state(self.plan, self.mesh, self.optimizer, params)
        opt_state = stack(opt_state) if self.plan.per_replica else opt_state
        params = stack(params) if self.plan.replica_params else params
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, rng, loss_scale, model_state)

    def _step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One step: the update, or each replica's under a per-replica optimizer."""
        key = jax.random.fold_in(state.rng, state.step) if self.signature.has_rng else None
        if not self.plan.per_replica:
            return self._update(state, batch, key, lambda finite: finite)
        axes = data_axes(self.mesh)
        specs = jax.tree.map(lambda s: restrict(s.spec, axes), self.placement.state)
        stacked = TrainState(False, self.plan.replica_params, True, False, False, False)
        return per_replica(self._update, self.mesh, axes, specs, stacked)(state, batch, key)

    def _update(
        self,
        state: TrainState,
        batch: Any,
        key: jax.Array | None,
        agree: Callable[[jax.Array], jax.Array],
    ) -> tuple[TrainState, dict[str, Any]]:
        """The update: gradients from the chain (a sparse table's for the rows the batch touches;
        per-replica optimizers reduce their own), then the optimizer, or under loss scaling the
        unscale, the finite check (`agree` makes replicas decide alike) and the step or its skip."""
        placement, rest = self.placement, () if key is None else (key,)
        rows = step_rows(self.plan, self.mesh, self.loss_fn, self.signature, state, batch, rest)
        chain = (rows.loss_fn, self.plan, self.mesh, placement, self.signature)
        grad_fn = grad_chain(*chain, state.loss_scale, reduce=not self.plan.per_replica)
        out, grads = grad_fn(rows.params, state.model_state, batch, *rest)
        if placement.grads is not None:  # ZeRO-2/3: each device keeps its shard
            grads = constrain(grads, placement.grads)
        opt_state = state.opt_state
        if self.plan.optimizer_offload:  # fetched from pinned host memory for the update
            opt_state = jax.device_put(opt_state, placement.opt_state_in_update)
        optimizer = optax.with_extra_args_support(self.optimizer)

        def apply(grads: Any) -> tuple[Any, Any]:
            # `value` is the loss, which Adaptive LocalSGD adapts its interval to.
            if rows.tables is not None:  # each table's rule on its touched rows, too
                return rows.apply(optimizer, grads, opt_state, state.params, state.step, out.loss)
            updates, new_opt = optimizer.update(grads, opt_state, state.params, value=out.loss)
            return optax.apply_updates(state.params, updates), new_opt

        if state.loss_scale is None:
            (params, opt_state), loss_scale, extra = apply(grads), None, {}
        else:  # a non-finite gradient leaves parameters and optimizer state unchanged
            kept, scale = (state.params, opt_state), state.loss_scale
            (params, opt_state), loss_scale, extra = apply_if_finite(
                apply, kept, grads, scale, agree
            )
        new = TrainState(state.step + 1, params, opt_state, state.rng, loss_scale, out.model_state)
        return new, {"loss": out.loss, **out.aux, **extra, **rows.metrics}

    # -- the public surface ----------------------------------------------------------------
    def abstract_init(
        self, params: Any, seed: int | jax.Array = 0, model_state: Any = None
    ) -> TrainState:
        """The shapes and dtypes of `init(params, seed, model_state)`'s state
        (`jax.ShapeDtypeStruct`s; nothing is computed or placed). `params` may be arrays or
        `jax.ShapeDtypeStruct`s, e.g. to `lower` the step for devices that are not there."""
        check_model_state(self.signature.has_state, model_state)
        check_params(params)
        params, model_state = stage_order(params, model_state, self.plan, self.loss_fn, self.mesh)
        rng = jax.eval_shape(lambda: jax.random.PRNGKey(seed)) if isinstance(seed, int) else seed
        abstract = jax.eval_shape(self._initial_state, params, rng, model_state)
        self._see(abstract)
        return self.abstract_state

    def init(self, params: Any, seed: int | jax.Array = 0, model_state: Any = None) -> TrainState:
        """The initial state: `params` placed, a fresh optimizer state, the step key from `seed`
        (an int, or raw key data) and, with `has_state`, the `model_state` placed."""
        check_model_state(self.signature.has_state, model_state)
        check_params(params)
        params, model_state = stage_order(params, model_state, self.plan, self.loss_fn, self.mesh)
        rng = jax.random.PRNGKey(seed) if isinstance(seed, int) else jnp.asarray(seed)
        placement = self._see(jax.eval_shape(self._initial_state, params, rng, model_state))
        # Each device receives only its part (under ZeRO-3, 1/N of each parameter).
        params_in = param_shardings(self.plan, self.mesh, params, self._param_specs)
        placed = jax.device_put(
            (params, rng, model_state),
            (params_in, replicated(self.mesh), placement.model_state),
        )
        with jax.set_mesh(self.mesh), _liveness.busy():  # compiling: progress to fleetjax-run
            self._issued = jax.jit(self._initial_state, out_shardings=placement.state)(*placed)
        return self._issued

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        """One step on the global `batch` (host data is placed here; see `shard_batch`).

        Returns the new state and metrics: `"loss"`, the aux entries, and under AMP loss
        scaling `"loss_scale"` and `"skipped"` (whether a non-finite gradient skipped it).
        On accelerators the call returns at once (JAX's asynchronous dispatch); on simulated
        CPU devices it returns when the step is done."""
        batch = self.shard_batch(batch)
        self._shapes.note(batch)
        return self._called(state, batch)

    def _called(self, state: TrainState, batch: Any, steps: int | None = None) -> tuple:
        """The compiled step on `state` and `batch`, after checking a state it did not issue."""
        if state is not self._issued and self.abstract_state is not None:
            check_state(state, self.abstract_state, self.placement.state)
        compiled = self.compiled(state, steps)
        # Layers constrain activations by logical name against the ambient mesh; each step is
        # progress for fleetjax-run's hang watch, and so is the first call's compiling.
        with jax.set_mesh(self.mesh), _liveness.progress(self, steps):
            out = compiled(state, batch)
        self._issued = out[0]
        return jax.block_until_ready(out) if self._one_at_a_time else out

    def run(self, state: TrainState, batches: Sequence[Any]) -> tuple[TrainState, dict[str, Any]]:
        """`num_iteration_per_run` steps (Paddle's `execution_strategy`; any number under a
        `Strategy`) in one compiled call, a `lax.scan` over `batches`, each as `__call__` takes
        it. Returns the last state and every step's metrics, stacked on a leading axis."""
        batches = list(batches)
        expected = self.plan.iterations_per_run
        if expected is not None and len(batches) != expected:
            raise ValueError(
                f"run() got {len(batches)} batches, but DistributedStrategy.execution_strategy"
                f".num_iteration_per_run={expected}: pass that many, or change it"
            )
        if not batches:
            raise ValueError("run() got no batches")
        return self._called(state, self.shard_batch(batches), len(batches))

    def compiled(self, state: Any, steps: int | None = None) -> Any:
        """The jitted step for states like `state` (`steps` given: a scan of that many steps
        over a list of batches, as `run` takes them)."""
        if steps in self._compiled:  # the fast path of every call
            return self._compiled[steps]
        fn, batch, placement = self._step, self._see(state).batch, self.placement
        if steps is not None:

            def fn(state: TrainState, batches: list[Any]) -> tuple[TrainState, Any]:
                stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
                return jax.lax.scan(self._step, state, stacked)

            batch = [batch] * steps
        self._compiled[steps] = jax.jit(
            fn,
            in_shardings=(placement.state, batch),
            out_shardings=(placement.state, replicated(self.mesh)),
            donate_argnums=0,
        )
        return self._compiled[steps]

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """The lowered step for `state` and `batch`: arrays or `jax.ShapeDtypeStruct`s (only
        shapes are used; nothing runs)."""
        abstract = abstract_batch(self._checked(batch), self.batch_sharding)
        with jax.set_mesh(self.mesh):
            return self.compiled(state).lower(self.placement.shapes(state), abstract)

    def shard_batch(self, batch: Any) -> Any:
        """`batch` as global arrays split over the data axes, resharded if need be: host
        arrays are this process's rows of the global batch, JAX arrays global already."""
        return place_batch(self._checked(batch), self.batch_sharding)

    def _checked(self, batch: Any) -> Any:
        merge = self.plan.in_step_merge
        return check_batch(batch, self.mesh, merge.k_steps if merge is not None else 1)


def make_train_step(
    loss_fn: Loss,
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
        `fleetjax.recompute` and name activations with `fleetjax.checkpoint_name`. Under a
        pipeline, a `fleetjax.PipelineLayer`.
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
        merge and a pipeline (a `PipelineParams` state) micro-batches' new float states are
        averaged.
      state_specs: `PartitionSpec`s like the model state (default: from its logical axis
        names, e.g. a local `fleetjax.layers.BatchNorm`'s statistics split over the data
        axes; plain arrays replicated).

    Raises:
      NotImplementedError: if the strategy turns on a feature this version cannot apply.
      ValueError: if the strategy's settings contradict each other or `mesh` does not fit.
      TypeError: under a pipeline, for a loss that is not a `PipelineLayer`.
    """
    bound = bind(optimizer, strategy, mesh)
    plan = bound.plan
    if plan.auto:
        raise ValueError(
            "DistributedStrategy.auto=True: the planner needs the parameters and an example "
            "batch, which make_train_step does not see; call "
            "found = fleetjax.auto.search(loss_fn, optimizer, params, batch, strategy=strategy), "
            "then step = found.make_train_step() (or edit found.strategy first)"
        )
    if plan.pipeline is not None and not isinstance(loss_fn, PipelineLayer):
        raise TypeError(
            "the strategy asks for a pipeline, which needs the model cut into stages: "
            "pass fleetjax.PipelineLayer(embed, stage, head_loss) as the loss, with "
            f"PipelineParams, not {type(loss_fn).__name__}"
        )
    return TrainStep(
        loss_fn, bound, Signature(has_aux, has_rng, has_state), param_specs, state_specs
    )
