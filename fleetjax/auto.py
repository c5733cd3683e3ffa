"""`DistributedStrategy.auto`: a planner that picks the parallel layout for a model, a batch and
a per-device memory budget, by compiling candidate train steps (nothing runs).

    found = fleetjax.auto.search(loss_fn, optax.adam(1e-3), params, batch, memory_budget=2**30)
    print(found)                     # every candidate, its compiled bytes and estimated time
    step = found.make_train_step()   # or make_train_step(loss_fn, opt, found.strategy, ...)

**Candidates.** First the layouts: every factorisation of the device count into
``dp x sharding x mp x pp`` that splits the batch, with ZeRO stages 1, 2 and 3 when
``sharding > 1``; ``mp > 1`` only when some parameter is split over ``mp`` (its
`PartitionSpec`); ``pp > 1`` only when the loss is a `PipelineLayer` whose layers divide into
``pp`` stages, with ``pp`` micro-batches (``accumulate_steps``) and with one row each (less
bubble). Then, fastest first, memory savers on the layouts whose train state fits the budget but
whose step does not, where they are estimated faster than the best plan that fits: recompute
(`recompute_configs`, by default the policy ``nothing_saveable`` on the layers marked with
`fleetjax.recompute`) and in-step gradient merge into 2, 4 or 8 micro-batches.
`hybrid_configs` degrees set on the strategy stay fixed (in Paddle they do not turn ``auto``
off either).

**Measured, per candidate.** Its step is lowered for the abstract train state and the batch and
compiled: per-device bytes are ``arguments + outputs - aliased outputs + temporaries`` from
`memory_analysis()`; XLA's `cost_analysis()` flops and bytes accessed are reported; the
matmul flops and the collectives are read from the compiled HLO with every known-trip-count
loop counted once per trip (XLA's cost analysis counts a loop body once, which would make
micro-batching, pipelines and scanned layers look cheap), and a conditional by its costliest
branch.

**Cost model.** On one device, with the constants of its `DeviceSpec`::

    time = matmul_flops / peak_flops
         + sum over collectives of (latency + wire_bytes / link_bandwidth)

where the wire bytes of a collective over a group of g devices with a result of R bytes are
those of ring algorithms: all-reduce ``2 (g-1)/g R``, all-gather and all-to-all
``(g-1)/g R``, reduce-scatter ``(g-1) R``, collective-permute ``R``. Compute and communication
are not assumed to overlap. A pipeline's bubble is in the compiled program (its loop of
ticks), not in a formula. The plan chosen is the fastest candidate that fits; on a tie, the
simplest (pure data parallelism first: fewer collectives, nothing split).

**Pruning** (so that planning compiles a handful of steps, not all of them); the report says
which rule skipped a candidate:

* a candidate whose train state alone exceeds the budget is not compiled (it cannot fit);
* ZeRO over ``dp x sharding`` devices is skipped where pure data parallelism over the same
  devices (same mp, pp and savers) fits: it computes the same matmuls and communicates at least
  as much. Recompute and more micro-batches only add work, so they are skipped where the same
  layout with fewer of them fits, and their estimate is never below the layout's without them
  (XLA may rewrite a one-row matmul into a reduction, which the matmul count misses);
* memory savers shrink activations, which depend on the rows per device and the mp and pp
  split, not on ZeRO: a saver variant is skipped when its layout is over the budget by more
  than `SAVING_MARGIN` (1.25) times what the same savers saved on a compiled layout with the
  same split (a prediction, not a bound);
* a candidate is skipped if a lower bound of its time is no better than the best plan found:
  pure data parallelism's matmul flops (an even split of the model's), times the pipeline's
  ideal bubble ``(m + pp - 1) / m``, plus one latency and the ring all-reduce of the gradients
  ``2 (n-1)/n x parameter bytes / (mp pp)`` over its ``n = dp x sharding`` replicas (for
  savers: their layout's estimate).

Override any of it: pass ``candidates=`` (strategies or degree dicts) to compile exactly those,
fix degrees in ``strategy.hybrid_configs``, pass ``device=DeviceSpec(...)`` for other
constants, or edit ``found.strategy`` (a normal `DistributedStrategy`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec

from fleetjax import hlo
from fleetjax.distributed_optimizer import DistributedOptimizer
from fleetjax.layers import partition_specs
from fleetjax.mesh import spec_axes
from fleetjax.plan import read_plan
from fleetjax.step import TrainStep, make_train_step
from fleetjax.strategy import DistributedStrategy
from fleetjax.transforms.pipeline import PipelineLayer, PipelineParams

__all__ = [
    "DEVICE_SPECS",
    "SAVING_MARGIN",
    "Candidate",
    "DeviceSpec",
    "HloCost",
    "Layout",
    "default_memory_budget",
    "device_spec",
    "hlo_cost",
    "search",
    "SearchResult",
]

# -- device constants ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """The constants of the cost model for one kind of device.

    Attributes:
      name: what the constants are for.
      peak_flops: matmul flops per second (dense bfloat16 tensor-core peak on accelerators).
      link_bandwidth: bytes per second one device sends in a collective (one direction).
      latency: seconds each collective costs on top of its bytes.
    """

    name: str
    peak_flops: float
    link_bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        for name in ("peak_flops", "link_bandwidth", "latency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"DeviceSpec.{name} must be a positive number, got {value!r}")


# Matched against `device.device_kind` (lower case), first match wins. Published peaks; the
# bandwidths are per device and direction (NVLink, TPU ICI); latencies are typical small-message
# collective times. The simulated CPU devices share the host's cores and memory.
DEVICE_SPECS: tuple[tuple[str, DeviceSpec], ...] = (
    ("cpu", DeviceSpec("XLA:CPU (simulated devices)", 5e10, 1e10, 2e-5)),
    ("h200", DeviceSpec("NVIDIA H200 (NVLink 4)", 989e12, 450e9, 1e-5)),
    ("h100", DeviceSpec("NVIDIA H100 SXM (NVLink 4)", 989e12, 450e9, 1e-5)),
    ("a100", DeviceSpec("NVIDIA A100 SXM (NVLink 3)", 312e12, 300e9, 1e-5)),
    ("tpu v4", DeviceSpec("TPU v4 (ICI)", 275e12, 150e9, 1e-5)),
    ("tpu v5 lite", DeviceSpec("TPU v5e (ICI)", 197e12, 100e9, 1e-5)),
    ("tpu v5", DeviceSpec("TPU v5p (ICI)", 459e12, 300e9, 1e-5)),
)


def device_spec(device: jax.Device | None = None) -> DeviceSpec:
    """The cost-model constants for `device` (default: the first device), from `DEVICE_SPECS`.

    Raises:
      ValueError: for a device kind the table lacks; pass `search(..., device=DeviceSpec(...))`.
    """
    device = device if device is not None else jax.devices()[0]
    kind = device.device_kind.lower()
    for key, spec in DEVICE_SPECS:
        if key in kind:
            return spec
    raise ValueError(
        f"no cost-model constants for device kind {device.device_kind!r} (known: "
        f"{', '.join(key for key, _ in DEVICE_SPECS)}); pass "
        "device=fleetjax.auto.DeviceSpec(name, peak_flops, link_bandwidth, latency)"
    )


def default_memory_budget(device: jax.Device | None = None) -> tuple[int, str]:
    """(bytes, where from): the allocator's limit of `device` (`memory_stats()["bytes_limit"]`),
    or, where the device reports none (CPU), the host's physical memory shared evenly by this
    process's devices."""
    device = device if device is not None else jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"memory_stats()['bytes_limit'] of {device}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = jax.local_device_count()
    return host // local, f"host memory {_size(host)} / {local} local devices"


