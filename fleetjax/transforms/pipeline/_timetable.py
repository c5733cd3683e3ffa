"""A pipeline schedule made executable: every tick's row of work, and the buffer slots it uses.

The schedule says which micro-batch each stage runs forward and backward in each tick; the
program also needs to know where the values it keeps across ticks live. Each stage keeps three
buffers of slots, all the same size on every stage (one SPMD program): the `jax.vjp` residuals
of forwards whose backward has not run, the activations received and not yet consumed, and the
cotangents received (or made by the head) and not yet consumed. `timetable` assigns the slots
once, in numpy, so that the program only indexes.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from fleetjax.transforms.pipeline.schedules import PipelineSchedule

# Columns of the timetable's table [ticks, stages, COLUMNS]. The forward: its micro-batch (-1:
# none), chunk, input's activation slot, residual slot, and head-cotangent slot (last virtual
# stage); the backward: micro-batch, chunk, residual slot, cotangent slot; then the slots that
# receive this tick's activation and cotangent.
F_MICRO, F_CHUNK, F_ACT, F_RES, F_DY = range(5)
B_MICRO, B_CHUNK, B_RES, B_COT = range(5, 9)
RECV_ACT, RECV_COT = range(9, 11)
COLUMNS = 11


class _Slots:
    """Buffer slots of one stage, the lowest free one taken first."""

    def __init__(self) -> None:
        self.size = 0
        self._free: list[int] = []

    def take(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        heapq.heappush(self._free, slot)


class Segment(NamedTuple):
    """Consecutive ticks [start, stop) that run the same kinds of work: forwards (on some
    stage), backwards, or both; and whether any of its ticks sends an activation on, or a
    cotangent back. The program compiles one loop per segment, so the warm-up runs no backward
    and sends no cotangent, and the cool-down runs no forward and sends no activation."""

    start: int
    stop: int
    forward: bool
    backward: bool
    send_forward: bool
    send_backward: bool


class Timetable(NamedTuple):
    """A schedule made executable: the table [ticks, stages, COLUMNS], the buffers' sizes and
    the ticks' segments."""

    table: np.ndarray
    residual_slots: int  # vjp residuals of forwards whose backward has not run
    activation_slots: int  # activations received and not yet consumed, and a trash slot
    cotangent_slots: int  # cotangents received (or made by the head) not yet consumed, + trash
    segments: tuple[Segment, ...]


def timetable(schedule: PipelineSchedule) -> Timetable:
    """Assign buffer slots to every value the schedule keeps across ticks.

    Within a tick a stage reads its forward input, writes residuals (and, at the last virtual
    stage, the head's cotangent), then reads the backward's cotangent and residuals, and at the
    end of the tick receives; a slot is reused as soon as that order allows. Residuals are
    written only by a forward that runs, so idle rows point at slot 0; activations and
    cotangents are written every tick, so their buffers get a trash slot, the last, for idle
    rows.
    """
    stages, last = schedule.stages, schedule.stages * schedule.virtual_stages - 1
    residuals = [_Slots() for _ in range(stages)]
    activations = [_Slots() for _ in range(stages)]
    cotangents = [_Slots() for _ in range(stages)]
    held: dict[tuple[str, int, int, int], int] = {}  # (kind, stage, virtual stage, micro) -> slot
    trash = -1
    table = np.full((schedule.ticks, stages, COLUMNS), trash, np.int32)
    for t in range(schedule.ticks):
        row = table[t]
        row[:, F_MICRO], row[:, F_CHUNK] = schedule.forward[t], schedule.forward_chunk[t]
        row[:, B_MICRO], row[:, B_CHUNK] = schedule.backward[t], schedule.backward_chunk[t]
        for s in range(stages):
            i, k = row[s, F_MICRO], row[s, F_CHUNK] * stages + s
            if i < 0:
                continue
            if k > 0:
                row[s, F_ACT] = held.pop(("act", s, k, i))
                activations[s].give(row[s, F_ACT])
            row[s, F_RES] = held["res", s, k, i] = residuals[s].take()
            if k == last:
                row[s, F_DY] = held["cot", s, k, i] = cotangents[s].take()
        for s in range(stages):
            i, k = row[s, B_MICRO], row[s, B_CHUNK] * stages + s
            if i < 0:
                continue
            row[s, B_COT] = held.pop(("cot", s, k, i))
            cotangents[s].give(row[s, B_COT])
            row[s, B_RES] = held.pop(("res", s, k, i))
            residuals[s].give(row[s, B_RES])
        for s in range(stages):
            i, k = row[s, F_MICRO], row[s, F_CHUNK] * stages + s
            if i >= 0 and k < last:
                to = (s + 1) % stages
                row[to, RECV_ACT] = held["act", to, k + 1, i] = activations[to].take()
            i, k = row[s, B_MICRO], row[s, B_CHUNK] * stages + s
            if i >= 0 and k > 0:
                to = (s - 1) % stages
                row[to, RECV_COT] = held["cot", to, k - 1, i] = cotangents[to].take()
    sizes = [max(b.size for b in buffers) for buffers in (residuals, activations, cotangents)]
    # A ring of the rule's bound: the same memory whatever the number of micro-batches.
    sizes[0] = max(sizes[0], schedule.in_flight_bound or 0)
    unused = (0, sizes[1], sizes[2])
    for columns, slot in zip(
        ((F_RES, B_RES), (F_ACT, RECV_ACT), (F_DY, B_COT, RECV_COT)), unused, strict=True
    ):
        for c in columns:
            table[..., c] = np.where(table[..., c] == trash, slot, table[..., c])
    return Timetable(table, sizes[0], sizes[1] + 1, sizes[2] + 1, segments(schedule))


def segments(schedule: PipelineSchedule) -> tuple[Segment, ...]:
    """The schedule's ticks cut into `Segment`s: runs of ticks with forwards only, both, or
    backwards only."""
    stages, last = schedule.stages, schedule.stages * schedule.virtual_stages - 1
    position = np.arange(stages)
    forward, backward = schedule.forward >= 0, schedule.backward >= 0
    sends_on = forward & (schedule.forward_chunk * stages + position < last)
    sends_back = backward & (schedule.backward_chunk * stages + position > 0)
    work = np.stack([forward.any(axis=1), backward.any(axis=1)], axis=1)
    cuts = [0, *(t for t in range(1, schedule.ticks) if (work[t] != work[t - 1]).any())]
    bounds = zip(cuts, [*cuts[1:], schedule.ticks], strict=True)
    return tuple(
        Segment(a, b, *map(bool, work[a]), bool(sends_on[a:b].any()), bool(sends_back[a:b].any()))
        for a, b in bounds
    )
