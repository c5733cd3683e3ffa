"""Pipeline schedules as tables: which micro-batch each stage runs forward and backward per tick.

`pipeline_schedule` makes the table of a schedule (Paddle's `pipeline_configs["schedule_mode"]`,
any spelling in `SCHEDULE_MODES`), which `pipeline` runs; `print` shows it tick by tick and
`PipelineSchedule.plot` draws it.

The pipeline runs in lockstep ticks (one SPMD program on every stage). In a tick each stage
runs at most one forward and then at most one backward of one model chunk, after which
activations move one stage down and cotangents one stage up. A table is made by running, tick
by tick, each stage's forwards and backwards in Paddle's order as soon as their inputs have
arrived, within a limit on the micro-batches a stage may hold in flight:

* ``FThenB`` (GPipe, Paddle's ``F-then-B``): every forward, then every backward.
* ``1F1B``: stage ``s`` runs ``2 (P - 1 - s)`` forwards ahead, then a forward and a backward per
  tick, then the remaining backwards; at most ``2 (P - s) - 1`` micro-batches are in flight
  (Paddle's MPMD 1F1B holds ``P - s``: a hop between stages costs a whole tick here).
* ``VPP`` (interleaved 1F1B, Paddle's ``PipelineParallelWithInterleave``): each stage owns
  ``virtual_stages`` model chunks, round-robin; micro-batches go through the chunks in rounds
  of ``P`` (the first round takes ``P + m % P``), with Paddle's warm-up of
  ``2 (P - 1 - s) + (V - 1)(P + m % P)`` forwards. With ``P <= m < 2P`` it is Paddle's
  ``PipelineParallelWithInterleaveFthenB``: all forwards, then all backwards.

FThenB and 1F1B leave stages idle ``(P - 1) / (m + P - 1)`` of the time, VPP
``(P - 1) / (V m + P - 1)``.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = ["SCHEDULE_MODES", "PipelineSchedule", "canonical_mode", "pipeline_schedule"]

SCHEDULE_MODES: Mapping[str, str] = types.MappingProxyType(
    {"FThenB": "FThenB", "F-then-B": "FThenB", "1F1B": "1F1B", "VPP": "VPP"}
)
"""Paddle's spellings of the schedules built here (static fleet, dygraph and auto-parallel
`schedule_mode`) -> the schedule's name in `PipelineSchedule.mode`."""

