"""What the search found: each candidate with its compiled cost, and the report."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax

from fleetjax.auto._layouts import Layout
from fleetjax.cost import DeviceSpec, HloCost, bytes_text
from fleetjax.plan import mesh_for, read_plan
from fleetjax.step import TrainStep, make_train_step
from fleetjax.strategy import DistributedStrategy

FITS, OVER_BUDGET, SKIPPED, CANNOT_APPLY = "fits", "over budget", "skipped", "cannot apply"
FAILED = "failed"  # XLA refused or aborted compiling it


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One plan the planner considered, and what its compiled step costs per device.

    Attributes:
      index: its number in the report (1-based).
      layout: its degrees, ZeRO stage and savers (None for a given strategy that could not
        make a step).
      strategy: the strategy that trains it.
      status: "fits", "over budget", "skipped" (not compiled: see `note`), "cannot apply" (no
        step: the strategy refuses it) or "failed" (XLA refused or aborted compiling it).
      note: why it was skipped, did not fit, could not apply or failed (XLA's message).
      state_bytes: the train state's bytes on each device (from its placement).
      formula_bytes: what the device must hold at once by formula: its train state and
        gradients (see `fleetjax.auto._memory`).
      device_bytes: compiled: arguments + outputs - aliased outputs + temporaries.
      memory: the sizes `compiled.memory_analysis()` gives (same attribute names).
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
    formula_bytes: int | None = None
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
      strategy: the chosen candidate's strategy (a `DistributedStrategy` you may edit).
      chosen: the chosen candidate.
      candidates: every candidate considered, in the order they were.
      memory_budget: the per-device budget in bytes, and `budget_source` where it came from.
      device: the cost model's constants.
      reason: why the chosen candidate won.
      devices: the devices laid out.
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
    devices: tuple[jax.Device, ...] = dataclasses.field(repr=False, default=())
    sequence_parallel: Callable[..., Any] | None = dataclasses.field(repr=False, default=None)

    @property
    def degrees(self) -> dict[str, int]:
        """The chosen mesh degrees: {"dp", "sharding", "pp", "mp"}, and "cp" where it splits the
        sequence."""
        return self.chosen.layout.degrees

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The chosen layout's mesh over the devices laid out."""
        return mesh_for(read_plan(self.strategy), self.devices or None)

    def make_train_step(self) -> TrainStep:
        """`fleetjax.make_train_step` for the searched loss (in its sequence-parallel form,
        cut into the chosen virtual pipeline stages, as the layout says) and optimizer under
        `strategy`, on `mesh`."""
        layout = self.chosen.layout
        return make_train_step(
            layout.loss(self.loss_fn, self.sequence_parallel)
            if layout is not None
            else self.loss_fn,
            self.optimizer,
            self.strategy,
            self.mesh,
            param_specs=self.param_specs,
            **self.step_options,
        )

    def __str__(self) -> str:
        return "\n".join(
            [
                f"auto search on {len(self.devices)} devices, cost model for "
                f"{self.device.name} ({_constants(self.device)})",
                f"memory budget {bytes_text(self.memory_budget)} per device ({self.budget_source})",
                table(self.candidates, self.chosen),
                f"chosen: #{self.chosen.index} {self.chosen.layout}: {self.reason}",
            ]
        )


def _constants(device: DeviceSpec) -> str:
    parts = [
        f"peak {device.peak_flops:.3g} flop/s",
        f"link {device.link_bandwidth:.3g} B/s",
        f"latency {device.latency:.3g} s",
    ]
    for label, value in (
        ("network", device.network_bandwidth),
        ("HBM", device.hbm_bandwidth),
        ("host", device.host_bandwidth),
    ):
        if value is not None:
            parts.append(f"{label} {value:.3g} B/s")
    return ", ".join(parts)


def name(c: Candidate) -> str:
    return str(c.layout) if c.layout is not None else repr(c.strategy)


def table(candidates: Sequence[Candidate], chosen: Candidate | None) -> str:
    header = ("#", "layout", "bytes/device", "matmul flops", "comm bytes", "est. time", "status")
    rows = [header]
    for c in candidates:
        if c.device_bytes is not None:
            size = bytes_text(c.device_bytes)
        elif c.formula_bytes is not None:
            size = f">= {bytes_text(c.formula_bytes)}"
        else:
            size = "-"
        # The note's first clause (errors go on to say how to fix them: see `Candidate.note`).
        note = re.split(r"[;:]\s|\.\s", c.note, maxsplit=1)[0]
        status = c.status + (f": {note}" if note else "")
        rows.append(
            (
                f"{'*' if c is chosen else ''}{c.index}",
                name(c),
                size,
                f"{c.cost.matmul_flops:.3g}" if c.cost else "-",
                bytes_text(c.cost.collective_bytes) if c.cost else "-",
                f"{c.time_s * 1e3:.3g} ms" if c.time_s is not None else "-",
                status,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in rows
    )