# -- reading a compiled module ---------------------------------------------------------------


class HloCost(NamedTuple):
    """What one step of a compiled module does on one device, every loop trip counted.

    Attributes:
      matmul_flops: 2 x the multiply-adds of dots and convolutions (and of library matmul calls
        whose backend config gives dot dimensions, as cuBLAS calls on GPUs do).
      collective_bytes: the collectives' result bytes.
      wire_bytes: the bytes each device sends, by ring algorithms (see the module docstring).
      collectives: how many collectives run (each costs a latency).
    """

    matmul_flops: float = 0.0
    collective_bytes: float = 0.0
    wire_bytes: float = 0.0
    collectives: float = 0.0

    def __add__(self, other: tuple) -> HloCost:  # type: ignore[override]
        return HloCost(*(a + b for a, b in zip(self, other, strict=True)))

    def times(self, n: float) -> HloCost:
        return HloCost(*(n * a for a in self))

    def seconds(self, device: DeviceSpec) -> tuple[float, float]:
        """(compute, communication) seconds under the cost model."""
        compute = self.matmul_flops / device.peak_flops
        return compute, self.collectives * device.latency + self.wire_bytes / device.link_bandwidth


def _wire_bytes(c: hlo.Collective, devices: int) -> float:
    """Bytes one device sends for `c` by ring algorithms; a group the text does not state is
    taken to be all `devices` (an upper bound)."""
    group, result = c.group_size or devices, c.result_bytes
    if c.op == "collective-permute":
        return float(result)
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    return {"all-reduce": 2 * share, "reduce-scatter": group - 1.0}.get(c.op, share) * result


