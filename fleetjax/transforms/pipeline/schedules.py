"""Pipeline schedules as tables: which micro-batch each stage runs forward and backward per tick.

`pipeline_schedule` makes the table of a schedule (Paddle's `pipeline_configs["schedule_mode"]`,
any spelling in `SCHEDULE_MODES`), which `pipeline` runs; `print` shows it tick by tick and
`PipelineSchedule.plot` draws it.

The pipeline runs in lockstep ticks (one SPMD program on every stage). In a tick each stage
runs at most one forward and then at most one backward of one model chunk (and, under the
zero-bubble schedules, at most one weight gradient), after which activations move one stage
down and cotangents one stage up. A table is made by running, tick by tick, each stage's
forwards and backwards in Paddle's order as soon as their inputs have arrived, within a limit on
the micro-batches a stage may hold in flight (`fleetjax.transforms.pipeline._simulation`):

* ``FThenB`` (GPipe, Paddle's ``F-then-B``): every forward, then every backward.
* ``1F1B``: stage ``s`` runs ``2 (P - 1 - s)`` forwards ahead, then a forward and a backward per
  tick, then the remaining backwards; at most ``2 (P - s) - 1`` micro-batches are in flight
  (Paddle's MPMD 1F1B holds ``P - s``: a hop between stages costs a whole tick here). That is
  Paddle's ``Eager1F1B`` warm-up of ``2 (P - s) - 1`` forwards: ``Eager1F1B`` runs the same
  table, with Paddle's condition ``m >= 2 P - 1``.
* ``ZBH1`` (zero bubble, Qi et al. 2023, Paddle's job order): 1F1B with each backward split
  into its input-gradient half B, on the critical path back through the stages, and its
  weight-gradient half W; stage ``s`` runs the Ws of its first ``s`` backwards after its last
  B, in ticks it would otherwise idle, and every other W in its B's tick. Needs ``m >= P``.
* ``ZBVPP``: VPP's table with the backward split the same way.
* ``VPP`` (interleaved 1F1B, Paddle's ``PipelineParallelWithInterleave``): each stage owns
  ``virtual_stages`` model chunks, round-robin; micro-batches go through the chunks in rounds
  of ``P`` (the first round takes ``P + m % P``), with Paddle's warm-up of
  ``2 (P - 1 - s) + (V - 1)(P + m % P)`` forwards. With ``P <= m < 2P`` it is Paddle's
  ``PipelineParallelWithInterleaveFthenB``: all forwards, then all backwards.

A tick lasts as long as its busiest stage (each stage runs its own branch; only the sends
between ticks wait for the neighbours). FThenB and 1F1B leave stages idle ``(P - 1) / (m + P -
1)`` of the time, VPP ``(P - 1) / (V m + P - 1)``. With F, B and W of equal cost, ZBH1's bubble
is ``2 (P - 1)`` units of ``3 m + 2 (P - 1)`` where 1F1B's is ``3 (P - 1)`` of ``3 m + 3 (P -
1)``: the paper's asynchronous ZB-H1 reaches ``P - 1``, but in lockstep a hop costs a tick, so
the forwards' warm-up cannot be filled.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any

import numpy as np

from fleetjax.transforms.pipeline import _simulation

__all__ = ["SCHEDULE_MODES", "PipelineSchedule", "canonical_mode", "pipeline_schedule"]

SCHEDULE_MODES: Mapping[str, str] = types.MappingProxyType(
    {
        "FThenB": "FThenB",
        "F-then-B": "FThenB",
        "1F1B": "1F1B",
        "Eager1F1B": "Eager1F1B",
        "VPP": "VPP",
        "ZBH1": "ZBH1",
        "ZBVPP": "ZBVPP",
    }
)
"""Paddle's spellings of the schedules built here (static fleet, dygraph and auto-parallel
`schedule_mode`) -> the schedule's name in `PipelineSchedule.mode`."""


