"""How `pipeline_schedule` makes a table: each stage's order of work and its in-flight limit
(`orders`), a lockstep simulation that runs every forward and backward as soon as its input has
arrived (`simulate`), and where the weight-gradient halves of a split backward go
(`weight_ticks`).

A row of the simulation is, per stage, the forward and the backward it runs in one tick (a
(chunk, micro-batch) pair, or None). Under the zero-bubble schedules the backward is only the
input-gradient half B; the weight-gradient half W of the same (chunk, micro-batch) runs in the
same tick after it, or later (`weight_ticks`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

Op = tuple[int, int]  # (chunk, micro-batch)
Row = tuple[list[Op | None], list[Op | None]]  # per stage: its forward, its backward

SPLIT = ("ZBH1", "ZBVPP")  # the schedules whose backward is split into B and W


class Orders(NamedTuple):
    """How each stage runs a schedule, for `simulate`."""

    forwards: list[Op]  # every stage's forwards, in the order it runs them
    backwards: list[Op]  # and its backwards
    limits: list[float]  # per stage, the most micro-batch chunks it may hold in flight
    backwards_wait: bool  # whether a stage's backwards wait for all of its forwards


def orders(mode: str, stages: int, micro_batches: int, virtual_stages: int) -> Orders:
    """Paddle's order of each stage's work under `mode` (a canonical schedule name).

    1F1B, Eager1F1B and ZBH1 share one order: in lockstep ticks, where a hop between stages
    costs a tick, 1F1B runs Paddle's Eager1F1B warm-up (2 (P - s) - 1 forwards in flight), and
    ZBH1 is that order with the backward split. ZBVPP is VPP's order with the backward split.
    """
    if mode not in ("VPP", "ZBVPP"):
        order = [(0, i) for i in range(micro_batches)]
        if mode == "FThenB":
            return Orders(order, order, [math.inf] * stages, True)
        return Orders(order, order, [2 * (stages - s) - 1 for s in range(stages)], False)
    # Paddle's rounds: the first holds P + m % P micro-batches, the others P.
    first = stages + micro_batches % stages
    rounds = [range(first)] + [range(i, i + stages) for i in range(first, micro_batches, stages)]
    chunks = range(virtual_stages)
    forwards = [(v, i) for r in rounds for v in chunks for i in r]
    backwards = [(v, i) for r in rounds for v in reversed(chunks) for i in r]
    if micro_batches < 2 * stages:  # PipelineParallelWithInterleaveFthenB
        return Orders(forwards, backwards, [math.inf] * stages, True)
    limits = [2 * (stages - 1 - s) + (virtual_stages - 1) * first + 1 for s in range(stages)]
    return Orders(forwards, backwards, limits, False)


def simulate(orders: Orders, stages: int, virtual_stages: int) -> list[Row]:
    """Per tick, each stage's forward and backward (or None): a stage runs its next forward,
    then its next backward, as soon as their inputs have arrived (sent by a neighbour in an
    earlier tick; for the last virtual stage's backward, its own forward, in this tick or
    earlier) and its in-flight limit allows."""
    forwards, backwards, limits, backwards_wait = orders
    last = stages * virtual_stages - 1
    f_tick: dict[tuple[int, int], int] = {}  # (virtual stage, micro-batch) -> tick
    b_tick: dict[tuple[int, int], int] = {}
    f_next, b_next = [0] * stages, [0] * stages
    rows: list[Row] = []
    while min(b_next) < len(backwards):
        t = len(rows)
        f_row: list[Op | None] = [None] * stages
        b_row: list[Op | None] = [None] * stages
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


def weight_ticks(rows: list[Row], mode: str) -> tuple[list[Row], list[list[Op | None]]]:
    """The rows (with W-only ticks appended where needed) and, per tick, each stage's W.

    Without a split backward a W is its B (the whole backward, in its tick). Split (Paddle's
    ZBH1 job order): stage ``s`` runs the W of each backward in the same tick as its B, except
    for its first ``s`` backwards, whose Ws wait for the ticks after its last B, where it would
    otherwise idle. So stage ``s`` holds at most ``s`` Ws back, and, as the backward chain
    climbs back through the stages during the cool-down, the later stages' B ticks are not
    lengthened by their Ws.
    """
    if mode not in SPLIT:
        return rows, [list(b_row) for _, b_row in rows]
    stages = len(rows[0][0])
    rows = [(list(f), list(b)) for f, b in rows]
    weights: list[list[Op | None]] = [[None] * stages for _ in rows]
    for s in range(stages):
        ran = [(t, b[s]) for t, (_, b) in enumerate(rows) if b[s] is not None]
        for t, op in ran[s:]:
            weights[t][s] = op
        t = ran[-1][0] + 1
        for _, op in ran[:s]:  # the deferred Ws, one a tick after the stage's last B
            if t == len(rows):
                rows.append(([None] * stages, [None] * stages))
                weights.append([None] * stages)
            weights[t][s] = op
            t += 1
    return rows, weights
