"""The search: candidate layouts compiled one by one (nothing runs), pruned where they cannot
fit or cannot win, and the fastest that fits chosen.

**Pruning** (so that the search compiles a handful of steps, not all of them); the report says
which rule skipped a candidate:

* a candidate whose train state and gradients alone exceed the budget (`fleetjax.auto._memory`:
  from the placement, before lowering) is not compiled: it cannot fit;
* activations depend on the rows per device and the mp and pp split, not on ZeRO: a compiled
  layout predicts them for every layout split alike (divided by in-step micro-batches), and a
  candidate whose formula plus that is over `SAVING_MARGIN` times the budget is not compiled
  (a prediction, not a bound);
* ZeRO over ``dp x sharding`` devices is skipped where pure data parallelism over the same
  devices (same mp, pp and savers) fits: it computes the same matmuls and communicates at least
  as much. Recompute and more micro-batches only add matmuls, so they are skipped where the
  same layout with fewer of them fits, and their matmul time is never below the layout's
  without them (XLA may rewrite a one-row matmul into a reduction, which the matmul count
  misses); their memory term and communication may fall (what recompute no longer keeps, reads
  and gathers), so those are not bounded by the layout's;
* memory savers shrink activations, which depend on the rows per device and the mp and pp
  split, not on ZeRO: a saver variant is skipped when its layout is over the budget by more
  than `SAVING_MARGIN` (1.25) times what the same savers saved on a compiled layout with the
  same split (a prediction, not a bound);
* a candidate is skipped if a lower bound of its time is no better than the best candidate
  found: an even split of the model's matmul flops (traced from the loss), times the
  pipeline's ideal bubble ``(m + pp - 1) / m``, plus one latency and the ring all-reduce of the
  gradients ``2 (n-1)/n x parameter bytes / (mp pp)`` over its ``n = dp x sharding`` replicas
  at the bandwidth of what that group crosses (for savers: their layout's estimate).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax

from fleetjax import targets
from fleetjax._chain import Signature, checked_output
from fleetjax.auto._isolated import Compiled, CompileFailed, Compiler
from fleetjax.auto._layouts import (
    Layout,
    activations_scale,
    all_layouts,
    savers,
    sequence_layouts,
    split,
    uses_mp,
)
from fleetjax.auto._memory import Formula, default_memory_budget, formula
from fleetjax.auto._result import (
    CANNOT_APPLY,
    FAILED,
    FITS,
    OVER_BUDGET,
    SKIPPED,
    Candidate,
    SearchResult,
    name,
    table,
)
from fleetjax.cost import (
    DeviceSpec,
    bytes_text,
    compiled_bytes,
    model_flops,
    network_share,
    step_cost,
)
from fleetjax.distributed_optimizer import DistributedOptimizer
from fleetjax.layers import partition_specs
from fleetjax.mesh import simulation_hint
from fleetjax.plan import mesh_for, read_plan
from fleetjax.step import TrainStep, make_train_step
from fleetjax.strategy import DistributedStrategy
from fleetjax.transforms.pipeline import PipelineLayer, PipelineParams
from fleetjax.vocabulary import DATA_AXES

# Memory savers shrink the activations, which depend on the rows per device and the mp and pp
# split, not on ZeRO: what they saved on one layout predicts what they save on another with the
# same split. A layout over the budget by more than this times that is not tried with them.
SAVING_MARGIN = 1.25


def _rows(batch: Any) -> int:
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("batch is empty; pass an example global batch (a pytree of arrays)")
    shapes = [np.shape(x) for x in leaves]
    if any(len(s) == 0 for s in shapes) or len({s[0] for s in shapes}) != 1:
        raise ValueError(
            "every batch leaf needs the same leading (batch) dimension, got shapes "
            f"{[tuple(s) for s in shapes]}"
        )
    return shapes[0][0] * jax.process_count()


@dataclasses.dataclass
class _Planner:
    """Builds, lowers and compiles candidates; holds what every candidate shares."""

    loss_fn: Callable[..., Any]
    optimizer: optax.GradientTransformation
    params: Any
    batch: Any
    base: DistributedStrategy
    budget: int
    device: DeviceSpec
    param_specs: Any
    step_options: Mapping[str, bool]
    rows: int
    devices: Sequence[jax.Device]
    compile: Compiler = dataclasses.field(default_factory=Compiler)
    done: list[Candidate] = dataclasses.field(default_factory=list)
    sequence_parallel: Callable[..., Any] | None = None  # the loss's sequence-parallel form

    @functools.cached_property
    def param_bytes(self) -> int:
        shapes = jax.eval_shape(lambda p: p, self.params)
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))

    @functools.cached_property
    def flops(self) -> float:
        """The model's matmul flops per device split evenly over all devices (traced)."""
        key = (jax.eval_shape(lambda: jax.random.key(0)),) if self.step_options["has_rng"] else ()
        signature = Signature(self.step_options["has_aux"], self.step_options["has_rng"], False)

        def loss(*args: Any) -> Any:  # what a step would say of a loss that is no scalar
            return checked_output(self.loss_fn(*args), signature)

        grad = jax.value_and_grad(loss, has_aux=self.step_options["has_aux"])
        return model_flops(grad, self.params, self.batch, *key) / len(self.devices)

    def add(self, layout: Layout | None, strategy: Any, status: str, **kw: Any) -> Candidate:
        candidate = Candidate(len(self.done) + 1, layout, strategy, status, **kw)
        self.done.append(candidate)
        return candidate

    def measure(
        self,
        strategy: DistributedStrategy,
        layout: Layout | None,
        always_compile: bool,
        floor: Candidate | None = None,
    ) -> Candidate:
        """Lower `strategy`'s step for the abstract state and the batch, and compile it unless
        its memory formula is over the budget (or `always_compile`). Its estimated compute and
        communication are at least `floor`'s (its layout without memory savers). A step XLA
        refuses or aborts on (in the worker process: see `fleetjax.auto._isolated`) fails with
        XLA's message."""
        try:
            step = self.step(strategy, layout)
            state = step.abstract_init(self.params)
            layout = layout or Layout.of(step)
            bytes_by_formula = formula(step)
            note = "" if always_compile else self.over_by_formula(layout, bytes_by_formula)
            if note:
                return self.add(
                    layout,
                    strategy,
                    OVER_BUDGET,
                    note=note,
                    state_bytes=bytes_by_formula.state,
                    formula_bytes=bytes_by_formula.floor,
                )
            lowered = step.lower(state, self.batch)
        except (ValueError, TypeError, NotImplementedError) as e:
            return self.add(layout, strategy, CANNOT_APPLY, note=str(e))
        try:
            compiled = self.compile(lowered)
        except CompileFailed as e:
            return self.add(
                layout,
                strategy,
                FAILED,
                note=str(e),
                state_bytes=bytes_by_formula.state,
                formula_bytes=bytes_by_formula.floor,
            )
        return self.compiled(step, strategy, layout, compiled, bytes_by_formula, floor)

    def over_by_formula(self, layout: Layout, bytes_by_formula: Formula) -> str:
        """Why `layout` cannot fit by its memory formula ("" if it may): its state and gradients
        alone, or with the activations of a compiled layout that splits them alike (what that
        one holds beyond its own formula, divided by in-step micro-batches: a prediction, with
        `SAVING_MARGIN`)."""
        floor = bytes_by_formula.floor
        if floor > self.budget:
            return f"its state and gradients alone are {bytes_text(floor)} (formula)"
        for c in self.done:
            if c.device_bytes is None:
                continue
            scale = activations_scale(c.layout, layout, self.rows)
            if scale is None:
                continue
            rest = (c.device_bytes - c.formula_bytes) * scale
            if floor + rest > SAVING_MARGIN * self.budget:
                return (
                    f"predicted over, its state and gradients ({bytes_text(floor)}) and "
                    f"{bytes_text(rest)} of activations as on #{c.index}"
                )
        return ""

    def step(self, strategy: DistributedStrategy, layout: Layout | None) -> TrainStep:
        """The train step of `strategy` over the devices searched."""
        mesh = mesh_for(read_plan(strategy), self.devices)
        loss_fn = self.loss_fn
        if layout is not None:
            loss_fn = layout.loss(loss_fn, self.sequence_parallel)
        options = {"param_specs": self.param_specs, **self.step_options}
        return make_train_step(loss_fn, self.optimizer, strategy, mesh, **options)

    def compiled(
        self,
        step: TrainStep,
        strategy: DistributedStrategy,
        layout: Layout,
        compiled: Compiled,
        bytes_by_formula: Formula,
        floor: Candidate | None,
    ) -> Candidate:
        """The candidate of a compiled step: its bytes against the budget, its estimate."""
        memory = compiled.memory_analysis()
        on_device, note = compiled_bytes(memory), ""
        if bytes_by_formula.host and not memory.host_argument_size_in_bytes:
            # Compile-only devices have no host memory: XLA kept the offloaded state on device.
            on_device -= bytes_by_formula.host
            note = "offloaded state from the formula"
        xla = compiled.cost_analysis() or {}  # None for compile-only GPUs
        xla = xla[0] if isinstance(xla, (list, tuple)) else xla
        cost = step_cost(compiled, self.device, step.mesh)
        cost = cost._replace(host_bytes=2.0 * bytes_by_formula.host)  # fetched and written back
        compute, communication = cost.seconds(self.device)
        # No layout computes less than an even split of the model's matmuls (XLA may rewrite a
        # one-row matmul into a reduction, which the matmul count misses).
        compute = max(compute, self.flops / self.device.peak_flops)
        if floor is not None and floor.cost is not None:
            if self.savers_only_add(floor.layout):
                compute = max(compute, floor.compute_s)
                communication = max(communication, floor.communication_s)
            else:
                compute = max(compute, floor.cost.matmul_flops / self.device.peak_flops)
        fits = on_device <= self.budget
        if not fits:
            note = "; ".join(filter(None, [f"over by {bytes_text(on_device - self.budget)}", note]))
        return self.add(
            layout,
            strategy,
            FITS if fits else OVER_BUDGET,
            note=note,
            state_bytes=bytes_by_formula.state,
            formula_bytes=bytes_by_formula.floor,
            device_bytes=on_device,
            memory=memory,
            xla_flops=xla.get("flops"),
            xla_bytes_accessed=xla.get("bytes accessed"),
            cost=cost,
            compute_s=compute,
            communication_s=communication,
        )

    def best(self) -> Candidate | None:
        """The fastest candidate that fits; on a tie, the simplest."""
        fitting = [c for c in self.done if c.fits]
        return min(fitting, key=lambda c: (c.time_s, c.layout.order()), default=None)

    def search(self, layouts: list[Layout], sequences: list[Layout]) -> None:
        """Consider `layouts` in order; then offload on the ZeRO layouts over the budget; then
        memory savers on top of those whose train state fits but whose step does not, fastest
        first; then, if none fits, the context-parallel `sequences`; pruning as the module
        docstring says."""
        # Pure data parallelism is always compiled, the baseline of the report.
        baseline = Layout(len(self.devices))
        for layout in layouts:
            self.consider(layout, always_compile=layout == baseline)
        # ZeRO layouts over the budget try the optimizer state in pinned host memory, where
        # there is one apart from the devices' (a CPU device's memory is the host's).
        if self.devices[0].platform != "cpu":
            over = [c for c in self.done if c.status == OVER_BUDGET and c.layout.sharding > 1]
            for c in over:
                if not c.layout.offload:
                    self.consider(dataclasses.replace(c.layout, offload=True))
        # Savers only add matmuls: a layout whose matmuls alone are no faster than the best
        # candidate needs none.
        short = [
            c
            for c in self.done
            if c.status == OVER_BUDGET and c.time_s is not None and c.formula_bytes <= self.budget
        ]
        tried: set[tuple[int, ...]] = set()
        for base in sorted(short, key=lambda c: (c.time_s, c.layout.order())):
            best = self.best()
            bound = max(self.lower_bound(base.layout), self.savers_floor(base))
            if split(base.layout) in tried or (best is not None and bound >= best.time_s):
                continue
            tried.add(split(base.layout))
            for lean in self.alike(base):
                for layout in savers(lean.layout, self.rows):
                    self.consider(layout, floor=lean if lean.cost is not None else None)
        # A sequence too long for any layout above: split it over cp (ring attention).
        for layout in sequences if self.best() is None else ():
            self.consider(layout)

    def savers_only_add(self, layout: Layout) -> bool:
        """Whether memory savers only add work to `layout`'s estimate: without a memory term
        and a pipeline. Recompute and micro-batches add matmuls (or split them), never take any
        away; but what recompute no longer keeps a step no longer reads and writes (the memory
        term) and a pipeline no longer gathers (its kept inputs split over mp)."""
        return self.device.hbm_bandwidth is None and layout.pp == 1

    def savers_floor(self, base: Candidate) -> float:
        """A time no memory saver on `base`'s layout beats: its estimate where savers only add
        work, else the time of its matmuls."""
        if self.savers_only_add(base.layout):
            return base.time_s
        return base.cost.matmul_flops / self.device.peak_flops

    def alike(self, base: Candidate) -> list[Candidate]:
        """The layouts over the budget that split the activations as `base` does and whose
        state and gradients fit, simplest first (pure data parallelism, then the least ZeRO),
        without offload before with it (offload costs PCIe time): savers shrink the
        activations alone, alike for all of them, and the simplest that then fits is the
        fastest (the others it dominates are skipped). One that fits already needs none."""
        alike = [
            c
            for c in self.done
            if c.layout is not None
            and c.formula_bytes is not None
            and c.formula_bytes <= self.budget
            and not c.fits
            and split(c.layout) == split(base.layout)
        ]
        return sorted(alike, key=lambda c: (c.layout.offload, c.layout.order()))

    def consider(
        self, layout: Layout, always_compile: bool = False, floor: Candidate | None = None
    ) -> Candidate:
        strategy = layout.strategy(self.base, self.rows)
        if reason := self.pruned(layout):
            return self.add(layout, strategy, SKIPPED, note=reason)
        return self.measure(strategy, layout, always_compile, floor)

    def pruned(self, layout: Layout) -> str:
        """Why `layout` need not be compiled ("" if it must be)."""
        bound = self.lower_bound(layout)
        for c in self.done:
            if c.fits and c.layout.dominates(layout):
                return f"#{c.index} fits and costs no more"
            if c.status == CANNOT_APPLY and c.layout.recompute and layout.recompute:
                without = dataclasses.replace(c.layout, recompute=False)
                if any(d.layout == without and d.status != CANNOT_APPLY for d in self.done):
                    return f"recompute cannot apply (#{c.index})"
            if c.layout.placement != layout.placement:
                continue
            if c.formula_bytes is not None and c.formula_bytes > self.budget:
                return f"its state and gradients are #{c.index}'s, {bytes_text(c.formula_bytes)}"
            if c.layout == layout.base and c.cost is not None:
                bound = max(bound, self.savers_floor(c))
        if reason := self.predicted_over(layout):
            return reason
        best = self.best()
        if best is not None and bound >= best.time_s:
            return (
                f"cannot beat #{best.index}: at least {bound * 1e3:.3g} ms vs "
                f"{best.time_s * 1e3:.3g} ms"
            )
        return ""

    def predicted_over(self, layout: Layout) -> str:
        """Why savers will not make `layout` fit, judged by what the same savers saved on a
        compiled layout that splits the activations alike ("" if nothing says so)."""
        compiled = {c.layout: c for c in self.done if c.device_bytes is not None}
        base = compiled.get(layout.base)
        seen = next(
            (
                c
                for c in compiled.values()
                if c.layout != c.layout.base
                and c.layout.base in compiled
                and split(c.layout) == split(layout)
            ),
            None,
        )
        if layout == layout.base or base is None or seen is None:
            return ""
        saved = compiled[seen.layout.base].device_bytes - seen.device_bytes
        over = base.device_bytes - self.budget
        if over <= SAVING_MARGIN * saved:
            return ""
        return (
            f"the same savers saved {bytes_text(saved)} on #{seen.index}; "
            f"this is {bytes_text(over)} over"
        )

    def lower_bound(self, layout: Layout) -> float:
        """A time no step with `layout` can beat (see the module docstring)."""
        compute = self.flops / self.device.peak_flops
        if layout.pp > 1:
            compute *= (layout.micro_batches + layout.pp - 1) / layout.micro_batches
        n = layout.replicas
        if n == 1:
            return compute
        grads = 2 * (n - 1) / n * self.param_bytes / (layout.mp * layout.pp)
        share = self.network_share(layout)
        network = self.device.network_bandwidth or self.device.link_bandwidth
        wire = grads * (1 - share) / self.device.link_bandwidth + grads * share / network
        return compute + self.device.latency + wire

    def network_share(self, layout: Layout) -> float:
        """The share of a gradient reduction over `layout`'s replicas that crosses the network
        (`fleetjax.cost.network_share` of the data axes' group of the first device)."""
        mesh = mesh_for(read_plan(layout.strategy(self.base, self.rows)), self.devices)
        index = tuple(slice(None) if a in DATA_AXES else 0 for a in mesh.axis_names)
        group = mesh.devices[index].flatten()
        hosts = [d.process_index for d in mesh.devices.flat]
        position = {d: i for i, d in enumerate(mesh.devices.flat)}
        return network_share([[position[d] for d in group]], hosts)