def canonical_mode(schedule_mode: str) -> str:
    """The schedule that `schedule_mode` (any of Paddle's spellings) names.

    Raises:
      ValueError: if it names no schedule built here.
    """
    if schedule_mode not in SCHEDULE_MODES:
        raise ValueError(
            f"schedule_mode must be one of {', '.join(map(repr, SCHEDULE_MODES))}, "
            f"got {schedule_mode!r}"
        )
    return SCHEDULE_MODES[schedule_mode]


def _check_count(name: str, value: Any) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_schedule(mode: str, stages: int, micro_batches: int, virtual_stages: int) -> str:
    """The canonical schedule name, after checking Paddle's constraints on the counts.

    Raises:
      ValueError: naming the argument, its value and what is allowed.
    """
    mode = canonical_mode(mode)
    _check_count("stages (pp_degree)", stages)
    _check_count("micro_batches (accumulate_steps)", micro_batches)
    _check_count("virtual_stages (vpp_degree)", virtual_stages)
    interleaved = mode in ("VPP", "ZBVPP")
    if interleaved and virtual_stages < 2:
        raise ValueError(
            f"schedule_mode {mode!r} needs vpp_degree >= 2 virtual stages per device, "
            f"got {virtual_stages}"
        )
    if not interleaved and virtual_stages > 1:
        raise ValueError(
            f"vpp_degree={virtual_stages} needs schedule_mode 'VPP' (interleaved 1F1B), "
            f"got {mode!r}"
        )
    if mode == "VPP" and micro_batches < stages:
        raise ValueError(
            f"The accumulate_steps({micro_batches}) should be greater than or equal to "
            f"pp_degree({stages}) for the interleaved (VPP) schedule"
        )
    least = {"Eager1F1B": 2 * stages - 1, "ZBH1": stages, "ZBVPP": stages}.get(mode, 1)
    if micro_batches < least:
        raise ValueError(
            f"schedule_mode {mode!r} needs accumulate_steps >= {least} for pp_degree={stages} "
            f"(Paddle's condition), got {micro_batches}"
        )
    return mode


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSchedule:
    """A pipeline schedule table (see `pipeline_schedule`).

    Attributes:
      mode: "FThenB", "1F1B", "Eager1F1B", "VPP", "ZBH1" or "ZBVPP".
      stages, micro_batches, virtual_stages: P, m and V (model chunks per stage).
      forward: int array [ticks, stages]: the micro-batch whose forward each stage runs in each
        tick, -1 where it runs none.
      forward_chunk: int array [ticks, stages]: the stage's model chunk that forward runs
        (virtual stage ``chunk * stages + stage``); 0 where idle.
      backward, backward_chunk: the same for backwards (under a split backward, B: the input
        gradient).
      weight, weight_chunk: the same for the weight gradients W of a split backward; without
        one, the backward's own (a W is part of its B).
    """

    mode: str
    stages: int
    micro_batches: int
    virtual_stages: int
    forward: np.ndarray
    forward_chunk: np.ndarray
    backward: np.ndarray
    backward_chunk: np.ndarray
    weight: np.ndarray
    weight_chunk: np.ndarray

    @property
    def ticks(self) -> int:
        """The number of lockstep ticks."""
        return self.forward.shape[0]

    @property
    def split_backward(self) -> bool:
        """Whether each backward is split into its input-gradient half B and its
        weight-gradient half W (the zero-bubble schedules)."""
        return self.mode in _simulation.SPLIT

    @property
    def in_flight_bound(self) -> int | None:
        """The most micro-batch chunks the schedule's rule lets one stage hold in flight
        (2P - 1 for 1F1B and ZBH1), whatever m is; None for FThenB, which holds them all."""
        rule = _simulation.orders(self.mode, self.stages, self.micro_batches, self.virtual_stages)
        bound = max(rule.limits)
        return None if math.isinf(bound) else int(bound)

    @property
    def in_flight(self) -> np.ndarray:
        """Per stage, the most chunk forwards whose weight gradient has not run yet (whose
        residuals are held)."""
        started = np.cumsum(self.forward >= 0, axis=0)
        finished_before = np.cumsum(self.weight >= 0, axis=0) - (self.weight >= 0)
        return (started - finished_before).max(axis=0)

    @property
    def weights_held(self) -> np.ndarray:
        """Per stage, the most backwards whose weight gradient is held back (0 unless split)."""
        done = np.cumsum(self.backward >= 0, axis=0) - np.cumsum(self.weight >= 0, axis=0)
        return done.max(axis=0)

    def _work(self, costs: tuple[float, float, float | None]) -> np.ndarray:
        """[ticks, stages]: each stage's work in each tick (see `_kind_cost`)."""
        return sum((micro >= 0) * self._kind_cost(kind, costs) for kind, micro, _ in self._kinds())

    def idle_fraction(
        self,
        forward_cost: float = 1.0,
        backward_cost: float = 2.0,
        weight_cost: float | None = None,
    ) -> float:
        """The fraction of stage time spent idle (the bubble).

        A tick lasts as long as its busiest stage's work (see `_work`; each stage runs its own
        branches, and only the sends between ticks wait for the neighbours). `weight_cost` is
        the part of `backward_cost` that a split backward's W costs (default: half).
        """
        work = self._work((forward_cost, backward_cost, weight_cost))
        busy = self.micro_batches * (forward_cost + backward_cost)
        return float(1.0 - busy / work.max(axis=1).sum())

    def __str__(self) -> str:
        """The table as text: a row per stage, a column per tick, and in each cell the forward
        (``F``), the backward (``B``) and, split, the weight gradient (``W``) that the stage
        runs in the tick, by micro-batch (and, with virtual stages, ``.chunk``); ``.`` where it
        runs none."""
        cells = [[self._cell(t, s) for t in range(self.ticks)] for s in range(self.stages)]
        width = max(len(cell) for row in cells for cell in row)
        labels = ["tick", *(f"stage {s}" for s in range(self.stages))]
        margin = max(map(len, labels))
        rows = [[str(t) for t in range(self.ticks)], *cells]
        table = [
            label.ljust(margin) + "".join(f"  {cell:<{width}}" for cell in row).rstrip()
            for label, row in zip(labels, rows, strict=True)
        ]
        kinds = "forward / backward" + " (input gradient) / weight gradient" * self.split_backward
        letters = "Fi / Bi" + " / Wi" * self.split_backward
        legend = f"{letters}: {kinds} of micro-batch i"
        if self.virtual_stages > 1:
            legend = (
                f"{letters.replace('i', 'i.v')}: {kinds} of micro-batch i through model chunk v"
            )
        return "\n".join([self._title(), *table, legend])

    def _kinds(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        kinds = [("F", self.forward, self.forward_chunk), ("B", self.backward, self.backward_chunk)]
        return kinds + [("W", self.weight, self.weight_chunk)] * self.split_backward

    def _cell(self, tick: int, stage: int) -> str:
        """What `stage` runs in `tick`, as `__str__` writes it."""
        ops = []
        for kind, micro, chunk in self._kinds():
            if micro[tick, stage] >= 0:
                suffix = f".{chunk[tick, stage]}" if self.virtual_stages > 1 else ""
                ops.append(f"{kind}{micro[tick, stage]}{suffix}")
        return " ".join(ops) or "."

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython and Jupyter show the table as `print` does."""
        printer.text(str(self))

    def _title(self, *costs: float) -> str:
        idle = self.idle_fraction(*costs)
        chunks = f", V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"{self.mode}: P={self.stages}, m={self.micro_batches}{chunks}, idle {idle:.1%}"

    def plot(self, ax: Any = None, forward_cost: float = 1.0, backward_cost: float = 2.0) -> Any:
        """Draw the schedule as a Gantt chart on `ax` (default a new figure); returns the axes.

        Stages are rows, time runs right; forwards are blue, backwards orange and weight
        gradients green (darker for later chunks), each labelled with its micro-batch. Needs
        matplotlib.
        """
        import matplotlib.pyplot as plt  # only this helper needs matplotlib

        if ax is None:
            _, ax = plt.subplots(figsize=(min(24, 2 + 0.5 * self.ticks), 1 + 0.5 * self.stages))
        costs = (forward_cost, backward_cost, None)
        starts = np.concatenate([[0.0], np.cumsum(self._work(costs).max(axis=1))[:-1]])
        shades = np.linspace(1.0, 0.55, self.virtual_stages)  # later chunks darker
        colors = {"F": (0.25, 0.5, 0.85), "B": (0.95, 0.6, 0.2), "W": (0.3, 0.7, 0.35)}
        begin = np.zeros((self.ticks, self.stages)) + starts[:, None]
        for kind, micro, chunk in self._kinds():
            cost = self._kind_cost(kind, costs)
            for t, s in zip(*np.nonzero(micro >= 0), strict=True):
                shade = shades[chunk[t, s]]
                ax.broken_barh(
                    [(begin[t, s], cost)],
                    (s - 0.4, 0.8),
                    facecolors=[tuple(c * shade for c in colors[kind])],
                    edgecolor="white",
                )
                ax.text(begin[t, s] + cost / 2, s, str(micro[t, s]), ha="center", va="center")
            begin += (micro >= 0) * cost
        ax.set_yticks(range(self.stages), [f"stage {s}" for s in range(self.stages)])
        ax.invert_yaxis()
        ax.set_xlabel(f"time (forward of one stage = {forward_cost:g})")
        ax.set_title(self._title(forward_cost, backward_cost))
        return ax

    def _kind_cost(self, kind: str, costs: tuple[float, float, float | None]) -> float:
        """One chunk's cost of an F, B or W: a chunk's forward costs `forward_cost` / V, its
        backward `backward_cost` / V; split, B is the backward less W, and W costs
        `weight_cost` (by default half the backward). Unsplit, W is part of B and costs 0."""
        forward_cost, backward_cost, weight_cost = costs
        w = 0.0
        if self.split_backward:
            w = backward_cost / 2 if weight_cost is None else weight_cost
        cost = {"F": forward_cost, "B": backward_cost - w, "W": w}[kind]
        return cost / self.virtual_stages


def pipeline_schedule(
    schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1
) -> PipelineSchedule:
    """The table of `schedule` for `stages` pipeline stages and `micro_batches` micro-batches.

    Args:
      schedule: "FThenB" (or Paddle's "F-then-B"), "1F1B", "Eager1F1B", "VPP", "ZBH1" or
        "ZBVPP" (`schedule_mode`).
      stages: the pipeline degree P (`pp_degree`).
      micro_batches: m (`accumulate_steps`).
      virtual_stages: V, model chunks per stage (`vpp_degree`); VPP and ZBVPP need V >= 2 and
        m >= P; Eager1F1B needs m >= 2P - 1, ZBH1 m >= P.

    Raises:
      ValueError: for an unknown schedule or counts Paddle does not allow.
    """
    mode = _check_schedule(schedule, stages, micro_batches, virtual_stages)
    orders = _simulation.orders(mode, stages, micro_batches, virtual_stages)
    rows, weights = _simulation.weight_ticks(
        _simulation.simulate(orders, stages, virtual_stages), mode
    )

    def table(ops: list[list[Any]], field: int, idle: int) -> np.ndarray:
        return np.array(
            [[idle if op is None else op[field] for op in row] for row in ops], np.int32
        )

    forwards, backwards = [row[0] for row in rows], [row[1] for row in rows]
    return PipelineSchedule(
        mode,
        stages,
        micro_batches,
        virtual_stages,
        forward=table(forwards, 1, -1),
        forward_chunk=table(forwards, 0, 0),
        backward=table(backwards, 1, -1),
        backward_chunk=table(backwards, 0, 0),
        weight=table(weights, 1, -1),
        weight_chunk=table(weights, 0, 0),
    )