def hlo_cost(hlo_text: str, device: DeviceSpec, devices: int) -> HloCost:
    """The `HloCost` of one call of a compiled module (`compiled.as_text()`).

    A while loop with a known trip count (XLA's ``known_trip_count``) counts its body that many
    times (once if unknown); a conditional counts its costliest branch (by `device`'s cost
    model); fusions and calls count their computations once per call. `devices` is the
    group size assumed for a collective whose replica groups the text does not state.
    """

    def measure(line: str, shapes: Mapping[str, tuple[int, ...]]) -> HloCost:
        total = HloCost(matmul_flops=hlo.matmul_flops(line, shapes))
        for c in hlo.collectives(line):
            wire = _wire_bytes(c, devices)
            launches = 1.0 if wire or c.op == "collective-permute" else 0.0
            total += HloCost(0.0, float(c.result_bytes), wire, launches)
        return total

    def costliest(branches: list[HloCost]) -> HloCost:
        return max(branches, key=lambda c: sum(c.seconds(device)))

    return hlo.per_call(hlo_text, measure, HloCost(), costliest)


# -- candidates ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """One point of the search: mesh degrees, ZeRO stage and memory savers.

    Attributes:
      dp, sharding, mp, pp: the mesh degrees (Paddle's `*_degree`).
      stage: the ZeRO stage over `sharding` (0 when sharding is 1).
      recompute: whether the layers marked with `fleetjax.recompute` are recomputed.
      micro_batches: in-step gradient merge's `k_steps`, or with `pp > 1` the pipeline's
        `accumulate_steps`.
    """

    dp: int
    sharding: int = 1
    stage: int = 0
    mp: int = 1
    pp: int = 1
    recompute: bool = False
    micro_batches: int = 1

    KEYS = ("dp", "sharding", "stage", "mp", "pp", "recompute", "micro_batches")

    @property
    def degrees(self) -> dict[str, int]:
        return {"dp": self.dp, "sharding": self.sharding, "pp": self.pp, "mp": self.mp}

    @property
    def replicas(self) -> int:
        """Devices the batch is split over (`dp x sharding`)."""
        return self.dp * self.sharding

    @property
    def base(self) -> Layout:
        """The same layout without memory savers (a pipeline keeps its micro-batches)."""
        micro = self.micro_batches if self.pp > 1 else 1
        return dataclasses.replace(self, recompute=False, micro_batches=micro)

    @property
    def placement(self) -> tuple[int, ...]:
        """What decides where the train state lives (and so its bytes per device)."""
        return self.dp, self.sharding, self.stage, self.mp, self.pp

    def order(self) -> tuple[int, ...]:
        """Simplicity: pure data parallelism first, then ZeRO, tensor, pipeline parallel."""
        zero = (self.sharding > 1, self.stage, self.sharding)
        return (self.pp, self.mp, *zero, self.recompute, self.micro_batches)

    def dominates(self, other: Layout) -> bool:
        """Whether `other` takes at least as long, so that once `self` fits `other` is skipped:
        ZeRO takes as long as pure data parallelism over the same devices or longer, and more
        memory savers as long as fewer or longer."""
        same_devices = (self.pp, self.mp, self.replicas) == (other.pp, other.mp, other.replicas)
        if self == other or not same_devices:
            return False
        zero = self.sharding == 1 or (self.sharding, self.stage) == (other.sharding, other.stage)
        if self.pp > 1:  # a pipeline's micro-batches trade bubble for latency: not ordered
            micro = self.micro_batches == other.micro_batches
        else:
            micro = self.micro_batches <= other.micro_batches
        return zero and micro and self.recompute <= other.recompute

    def strategy(self, base: DistributedStrategy, rows: int) -> DistributedStrategy:
        """`base` (a copy, with `auto` off) set to this layout, for a global batch of `rows`."""
        s = copy.deepcopy(base)
        s.auto = False
        s.hybrid_configs = {
            "dp_degree": self.dp,
            "sharding_degree": self.sharding,
            "mp_degree": self.mp,
            "pp_degree": self.pp,
        }
        if self.sharding > 1:
            s.sharding = True
            s.sharding_configs = {"sharding_degree": self.sharding, "stage": self.stage}
        if self.recompute:
            s.recompute = True
            if not (s.recompute_configs["checkpoints"] or s.recompute_configs["policy"]):
                s.recompute_configs = {"policy": "nothing_saveable"}
        if self.pp > 1:
            s.pipeline = True
            per_replica = rows // self.replicas
            s.pipeline_configs = {
                "accumulate_steps": self.micro_batches,
                "micro_batch_size": per_replica // self.micro_batches,
            }
        elif self.micro_batches > 1:
            s.gradient_merge = True
            s.gradient_merge_configs = {
                "k_steps": self.micro_batches,
                "avg": True,
                "mode": "in_step",
            }
        return s

    @classmethod
    def of(cls, step: TrainStep) -> Layout:
        """The layout a train step runs."""
        shape, p = step.mesh.shape, step.plan
        merge = p.gradient_merge
        micro = p.pipeline.accumulate_steps if p.pipeline else merge.k_steps if merge else 1
        return cls(
            dp=shape["dp"],
            sharding=shape["sharding"],
            stage=p.sharding_stage,
            mp=shape["mp"],
            pp=shape["pp"],
            recompute=p.recompute is not None,
            micro_batches=micro,
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], devices: int) -> Layout:
        """A layout from degree keys (`KEYS`); `dp` defaults to the devices the others leave,
        `stage` to 1 when `sharding > 1`.

        Raises:
          ValueError: naming an unknown key, or degrees that do not multiply to `devices`.
        """
        unknown = sorted(set(values) - set(cls.KEYS))
        if unknown:
            raise ValueError(
                f"candidates: unknown key {unknown[0]!r} in {dict(values)}; keys are "
                f"{', '.join(cls.KEYS)}"
            )
        v = {"sharding": 1, "mp": 1, "pp": 1, **values}
        v.setdefault("stage", 1 if v["sharding"] > 1 else 0)
        others = v["sharding"] * v["mp"] * v["pp"]
        v.setdefault("dp", devices // others if devices % others == 0 else 0)
        if v["dp"] * others != devices:
            raise ValueError(
                f"candidates: {dict(values)} does not multiply to the {devices} devices "
                f"(dp x sharding x mp x pp = {v['dp']} x {v['sharding']} x {v['mp']} x {v['pp']})"
            )
        if (v["stage"] > 0) != (v["sharding"] > 1) or v["stage"] not in (0, 1, 2, 3):
            raise ValueError(
                f"candidates: {dict(values)} has stage={v['stage']}; ZeRO stages 1, 2 and 3 "
                "need sharding > 1, and sharding > 1 needs one of them"
            )
        return cls(**v)

    def __str__(self) -> str:
        parts = [f"dp={self.dp}"]
        if self.sharding > 1:
            parts.append(f"sharding={self.sharding} (stage {self.stage})")
        parts += [f"{a}={getattr(self, a)}" for a in ("mp", "pp") if getattr(self, a) > 1]
        if self.recompute:
            parts.append("recompute")
        if self.micro_batches > 1:
            parts.append(f"{self.micro_batches} micro-batches")
        return " ".join(parts)


FITS, OVER_BUDGET, SKIPPED, CANNOT_APPLY = "fits", "over budget", "skipped", "cannot apply"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan the planner considered, and what its compiled step costs per device.

    Attributes:
      index: its number in the report (1-based).
      layout: its degrees, ZeRO stage and savers (None for a given strategy that could not
        make a step).
      strategy: the strategy that trains it.
      status: "fits", "over budget", "skipped" (not compiled: see `note`) or "cannot apply".
      note: why it was skipped, did not fit or could not apply.
      state_bytes: the train state's bytes on each device (known once lowered).
      device_bytes: compiled: arguments + outputs - aliased outputs + temporaries.
      memory: `compiled.memory_analysis()`.
      xla_flops, xla_bytes_accessed: `compiled.cost_analysis()` (loop bodies counted once).
      cost: the matmul flops and collectives of the compiled HLO, loops unrolled.
      compute_s, communication_s: the cost model's estimate (seconds).
    """

    index: int
    layout: Layout | None
    strategy: DistributedStrategy
    status: str
    note: str = ""
    state_bytes: int | None = None
    device_bytes: int | None = None
    memory: Any = None
    xla_flops: float | None = None
    xla_bytes_accessed: float | None = None
    cost: HloCost | None = None
    compute_s: float | None = None
    communication_s: float | None = None

    @property
    def fits(self) -> bool:
        return self.status == FITS

    @property
    def time_s(self) -> float | None:
        """The estimated step time (compute + communication), if compiled."""
        if self.compute_s is None or self.communication_s is None:
            return None
        return self.compute_s + self.communication_s


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """What `search` chose and everything it considered; `str()` is the report.

    Attributes:
      strategy: the chosen plan's strategy (a `DistributedStrategy` you may edit).
      chosen: the chosen candidate.
      candidates: every candidate considered, in the order they were.
      memory_budget: the per-device budget in bytes, and `budget_source` where it came from.
      device: the cost model's constants.
      reason: why the chosen plan won.
    """

    strategy: DistributedStrategy
    chosen: Candidate
    candidates: tuple[Candidate, ...]
    memory_budget: int
    budget_source: str
    device: DeviceSpec
    reason: str
    # What `make_train_step` needs besides the strategy.
    loss_fn: Callable[..., Any] = dataclasses.field(repr=False)
    optimizer: optax.GradientTransformation = dataclasses.field(repr=False)
    param_specs: Any = dataclasses.field(repr=False)
    step_options: Mapping[str, bool] = dataclasses.field(repr=False)

    @property
    def degrees(self) -> dict[str, int]:
        """The chosen mesh degrees: {"dp", "sharding", "pp", "mp"}."""
        return self.chosen.layout.degrees

    def make_train_step(self) -> TrainStep:
        """`fleetjax.make_train_step` for the planned loss and optimizer under `strategy`."""
        return make_train_step(
            self.loss_fn,
            self.optimizer,
            self.strategy,
            param_specs=self.param_specs,
            **self.step_options,
        )

    def __str__(self) -> str:
        return "\n".join(
            [
                f"auto plan on {jax.device_count()} devices, cost model for {self.device.name} "
                f"(peak {self.device.peak_flops:.3g} flop/s, link "
                f"{self.device.link_bandwidth:.3g} B/s, latency {self.device.latency:.3g} s)",
                f"memory budget {_size(self.memory_budget)} per device ({self.budget_source})",
                _table(self.candidates, self.chosen),
                f"chosen: #{self.chosen.index} {self.chosen.layout}: {self.reason}",
            ]
        )


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _name(c: Candidate) -> str:
    return str(c.layout) if c.layout is not None else repr(c.strategy)


def _table(candidates: Sequence[Candidate], chosen: Candidate | None) -> str:
    header = ("#", "plan", "bytes/device", "matmul flops", "comm bytes", "est. time", "status")
    rows = [header]
    for c in candidates:
        if c.device_bytes is not None:
            size = _size(c.device_bytes)
        elif c.state_bytes is not None:
            size = f">= {_size(c.state_bytes)}"
        else:
            size = "-"
        # The note's first clause (errors go on to say how to fix them: see `Candidate.note`).
        note = re.split(r"[;:]\s|\.\s", c.note, maxsplit=1)[0]
        status = c.status + (f": {note}" if note else "")
        rows.append(
            (
                f"{'*' if c is chosen else ''}{c.index}",
                _name(c),
                size,
                f"{c.cost.matmul_flops:.3g}" if c.cost else "-",
                _size(c.cost.collective_bytes) if c.cost else "-",
                f"{c.time_s * 1e3:.3g} ms" if c.time_s is not None else "-",
                status,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    )


# -- the planner -----------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _layouts(
    devices: int,
    rows: int,
    fixed: Mapping[str, int],
    mp_ok: bool,
    pipeline_layers: int | None,
) -> list[Layout]:
    """Every layout without memory savers that splits `rows`, simplest first. A pipeline
    gets as many micro-batches as stages, and (less bubble) one per row of its replica."""
    found = []
    pps = [1] + [p for p in _divisors(devices)[1:] if pipeline_layers and pipeline_layers % p == 0]
    for pp in pps:
        for mp in _divisors(devices // pp) if mp_ok else [1]:
            for sharding in _divisors(devices // (pp * mp)):
                dp = devices // (pp * mp * sharding)
                degrees = {"dp": dp, "sharding": sharding, "mp": mp, "pp": pp}
                per_replica = rows // (dp * sharding)
                if (
                    any(degrees[a] != d for a, d in fixed.items())
                    or per_replica * dp * sharding != rows
                    or per_replica % pp
                ):
                    continue
                micro = sorted({pp, per_replica}) if pp > 1 else [1]
                for stage in (1, 2, 3) if sharding > 1 else (0,):
                    found += [Layout(dp, sharding, stage, mp, pp, False, m) for m in micro]
    return sorted(found, key=Layout.order)


# Memory savers shrink the activations, which depend on the rows per device and the mp and pp
# split, not on ZeRO: what they saved on one layout predicts what they save on another with the
# same split. A layout over the budget by more than this times that is not tried with them.
SAVING_MARGIN = 1.25


def _split(layout: Layout) -> tuple[int, ...]:
    """What decides a layout's activations: rows per device, mp, pp, and the savers."""
    return layout.replicas, layout.mp, layout.pp, layout.recompute, layout.micro_batches


def _savers(layout: Layout, rows: int) -> list[Layout]:
    """`layout` with recompute and (without a pipeline) in 2, 4 or 8 micro-batches: each
    doubling halves the activations left, so beyond 8 little is left to save."""
    per_replica = rows // layout.replicas
    micro = [layout.micro_batches]
    if layout.pp == 1:
        micro = [k for k in (1, 2, 4, 8) if per_replica % k == 0]
    variants = [
        dataclasses.replace(layout, recompute=r, micro_batches=m)
        for r in (False, True)
        for m in micro
    ]
    return sorted((v for v in variants if v != layout), key=Layout.order)


def _uses_mp(specs: Any) -> bool:
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return any("mp" in spec_axes(s) for s in leaves if isinstance(s, PartitionSpec))


def _state_bytes(state: Any, shardings: Any) -> int:
    """Device bytes one device holds of the abstract `state` placed by `shardings` (a prefix
    tree: one sharding may place a whole subtree, as the loss-scale state's); an offloaded
    optimizer state lives in host memory."""

    def placed(sharding: jax.sharding.Sharding, subtree: Any) -> int:
        if sharding.memory_kind == "pinned_host":
            return 0
        return sum(
            math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(subtree)
        )

    return sum(jax.tree.leaves(jax.tree.map(placed, shardings, state)))


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
    done: list[Candidate] = dataclasses.field(default_factory=list)
    flops: float = 0.0  # pure data parallelism's matmul flops, once compiled

    @functools.cached_property
    def param_bytes(self) -> int:
        shapes = jax.eval_shape(lambda p: p, self.params)
        return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))

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
        its train state alone is over the budget (or `always_compile`). Its estimated compute
        and communication are at least `floor`'s (its layout without memory savers)."""
        try:
            step = make_train_step(
                self.loss_fn,
                self.optimizer,
                strategy,
                param_specs=self.param_specs,
                **self.step_options,
            )
            layout = layout or Layout.of(step)
            state = step.abstract_init(self.params)
            lowered = step.lower(state, self.batch)
        except (ValueError, TypeError, NotImplementedError) as e:
            return self.add(layout, strategy, CANNOT_APPLY, note=str(e))
        state_bytes = _state_bytes(state, step.placement.state)
        if state_bytes > self.budget and not always_compile:
            note = f"its train state alone is {_size(state_bytes)}"
            return self.add(layout, strategy, OVER_BUDGET, note=note, state_bytes=state_bytes)
        compiled = lowered.compile()
        memory = compiled.memory_analysis()
        device_bytes = (
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        )
        xla = compiled.cost_analysis()  # a dict; a list of one dict in older JAX
        xla = xla[0] if isinstance(xla, (list, tuple)) else xla
        cost = hlo_cost(compiled.as_text(), self.device, jax.device_count())
        compute, communication = cost.seconds(self.device)
        if floor is not None and floor.time_s is not None:
            compute = max(compute, floor.compute_s)
            communication = max(communication, floor.communication_s)
        fits = device_bytes <= self.budget
        return self.add(
            layout,
            strategy,
            FITS if fits else OVER_BUDGET,
            note="" if fits else f"over by {_size(device_bytes - self.budget)}",
            state_bytes=state_bytes,
            device_bytes=device_bytes,
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

    def search(self, layouts: list[Layout]) -> None:
        """Consider `layouts` in order; then memory savers on top of those whose train state
        fits but whose step does not, fastest first; pruning as the module docstring says."""
        # Pure data parallelism is always compiled: its matmul flops bound every layout's.
        baseline, self.flops = Layout(jax.device_count()), 0.0
        for layout in layouts:
            c = self.consider(layout, always_compile=layout == baseline)
            if layout == baseline and c.cost is not None:
                self.flops = c.cost.matmul_flops
        # Savers only add work: a layout estimated no faster than the best plan needs none.
        short = [
            c
            for c in self.done
            if c.status == OVER_BUDGET and c.time_s is not None and c.state_bytes <= self.budget
        ]
        for base in sorted(short, key=lambda c: (c.time_s, c.layout.order())):
            best = self.best()
            if best is None or base.time_s < best.time_s:
                for layout in _savers(base.layout, self.rows):
                    self.consider(layout, floor=base)

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
            if c.state_bytes is not None and c.state_bytes > self.budget:
                return f"its train state is #{c.index}'s, {_size(c.state_bytes)}"
            if c.layout == layout.base and c.time_s is not None:
                bound = max(bound, c.time_s)  # savers only add work to their layout
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
                and _split(c.layout) == _split(layout)
            ),
            None,
        )
        if layout == layout.base or base is None or seen is None:
            return ""
        saved = compiled[seen.layout.base].device_bytes - seen.device_bytes
        over = base.device_bytes - self.budget
        if over <= SAVING_MARGIN * saved:
            return ""
        return f"the same savers saved {_size(saved)} on #{seen.index}; this is {_size(over)} over"

    def lower_bound(self, layout: Layout) -> float:
        """A time no step with `layout` can beat (see the module docstring)."""
        compute = self.flops / self.device.peak_flops
        if layout.pp > 1:
            compute *= (layout.micro_batches + layout.pp - 1) / layout.micro_batches
        n = layout.replicas
        if n == 1:
            return compute
        grads = 2 * (n - 1) / n * self.param_bytes / (layout.mp * layout.pp)
        return compute + self.device.latency + grads / self.device.link_bandwidth