def _reason(chosen: Candidate, candidates: Sequence[Candidate], devices: int) -> str:
    fitting = [c for c in candidates if c.fits]
    pure = next((c for c in candidates if c.layout == Layout(devices)), None)
    time = f"{chosen.time_s * 1e3:.3g} ms"
    if chosen is pure:
        return (
            f"pure data parallelism fits ({bytes_text(chosen.device_bytes)} per device) and no "
            f"other candidate is estimated faster ({time})"
        )
    why = f"the fastest of the {len(fitting)} candidates that fit ({time})"
    if len(fitting) == 1:
        why = f"the only candidate that fits ({time})"
    if pure is None:
        return why
    if pure.fits:
        return (
            f"{why}; pure data parallelism fits too but is estimated at {pure.time_s * 1e3:.3g} ms"
        )
    needs = bytes_text(pure.device_bytes) if pure.device_bytes is not None else "-"
    return f"{why}; pure data parallelism needs {needs} per device, over the budget"


def _budget(memory_budget: float | None, device: jax.Device) -> tuple[int, str]:
    if memory_budget is None:
        return default_memory_budget(device)
    if (
        isinstance(memory_budget, bool)
        or not isinstance(memory_budget, numbers.Real)
        or not 0 < memory_budget < math.inf
    ):
        raise ValueError(
            f"memory_budget must be a positive number of bytes per device, got {memory_budget!r}"
        )
    return int(memory_budget), "given"


