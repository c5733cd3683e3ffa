"""`make_train_step`: a loss and an optimizer under a strategy become one distributed step.

    strategy --read_plan--> Plan --mesh_for--> Mesh; optimizer --rebuild--> what trains
    Plan + Mesh + abstract state --place--> Placement; the model's sparse tables
    all of it: a StepSpec, made once per state shape
    train_step(spec, state, batch): the gradient chain, then the update (pure)
    TrainStep: the host's part (init, __call__, run, lower; placing, compiling, caching)

One `jax.jit` over the global batch, split over the data axes; the state lives where the
`Placement` says, and XLA inserts the collectives except where the chain's reducer or a
per-replica optimizer (`transforms.per_replica`) sends them itself. See docs/architecture.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from fleetjax import _liveness
from fleetjax._batch import (
    BatchShapes,
    abstract_batch,
    check_batch,
    check_run_batches,
    place_batch,
)
from fleetjax._chain import Signature, grad_chain
from fleetjax._checks import check_model_state, check_params, check_state
from fleetjax._tables import Tables
from fleetjax._update import StepSpec, initial_state, replica_state, train_step, update
from fleetjax.distributed_optimizer import DistributedOptimizer, bind
from fleetjax.mesh import batch_sharding, replicated
from fleetjax.placement import Loss, Placement, param_shardings
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.train_state import TrainState
from fleetjax.transforms.pipeline import PipelineLayer

__all__ = [
    "Signature",
    "StepSpec",
    "TrainStep",
    "grad_chain",
    "make_train_step",
    "train_step",
    "update",
]


def _abstract(tree: Any) -> Any:
    """`tree`'s shapes and dtypes, without shardings: what specs are found by."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