_Op = tuple[int, int]  # (chunk, micro-batch)


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
    if mode == "VPP" and virtual_stages < 2:
        raise ValueError(
            f"schedule_mode 'VPP' needs vpp_degree >= 2 virtual stages per device, "
            f"got {virtual_stages}"
        )
    if mode != "VPP" and virtual_stages > 1:
        raise ValueError(
            f"vpp_degree={virtual_stages} needs schedule_mode 'VPP' (interleaved 1F1B), "
            f"got {mode!r}"
        )
    if mode == "VPP" and micro_batches < stages:
        raise ValueError(
            f"The accumulate_steps({micro_batches}) should be greater than or equal to "
            f"pp_degree({stages}) for the interleaved (VPP) schedule"
        )
    return mode


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSchedule:
    """A pipeline schedule table (see `pipeline_schedule`).

    Attributes:
      mode: "FThenB", "1F1B" or "VPP".
      stages, micro_batches, virtual_stages: P, m and V (model chunks per stage).
      forward: int array [ticks, stages]: the micro-batch whose forward each stage runs in each
        tick, -1 where it runs none.
      forward_chunk: int array [ticks, stages]: the stage's model chunk that forward runs
        (virtual stage ``chunk * stages + stage``); 0 where idle.
      backward, backward_chunk: the same for backwards.
    """

    mode: str
    stages: int
    micro_batches: int
    virtual_stages: int
    forward: np.ndarray
    forward_chunk: np.ndarray
    backward: np.ndarray
    backward_chunk: np.ndarray

    @property
    def ticks(self) -> int:
        """The number of lockstep ticks."""
        return self.forward.shape[0]

    @property
    def in_flight_bound(self) -> int | None:
        """The most micro-batch chunks the schedule's rule lets one stage hold in flight
        (2P - 1 for 1F1B), whatever m is; None for FThenB, which holds them all."""
        rule = _orders(self.mode, self.stages, self.micro_batches, self.virtual_stages)
        bound = max(rule.limits)
        return None if math.isinf(bound) else int(bound)

    @property
    def in_flight(self) -> np.ndarray:
        """Per stage, the most chunk forwards whose backward has not run yet (residuals held)."""
        started = np.cumsum(self.forward >= 0, axis=0)
        finished_before = np.cumsum(self.backward >= 0, axis=0) - (self.backward >= 0)
        return (started - finished_before).max(axis=0)

    def _phases(self, forward_cost: float, backward_cost: float) -> tuple[np.ndarray, np.ndarray]:
        """Per tick, the length of its forward phase and of its backward phase."""
        chunk_f = forward_cost / self.virtual_stages
        chunk_b = backward_cost / self.virtual_stages
        return (self.forward >= 0).any(axis=1) * chunk_f, (self.backward >= 0).any(axis=1) * chunk_b

    def idle_fraction(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
        """The fraction of stage time spent idle (the bubble).

        A tick lasts as long as its forward phase (if any stage runs a forward) plus its
        backward phase; a forward of a whole stage costs `forward_cost`, a backward
        `backward_cost` (each chunk of a VPP stage 1/V of that).
        """
        f, b = self._phases(forward_cost, backward_cost)
        busy = self.micro_batches * (forward_cost + backward_cost)
        return float(1.0 - busy / (f + b).sum())

    def __str__(self) -> str:
        """The table as text: a row per stage, a column per tick, and in each cell the forward
        (``F``) and then the backward (``B``) that the stage runs in the tick, by micro-batch
        (and, with virtual stages, ``.chunk``); ``.`` where it runs neither."""
        cells = [[self._cell(t, s) for t in range(self.ticks)] for s in range(self.stages)]
        width = max(len(cell) for row in cells for cell in row)
        labels = ["tick", *(f"stage {s}" for s in range(self.stages))]
        margin = max(map(len, labels))
        rows = [[str(t) for t in range(self.ticks)], *cells]
        table = [
            label.ljust(margin) + "".join(f"  {cell:<{width}}" for cell in row).rstrip()
            for label, row in zip(labels, rows, strict=True)
        ]
        legend = "Fi / Bi: forward / backward of micro-batch i"
        if self.virtual_stages > 1:
            legend = "Fi.v / Bi.v: forward / backward of micro-batch i through model chunk v"
        return "\n".join([self._title(), *table, legend])

    def _cell(self, tick: int, stage: int) -> str:
        """What `stage` runs in `tick`, as `__str__` writes it."""
        ops = []
        for kind, micro, chunk in (
            ("F", self.forward, self.forward_chunk),
            ("B", self.backward, self.backward_chunk),
        ):
            if micro[tick, stage] >= 0:
                suffix = f".{chunk[tick, stage]}" if self.virtual_stages > 1 else ""
                ops.append(f"{kind}{micro[tick, stage]}{suffix}")
        return " ".join(ops) or "."

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """IPython and Jupyter show the table as `print` does."""
        printer.text(str(self))

    def _title(self, forward_cost: float = 1.0, backward_cost: float = 2.0) -> str:
        idle = self.idle_fraction(forward_cost, backward_cost)
        chunks = f", V={self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"{self.mode}: P={self.stages}, m={self.micro_batches}{chunks}, idle {idle:.1%}"

    def plot(self, ax: Any = None, forward_cost: float = 1.0, backward_cost: float = 2.0) -> Any:
        """Draw the schedule as a Gantt chart on `ax` (default a new figure); returns the axes.

        Stages are rows, time runs right; forwards are blue, backwards orange (darker for later
        chunks), each labelled with its micro-batch. Needs matplotlib.
        """
        import matplotlib.pyplot as plt  # only this helper needs matplotlib

        if ax is None:
            _, ax = plt.subplots(figsize=(min(24, 2 + 0.5 * self.ticks), 1 + 0.5 * self.stages))
        f, b = self._phases(forward_cost, backward_cost)
        starts = np.concatenate([[0.0], np.cumsum(f + b)[:-1]])
        shades = np.linspace(1.0, 0.55, self.virtual_stages)  # later chunks darker
        v = self.virtual_stages
        for micro, chunk, begin, width, color in (
            (self.forward, self.forward_chunk, starts, forward_cost / v, (0.25, 0.5, 0.85)),
            (self.backward, self.backward_chunk, starts + f, backward_cost / v, (0.95, 0.6, 0.2)),
        ):
            for t, s in zip(*np.nonzero(micro >= 0), strict=True):
                shade = shades[chunk[t, s]]
                ax.broken_barh(
                    [(begin[t], width)],
                    (s - 0.4, 0.8),
                    facecolors=[tuple(c * shade for c in color)],
                    edgecolor="white",
                )
                ax.text(begin[t] + width / 2, s, str(micro[t, s]), ha="center", va="center")
        ax.set_yticks(range(self.stages), [f"stage {s}" for s in range(self.stages)])
        ax.invert_yaxis()
        ax.set_xlabel(f"time (forward of one stage = {forward_cost:g})")
        ax.set_title(self._title(forward_cost, backward_cost))
        return ax


class _Orders(NamedTuple):
    """How each stage runs a schedule, for `pipeline_schedule`'s simulation."""

    forwards: list[_Op]  # every stage's forwards, in the order it runs them
    backwards: list[_Op]  # and its backwards
    limits: list[float]  # per stage, the most micro-batch chunks it may hold in flight
    backwards_wait: bool  # whether a stage's backwards wait for all of its forwards


def _orders(mode: str, stages: int, micro_batches: int, virtual_stages: int) -> _Orders:
    if mode != "VPP":
        order = [(0, i) for i in range(micro_batches)]
        if mode == "FThenB":
            return _Orders(order, order, [math.inf] * stages, True)
        return _Orders(order, order, [2 * (stages - s) - 1 for s in range(stages)], False)
    # Paddle's rounds: the first holds P + m % P micro-batches, the others P.
    first = stages + micro_batches % stages
    rounds = [range(first)] + [range(i, i + stages) for i in range(first, micro_batches, stages)]
    chunks = range(virtual_stages)
    forwards = [(v, i) for r in rounds for v in chunks for i in r]
    backwards = [(v, i) for r in rounds for v in reversed(chunks) for i in r]
    if micro_batches < 2 * stages:  # PipelineParallelWithInterleaveFthenB
        return _Orders(forwards, backwards, [math.inf] * stages, True)
    limits = [2 * (stages - 1 - s) + (virtual_stages - 1) * first + 1 for s in range(stages)]
    return _Orders(forwards, backwards, limits, False)


def _simulate(orders: _Orders, stages: int, virtual_stages: int) -> list[tuple[list, list]]:
    """Per tick, each stage's forward and backward (or None): a stage runs its next forward,
    then its next backward, as soon as their inputs have arrived (sent by a neighbour in an
    earlier tick; for the last virtual stage's backward, its own forward, in this tick or
    earlier) and its in-flight limit allows."""
    forwards, backwards, limits, backwards_wait = orders
    last = stages * virtual_stages - 1
    f_tick: dict[tuple[int, int], int] = {}  # (virtual stage, micro-batch) -> tick
    b_tick: dict[tuple[int, int], int] = {}
    f_next, b_next = [0] * stages, [0] * stages
    rows: list[tuple[list, list]] = []
    while min(b_next) < len(backwards):
        t = len(rows)
        f_row: list[_Op | None] = [None] * stages
        b_row: list[_Op | None] = [None] * stages
        for s in range(stages):
            if f_next[s] < len(forwards) and f_next[s] - b_next[s] < limits[s]:
                v, i = forwards[f_next[s]]
                k = v * stages + s
                if k == 0 or f_tick.get((k - 1, i), t) < t:
                    f_row[s] = (v, i)
                    f_tick[k, i] = t
        for s in range(stages):
            f_next[s] += f_row[s] is not None
            if b_next[s] < len(backwards) and not (backwards_wait and f_next[s] < len(forwards)):
                v, i = backwards[b_next[s]]
                k = v * stages + s
                if k == last:
                    ready = f_tick.get((k, i), t + 1) <= t
                else:
                    ready = b_tick.get((k + 1, i), t) < t
                if ready:
                    b_row[s] = (v, i)
                    b_tick[k, i] = t
                    b_next[s] += 1
        if not any(f_row) and not any(b_row):
            raise RuntimeError(f"the pipeline schedule stalls at tick {t}; this is a bug")
        rows.append((f_row, b_row))
    return rows


def pipeline_schedule(
    schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1
) -> PipelineSchedule:
    """The table of `schedule` for `stages` pipeline stages and `micro_batches` micro-batches.

    Args:
      schedule: "FThenB" (or Paddle's "F-then-B"), "1F1B" or "VPP" (`schedule_mode`).
      stages: the pipeline degree P (`pp_degree`).
      micro_batches: m (`accumulate_steps`).
      virtual_stages: V, model chunks per stage (`vpp_degree`); VPP needs V >= 2 and m >= P.

    Raises:
      ValueError: for an unknown schedule or counts Paddle does not allow.
    """
    mode = _check_schedule(schedule, stages, micro_batches, virtual_stages)
    orders = _orders(mode, stages, micro_batches, virtual_stages)
    rows = _simulate(orders, stages, virtual_stages)

    def table(which: int, field: int, idle: int) -> np.ndarray:
        return np.array(
            [[idle if op is None else op[field] for op in row[which]] for row in rows], np.int32
        )

    return PipelineSchedule(
        mode,
        stages,
        micro_batches,
        virtual_stages,
        forward=table(0, 1, -1),
        forward_chunk=table(0, 0, 0),
        backward=table(1, 1, -1),
        backward_chunk=table(1, 0, 0),
    )