def search(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    params: Any,
    batch: Any,
    *,
    strategy: DistributedStrategy | None = None,
    memory_budget: float | None = None,
    candidates: Sequence[DistributedStrategy | Mapping[str, Any]] | None = None,
    param_specs: Any = None,
    device: DeviceSpec | None = None,
    devices: Sequence[jax.Device] | None = None,
    has_aux: bool = False,
    has_rng: bool = False,
    isolate: bool = True,
    sequence_parallel: Callable[..., Any] | None = None,
) -> SearchResult:
    """Choose dp / sharding stage / mp / pp degrees, recompute and micro-batching for
    `loss_fn` on `params` and an example global `batch`, by compiling candidate steps (nothing
    runs) and ranking them with the cost model of the module docstring.

    Args:
      loss_fn: as for `make_train_step`; a `PipelineLayer` (with `PipelineParams`) also lets
        the planner try pipeline parallelism.
      optimizer: any optax transformation, or one from `fleet.distributed_optimizer` (whose
        strategy is then the default `strategy`).
      params: the parameters, or their shapes (`jax.ShapeDtypeStruct`s).
      batch: an example global batch (arrays; only shapes are used).
      strategy: what every candidate keeps (AMP, optimizer switches, `recompute_configs`,
        fixed `hybrid_configs` degrees); its planned switches
        (`fleetjax.plan.PLANNED_SWITCHES`) must be off. Default: plain `DistributedStrategy()`.
      memory_budget: bytes per device; default `default_memory_budget()`.
      candidates: strategies or degree dicts (keys of `Layout.KEYS`) to compile instead of
        the search; every one is compiled.
      param_specs: as for `make_train_step`; default from the parameters' logical names.
      device: the cost model's constants; default `device_spec` of the first device (for a
        GPU, its half-precision peak under AMP, else TF32's).
      devices: the devices to lay out (default: all); compile-only GPUs of a target
        (`fleetjax.targets.devices("h100", 1024)`) plan for a cluster that is not there.
      has_aux, has_rng: as for `make_train_step`.
      isolate: compile each candidate in a worker process (on CPU devices and the
        compile-only GPUs of `fleetjax.targets`; elsewhere in this process), so that a
        candidate XLA aborts on (a failed check inside XLA ends the process compiling it) is
        reported "failed" with XLA's message and the search goes on. False compiles in this
        process.
      sequence_parallel: the loss in Megatron's sequence-parallel form (Paddle's
        sequence-parallel layers; the same parameters, e.g. the example GPT built with
        ``sequence_parallel=True``): it trains every layout with mp > 1, as it moves the same
        bytes over mp and keeps 1/mp of the activations outside the tensor-parallel matmuls
        (the report marks those layouts "sequence-parallel"). A degree dict of `candidates`
        may set ``sequence_parallel`` itself.

    Returns:
      The `SearchResult`: the chosen strategy, every candidate and the reason.

    Raises:
      ValueError: for a budget that is not a positive number, `auto` with another parallel
        switch, a malformed degree dict, or when no candidate fits (naming the smallest and
        the budget).
      TypeError: for a strategy that is not a `DistributedStrategy`, a candidate that is
        neither a strategy nor a dict, or a `PipelineLayer` loss without `PipelineParams`.
    """
    if isinstance(optimizer, DistributedOptimizer):
        strategy = strategy if strategy is not None else optimizer.strategy
        optimizer = optimizer.user
    base = copy.deepcopy(strategy) if strategy is not None else DistributedStrategy()
    if not isinstance(base, DistributedStrategy):
        raise TypeError(
            "strategy must be a fleetjax.DistributedStrategy (Paddle's auto is one of its "
            f"fields), got {type(base).__name__}"
        )
    base.auto = True
    base_plan = read_plan(base)  # Paddle's rule: no other parallel switch with auto
    devices = list(devices) if devices is not None else jax.devices()
    budget, source = _budget(memory_budget, devices[0])
    specs = param_specs if param_specs is not None else partition_specs(params)
    if device is None:
        device = targets.device_spec(devices[0], half_precision=base_plan.amp is not None)
    options = {"has_aux": has_aux, "has_rng": has_rng}
    planner = _Planner(
        loss_fn,
        optimizer,
        params,
        batch,
        base,
        budget,
        device,
        param_specs,
        options,
        _rows(batch),
        devices,
        Compiler(isolate),
        sequence_parallel=sequence_parallel,
    )
    if candidates is not None:
        _compile_given(planner, candidates)
    else:
        fixed = {a: getattr(base_plan.degrees, a) for a in base_plan.set_degrees}
        sequences = sequence_layouts(len(devices), planner.rows, fixed)
        layouts = _layouts_to_search(planner, fixed, uses_mp(specs))
        planner.search([_model_form(planner, layout) for layout in layouts], sequences)
    done = tuple(planner.done)
    chosen = planner.best()
    if chosen is None:
        raise ValueError(_nothing_fits(done, budget, devices))
    return SearchResult(
        strategy=copy.deepcopy(chosen.strategy),
        chosen=chosen,
        candidates=done,
        memory_budget=budget,
        budget_source=source,
        device=planner.device,
        reason=_reason(chosen, done, len(devices)),
        loss_fn=loss_fn,
        optimizer=optimizer,
        param_specs=param_specs,
        step_options=planner.step_options,
        devices=tuple(devices),
        sequence_parallel=sequence_parallel,
    )


