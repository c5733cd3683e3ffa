"""A pipeline schedule made executable: every tick's row of work, and the buffer slots it uses.

The schedule says which micro-batch each stage runs forward and backward in each tick; the
program also needs to know where the values it keeps across ticks live. Each stage keeps three
buffers of slots, all the same size on every stage (one SPMD program): the `jax.vjp` residuals
of forwards whose backward has not run, the activations received and not yet consumed, and the
cotangents received (or made by the head) and not yet consumed. Under a split backward (the
zero-bubble schedules) a forward's residuals are kept until its W has run, with what its B made
for its W (`_split.SplitBackward`'s carry) in residuals only B reads, where they fit
(`_chunk.Chunk.carry_homes`), and in a fourth buffer where they do not. `timetable` assigns the
slots once, in numpy, so that the program only indexes.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from fleetjax.transforms.pipeline.schedules import PipelineSchedule

# Columns of the timetable's table [ticks, stages, COLUMNS]. The forward: its micro-batch (-1:
# none), chunk, input's activation slot, residual slot, and head-cotangent slot (last virtual
# stage); the backward: micro-batch, chunk, residual slot, cotangent slot; the slots that
# receive this tick's activation and cotangent; under a split backward, the carry slot B
# writes, and W's micro-batch, chunk, residual slot and carry slot.
F_MICRO, F_CHUNK, F_ACT, F_RES, F_DY = range(5)
B_MICRO, B_CHUNK, B_RES, B_COT = range(5, 9)
RECV_ACT, RECV_COT = range(9, 11)
B_CARRY, W_MICRO, W_CHUNK, W_RES, W_CARRY = range(11, 16)
COLUMNS = 16


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
    stage), backwards, both (and, split, weight gradients); and whether any of its ticks sends
    an activation on, or a cotangent back. The program compiles one loop per segment, so the
    warm-up runs no backward and sends no cotangent, and the cool-down runs no forward and
    sends no activation."""

    start: int
    stop: int
    forward: bool
    backward: bool
    send_forward: bool
    send_backward: bool
    weight: bool = False


class Timetable(NamedTuple):
    """A schedule made executable: the table [ticks, stages, COLUMNS], the buffers' sizes and
    the ticks' segments."""

    table: np.ndarray
    residual_slots: int  # vjp residuals of forwards whose backward (split: W) has not run
    activation_slots: int  # activations received and not yet consumed, and a trash slot
    cotangent_slots: int  # cotangents received (or made by the head) not yet consumed, + trash
    segments: tuple[Segment, ...]
    carry_slots: int = 0  # split backward: what Bs made for Ws that have not run


class _Assigner:
    """A stage's buffers and the values held in them, slot by slot, as the ticks run."""

    def __init__(self, schedule: PipelineSchedule) -> None:
        self.stages = schedule.stages
        self.last = schedule.stages * schedule.virtual_stages - 1  # the last virtual stage
        self.split = schedule.split_backward
        kinds = ("res", "act", "cot", "carry")
        self.buffers = {kind: [_Slots() for _ in range(self.stages)] for kind in kinds}
        self.held: dict[tuple[str, int, int, int], int] = {}  # (kind, stage, virtual, micro)

    def take(self, kind: str, s: int, k: int, i: int) -> int:
        self.held[kind, s, k, i] = slot = self.buffers[kind][s].take()
        return slot

    def give(self, kind: str, s: int, k: int, i: int) -> int:
        slot = self.held.pop((kind, s, k, i))
        self.buffers[kind][s].give(slot)
        return slot

    def forward(self, row: np.ndarray, s: int) -> None:
        i, k = row[s, F_MICRO], row[s, F_CHUNK] * self.stages + s
        if k > 0:
            row[s, F_ACT] = self.give("act", s, k, i)
        row[s, F_RES] = self.take("res", s, k, i)
        if k == self.last:
            row[s, F_DY] = self.take("cot", s, k, i)

    def backward(self, row: np.ndarray, s: int) -> None:
        i, k = row[s, B_MICRO], row[s, B_CHUNK] * self.stages + s
        row[s, B_COT] = self.give("cot", s, k, i)
        if not self.split:
            row[s, B_RES] = self.give("res", s, k, i)
            return
        row[s, B_RES] = self.held["res", s, k, i]  # kept for the W
        row[s, B_CARRY] = self.take("carry", s, k, i)

    def weight(self, row: np.ndarray, s: int) -> None:
        i, k = row[s, W_MICRO], row[s, W_CHUNK] * self.stages + s
        row[s, W_RES] = self.give("res", s, k, i)
        row[s, W_CARRY] = self.give("carry", s, k, i)

    def receive(self, row: np.ndarray, s: int) -> None:
        """The slots of the activation and cotangent `s` sends, on the neighbours."""
        i, k = row[s, F_MICRO], row[s, F_CHUNK] * self.stages + s
        if i >= 0 and k < self.last:
            to = (s + 1) % self.stages
            row[to, RECV_ACT] = self.take("act", to, k + 1, i)
        i, k = row[s, B_MICRO], row[s, B_CHUNK] * self.stages + s
        if i >= 0 and k > 0:
            to = (s - 1) % self.stages
            row[to, RECV_COT] = self.take("cot", to, k - 1, i)

    def size(self, kind: str) -> int:
        return max(b.size for b in self.buffers[kind])