def _reason(chosen: Candidate, candidates: Sequence[Candidate]) -> str:
    fitting = [c for c in candidates if c.fits]
    pure = next((c for c in candidates if c.layout == Layout(jax.device_count())), None)
    time = f"{chosen.time_s * 1e3:.3g} ms"
    if chosen is pure:
        return (
            f"pure data parallelism fits ({_size(chosen.device_bytes)} per device) and no "
            f"other plan is estimated faster ({time})"
        )
    why = f"the fastest of the {len(fitting)} plans that fit ({time})"
    if len(fitting) == 1:
        why = f"the only plan that fits ({time})"
    if pure is None:
        return why
    if pure.fits:
        return (
            f"{why}; pure data parallelism fits too but is estimated at {pure.time_s * 1e3:.3g} ms"
        )
    needs = _size(pure.device_bytes) if pure.device_bytes is not None else "-"
    return f"{why}; pure data parallelism needs {needs} per device, over the budget"


def _budget(memory_budget: float | None) -> tuple[int, str]:
    if memory_budget is None:
        return default_memory_budget()
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
    has_aux: bool = False,
    has_rng: bool = False,
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
      device: the cost model's constants; default `device_spec()`.
      has_aux, has_rng: as for `make_train_step`.

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
    budget, source = _budget(memory_budget)
    specs = param_specs if param_specs is not None else partition_specs(params)
    planner = _Planner(
        loss_fn,
        optimizer,
        params,
        batch,
        base,
        budget,
        device if device is not None else device_spec(),
        param_specs,
        {"has_aux": has_aux, "has_rng": has_rng},
        _rows(batch),
    )
    if candidates is not None:
        if not candidates:
            raise ValueError("candidates is empty; pass None to search, or some candidates")
        for given in candidates:
            if isinstance(given, Mapping):
                layout = Layout.from_dict(given, jax.device_count())
                planner.measure(layout.strategy(base, planner.rows), layout, always_compile=True)
            elif isinstance(given, DistributedStrategy):
                planner.measure(given, None, always_compile=True)
            else:
                raise TypeError(
                    "candidates must be DistributedStrategy objects or degree dicts, got "
                    f"{type(given).__name__}"
                )
    else:
        layers = None
        if isinstance(loss_fn, PipelineLayer):
            if not isinstance(params, PipelineParams):
                raise TypeError(
                    "the loss is a PipelineLayer, so params must be PipelineParams(embed, "
                    f"layers, head), got {type(params).__name__}"
                )
            layers = jax.tree.leaves(params.layers)[0].shape[0]
        fixed = {a: getattr(base_plan.degrees, a) for a in base_plan.set_degrees}
        layouts = _layouts(jax.device_count(), planner.rows, fixed, _uses_mp(specs), layers)
        if not layouts:
            raise ValueError(
                f"no layout of {jax.device_count()} devices has the fixed degrees {fixed} and "
                f"splits the batch of {planner.rows} rows"
            )
        planner.search(layouts)
    done = tuple(planner.done)
    chosen = planner.best()
    if chosen is None:
        raise ValueError(_nothing_fits(done, budget))
    return SearchResult(
        strategy=copy.deepcopy(chosen.strategy),
        chosen=chosen,
        candidates=done,
        memory_budget=budget,
        budget_source=source,
        device=planner.device,
        reason=_reason(chosen, done),
        loss_fn=loss_fn,
        optimizer=optimizer,
        param_specs=param_specs,
        step_options=planner.step_options,
    )


def _nothing_fits(candidates: Sequence[Candidate], budget: int) -> str:
    sized = [c for c in candidates if c.device_bytes is not None or c.state_bytes is not None]
    if not sized:
        return "no candidate could apply:\n" + _table(candidates, None)
    smallest = min(sized, key=lambda c: c.state_bytes if c.device_bytes is None else c.device_bytes)
    needs = (
        _size(smallest.device_bytes)
        if smallest.device_bytes is not None
        else f"at least {_size(smallest.state_bytes)} (its train state)"
    )
    return (
        f"no candidate fits the memory budget of {_size(budget)} ({budget} bytes) per device: "
        f"the smallest, #{smallest.index} {_name(smallest)}, needs {needs} per device. Raise "
        "memory_budget, use more devices, or shrink the model or batch.\n"
        + _table(candidates, None)
    )