class TrainStep:
    """A compiled training step; make one with `make_train_step`.

    `init(params)` places the parameters and builds the state; `step(state, batch)` returns
    `(new_state, metrics)` and donates `state`; `lower(state, batch)` works from
    `jax.ShapeDtypeStruct`s alone (compile-only devices too). The step itself is
    `fleetjax.step.train_step(spec, state, batch)`, a pure function of the state's `StepSpec`
    (`spec(state)`); this object does the host's part: placing, compiling, caching by state
    shape and calling.

    Attributes:
      loss_fn, optimizer, strategy, plan, mesh: what the step was made from (`optimizer` is
        what trains: the strategy's rebuild of the user's, with gradient merge across calls).
      signature: what the loss takes and returns (`has_aux`, `has_rng`, `has_state`).
      abstract_state, placement: the shapes and dtypes of the step's state, the one `init`
        or `abstract_init` made, and its `Placement` (None, and an error, before either).
        They depend on the parameters alone, not on the order of calls; once `init` and
        `abstract_init` made states of several shapes they are ambiguous (an error), and
        `spec(state).placement` is each state's.
    """

    def __init__(
        self,
        loss_fn: Loss,
        optimizer: DistributedOptimizer,
        signature: Signature,
        param_specs: Any = None,
        state_specs: Any = None,
    ) -> None:
        self.loss_fn, self.signature = loss_fn, signature
        self.strategy, self.plan, self.mesh = optimizer.strategy, optimizer.plan, optimizer.mesh
        self.optimizer: optax.GradientTransformation = optimizer.rebuilt
        self._placing = {"param_specs": param_specs, "state_specs": state_specs}
        self.batch_sharding = batch_sharding(self.mesh)  # the batch split over the data axes
        self._specs: list[tuple[TrainState, StepSpec]] = []  # by state shape
        self._made_by_init: list[tuple[TrainState, StepSpec]] = []  # init / abstract_init's
        self._compiled: dict[tuple[StepSpec, int | None], Any] = {}  # steps per call (None: 1)
        self._issued: tuple[TrainState, StepSpec] | None = None  # the last state handed out
        self._shapes = BatchShapes()  # the batch shapes compiled for
        # XLA:CPU runs simulated devices' collectives on one thread pool: a queued step can take
        # it while an all-reduce of the last one waits, and XLA aborts after 40 s (jaxlib
        # 0.10.2, 8 devices on 2 cores). So on CPU one step runs at a time.
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        self._one_at_a_time = on_cpu and self.mesh.devices.size > 1

    # -- specs and placement ---------------------------------------------------------------
    @property
    def abstract_state(self) -> TrainState | None:
        """The shapes and dtypes of the state `init` / `abstract_init` made (None before)."""
        return self._own()[0] if self._made_by_init else None

    @property
    def placement(self) -> Placement:
        """Where the step's state (`abstract_state`), the gradients and the batch live."""
        return self._own()[1].placement

    def _own(self) -> tuple[TrainState, StepSpec]:
        """The shapes and spec of the state `init` / `abstract_init` made, whatever order
        they ran in; ambiguous once they made states of several shapes."""
        if not self._made_by_init:
            raise ValueError(
                "the placement is known once the step has made a state: call "
                "step.init(params) or step.abstract_init(params) first"
            )
        if len(self._made_by_init) > 1:
            raise ValueError(
                f"this step made states of {len(self._made_by_init)} shapes (init or "
                "abstract_init with different parameters), so it has no one placement: "
                "use step.spec(state).placement for the state you mean"
            )
        return self._made_by_init[0]

    def spec(self, state: Any) -> StepSpec:
        """The `StepSpec` of states like `state` (arrays or `jax.ShapeDtypeStruct`s), made once
        per state shape: its placement computed and its sparse tables found (nothing runs)."""
        if self._issued is not None and state is self._issued[0]:
            return self._issued[1]
        abstract = _abstract(state)
        tables = lambda: Tables.find(self.plan, self.mesh, abstract.params)  # noqa: E731
        return self._known(abstract) or self._kept(abstract, self._placed(abstract, tables()))

    def _known(self, abstract: TrainState) -> StepSpec | None:
        return next((spec for seen, spec in self._specs if seen == abstract), None)

    def _placed(self, abstract: TrainState, tables: Tables | None) -> StepSpec:
        made = (self.plan, self.mesh, self.optimizer, self.loss_fn, self.signature)
        return StepSpec.make(*made, abstract, tables, **self._placing)

    def _kept(self, shapes: TrainState, spec: StepSpec) -> StepSpec:
        """`spec`, kept as the spec of states of `shapes`."""
        self._specs.append((shapes, spec))
        return spec

    def _initial(self, params: Any, seed: int | jax.Array, model_state: Any, abstract: bool):
        """(the inputs (params, rng, model_state) of `initial_state`, the state's spec, its
        shapes), noting them as a state `init` / `abstract_init` made."""
        check_model_state(self.signature.has_state, model_state)
        check_params(params)
        if isinstance(seed, int):
            key = lambda: jax.random.PRNGKey(seed)  # noqa: E731
            rng = jax.eval_shape(key) if abstract else key()
        else:
            rng = seed if abstract else jnp.asarray(seed)
        inputs, tables = (params, rng, model_state), Tables.find(self.plan, self.mesh, params)
        # Placed from one replica's state (the step keeps some parts once per replica).
        one = functools.partial(replica_state, self.plan, self.optimizer, tables)
        spec = self._placed(jax.eval_shape(one, *inputs), tables)
        shapes = jax.eval_shape(functools.partial(initial_state, spec), *inputs)
        spec = self._known(shapes) or self._kept(shapes, spec)
        if all(seen != shapes for seen, _ in self._made_by_init):
            self._made_by_init.append((shapes, spec))
        return inputs, spec, shapes

    # -- the public surface ----------------------------------------------------------------
    def abstract_init(
        self, params: Any, seed: int | jax.Array = 0, model_state: Any = None
    ) -> TrainState:
        """The shapes and dtypes of `init(params, seed, model_state)`'s state
        (`jax.ShapeDtypeStruct`s; nothing is computed or placed). `params` may be arrays or
        `jax.ShapeDtypeStruct`s, e.g. to `lower` the step for devices that are not there."""
        return self._initial(params, seed, model_state, abstract=True)[2]

    def init(self, params: Any, seed: int | jax.Array = 0, model_state: Any = None) -> TrainState:
        """The initial state: `params` placed, a fresh optimizer state, the step key from `seed`
        (an int, or raw key data) and, with `has_state`, the `model_state` placed."""
        (params, rng, model_state), spec, _ = self._initial(params, seed, model_state, False)
        # Each device receives only its part (under ZeRO-3, 1/N of each parameter).
        params_in = param_shardings(self.plan, self.mesh, params, self._placing["param_specs"])
        placed = jax.device_put(
            (params, rng, model_state),
            (params_in, replicated(self.mesh), spec.placement.model_state),
        )
        with jax.set_mesh(self.mesh), _liveness.busy():  # compiling: progress to fleetjax-run
            fresh = functools.partial(initial_state, spec)
            state = jax.jit(fresh, out_shardings=spec.placement.state)(*placed)
        self._issued = (state, spec)
        return state

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
        issued = self._issued is not None and state is self._issued[0]
        spec = self.spec(state) if issued or not self._made_by_init else self._checked(state)
        compiled = self._compiled_for(spec, steps)
        # Layers constrain activations by logical name against the ambient mesh; each step is
        # progress for fleetjax-run's hang watch, and so is the first call's compiling.
        with jax.set_mesh(self.mesh), _liveness.progress(self, (spec, steps)):
            out = compiled(state, batch)
        self._issued = (out[0], spec)
        return jax.block_until_ready(out) if self._one_at_a_time else out

    def _checked(self, state: TrainState) -> StepSpec:
        """The spec of a state the step did not issue, after checking it fits one it knows
        (else one `init` made: the error says how it differs)."""
        abstract = _abstract(state)
        seen, spec = next(((a, s) for a, s in self._specs if a == abstract), self._made_by_init[0])
        check_state(state, seen, spec.placement.state)
        return spec

    def run(self, state: TrainState, batches: Sequence[Any]) -> tuple[TrainState, dict[str, Any]]:
        """`num_iteration_per_run` steps (Paddle's `execution_strategy`; any number under a
        `Strategy`) in one compiled call, a `lax.scan` over `batches`, each as `__call__` takes
        it. Returns the last state and every step's metrics, stacked on a leading axis."""
        batches = list(batches)
        check_run_batches(batches, self.plan.iterations_per_run)
        return self._called(state, self.shard_batch(batches), len(batches))

    def compiled(self, state: Any, steps: int | None = None) -> Any:
        """The jitted step for states like `state` (`steps` given: a scan of that many steps
        over a list of batches, as `run` takes them)."""
        return self._compiled_for(self.spec(state), steps)

    def _compiled_for(self, spec: StepSpec, steps: int | None) -> Any:
        if (spec, steps) in self._compiled:  # the fast path of every call
            return self._compiled[spec, steps]
        fn, batch = functools.partial(train_step, spec), spec.placement.batch
        if steps is not None:

            def fn(state: TrainState, batches: list[Any]) -> tuple[TrainState, Any]:
                stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
                return jax.lax.scan(functools.partial(train_step, spec), state, stacked)

            batch = [batch] * steps
        self._compiled[spec, steps] = jax.jit(
            fn,
            in_shardings=(spec.placement.state, batch),
            out_shardings=(spec.placement.state, replicated(self.mesh)),
            donate_argnums=0,
        )
        return self._compiled[spec, steps]

    def lower(self, state: TrainState, batch: Any) -> jax.stages.Lowered:
        """The lowered step for `state` and `batch`: arrays or `jax.ShapeDtypeStruct`s (only
        shapes are used; nothing runs)."""
        abstract = abstract_batch(self._checked_batch(batch), self.batch_sharding)
        spec = self.spec(state)
        with jax.set_mesh(self.mesh):
            return self._compiled_for(spec, None).lower(spec.placement.shapes(state), abstract)

    def shard_batch(self, batch: Any) -> Any:
        """`batch` as global arrays split over the data axes, resharded if need be: host
        arrays are this process's rows of the global batch, JAX arrays global already."""
        checked = self._checked_batch(batch)
        self._shapes.agree(checked)  # with several processes: the same shapes on each
        return place_batch(checked, self.batch_sharding)

    def _checked_batch(self, batch: Any) -> Any:
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