def _compile_given(
    planner: _Planner, candidates: Sequence[DistributedStrategy | Mapping[str, Any]]
) -> None:
    """Compile exactly `candidates` (strategies or degree dicts), no pruning."""
    if not candidates:
        raise ValueError("candidates is empty; pass None to search, or some candidates")
    for given in candidates:
        if isinstance(given, Mapping):
            layout = Layout.from_dict(given, len(planner.devices))
            if "sequence_parallel" not in given:
                layout = _model_form(planner, layout)
            strategy = layout.strategy(planner.base, planner.rows)
            planner.measure(strategy, layout, always_compile=True)
        elif isinstance(given, DistributedStrategy):
            planner.measure(given, None, always_compile=True)
        else:
            raise TypeError(
                "candidates must be DistributedStrategy objects or degree dicts, got "
                f"{type(given).__name__}"
            )


def _model_form(planner: _Planner, layout: Layout) -> Layout:
    """`layout` in the loss's sequence-parallel form where it has mp > 1 and there is one."""
    if planner.sequence_parallel is None or layout.mp == 1:
        return layout
    return dataclasses.replace(layout, sequence_parallel=True)


def _layouts_to_search(planner: _Planner, fixed: Mapping[str, int], mp_ok: bool) -> list[Layout]:
    """Every layout of the devices with the `fixed` degrees; `pp > 1` for a `PipelineLayer`."""
    layers = None
    if isinstance(planner.loss_fn, PipelineLayer):
        if not isinstance(planner.params, PipelineParams):
            raise TypeError(
                "the loss is a PipelineLayer, so params must be PipelineParams(embed, "
                f"layers, head), got {type(planner.params).__name__}"
            )
        layers = jax.tree.leaves(planner.params.layers)[0].shape[0]
    devices = planner.devices
    per_host = sum(d.process_index == devices[0].process_index for d in devices)
    found = all_layouts(len(devices), planner.rows, fixed, mp_ok, layers, per_host)
    if not found:
        raise ValueError(
            f"no layout of {len(devices)} devices has the fixed degrees {fixed} and "
            f"splits the batch of {planner.rows} rows"
        )
    return found