def timetable(schedule: PipelineSchedule) -> Timetable:
    """Assign buffer slots to every value the schedule keeps across ticks.

    Within a tick a stage reads its forward input, writes residuals (and, at the last virtual
    stage, the head's cotangent), then reads the backward's cotangent and residuals (split:
    writes the carry; its W then reads them), and at the end of the tick receives; a slot is
    reused as soon as that order allows. Residuals and carries are written only by work that
    runs, so idle rows point at slot 0; activations and cotangents are written every tick, so
    their buffers get a trash slot, the last, for idle rows.
    """
    assign = _Assigner(schedule)
    trash = -1
    table = np.full((schedule.ticks, schedule.stages, COLUMNS), trash, np.int32)
    for t in range(schedule.ticks):
        row = table[t]
        row[:, F_MICRO], row[:, F_CHUNK] = schedule.forward[t], schedule.forward_chunk[t]
        row[:, B_MICRO], row[:, B_CHUNK] = schedule.backward[t], schedule.backward_chunk[t]
        if assign.split:
            row[:, W_MICRO], row[:, W_CHUNK] = schedule.weight[t], schedule.weight_chunk[t]
        for work, micro in ((assign.forward, F_MICRO), (assign.backward, B_MICRO)):
            for s in np.nonzero(row[:, micro] >= 0)[0]:
                work(row, s)
        for s in np.nonzero(row[:, W_MICRO] >= 0)[0] if assign.split else ():
            assign.weight(row, s)
        for s in range(schedule.stages):
            assign.receive(row, s)
    # A ring of the rule's bound: the same memory whatever the number of micro-batches.
    residuals = max(assign.size("res"), schedule.in_flight_bound or 0)
    activations, cotangents = assign.size("act"), assign.size("cot")
    unused = {
        (F_RES, B_RES, W_RES, B_CARRY, W_CARRY): 0,
        (F_ACT, RECV_ACT): activations,
        (F_DY, B_COT, RECV_COT): cotangents,
    }
    for columns, slot in unused.items():
        for c in columns:
            table[..., c] = np.where(table[..., c] == trash, slot, table[..., c])
    return Timetable(
        table,
        residuals,
        activations + 1,
        cotangents + 1,
        segments(schedule),
        assign.size("carry"),
    )


def segments(schedule: PipelineSchedule) -> tuple[Segment, ...]:
    """The schedule's ticks cut into `Segment`s: runs of ticks with forwards only, both, or
    backwards only (and, split, with or without weight gradients)."""
    stages, last = schedule.stages, schedule.stages * schedule.virtual_stages - 1
    position = np.arange(stages)
    forward, backward = schedule.forward >= 0, schedule.backward >= 0
    sends_on = forward & (schedule.forward_chunk * stages + position < last)
    sends_back = backward & (schedule.backward_chunk * stages + position > 0)
    weight = (schedule.weight >= 0) & schedule.split_backward
    work = np.stack([forward.any(axis=1), backward.any(axis=1), weight.any(axis=1)], axis=1)
    cuts = [0, *(t for t in range(1, schedule.ticks) if (work[t] != work[t - 1]).any())]
    bounds = zip(cuts, [*cuts[1:], schedule.ticks], strict=True)
    return tuple(
        Segment(
            a,
            b,
            *map(bool, work[a, :2]),
            bool(sends_on[a:b].any()),
            bool(sends_back[a:b].any()),
            bool(work[a, 2]),
        )
        for a, b in bounds
    )