# Below this many CPU devices, a search that fits nothing says how to simulate this many: the
# count the docs, examples and notebooks simulate.
SIMULATED_DEVICES = 8


def _nothing_fits(
    candidates: Sequence[Candidate], budget: int, devices: Sequence[jax.Device]
) -> str:
    sized = [c for c in candidates if c.device_bytes is not None or c.formula_bytes is not None]
    if not sized:
        return "no candidate could apply:\n" + table(candidates, None)
    smallest = min(
        sized, key=lambda c: c.formula_bytes if c.device_bytes is None else c.device_bytes
    )
    needs = (
        bytes_text(smallest.device_bytes)
        if smallest.device_bytes is not None
        else f"at least {bytes_text(smallest.formula_bytes)} (its state and gradients)"
    )
    more = simulation_hint(devices, SIMULATED_DEVICES)
    if more:
        count = f"{len(devices)} CPU device" + ("s" if len(devices) > 1 else "")
        more = f" The search had {count}, and more devices hold less each. {more}."
    return (
        f"no candidate fits the memory budget of {bytes_text(budget)} ({budget} bytes) per device: "
        f"the smallest, #{smallest.index} {name(smallest)}, needs {needs} per device. Raise "
        f"memory_budget, use more devices, or shrink the model or batch.{more}\n"
        + table(candidates, None)
    )
