"""Input pipeline: training throughput with and without `fleetjax.data.Loader`'s prefetch, when
transforming the input costs about as much as the step.

The step trains the tanh MLP of `_mlp` data parallel on 8 devices; the loader reads its records
through a per-record transformation calibrated (each round) to take, for a whole batch, the
step's own time. Two transformations: one that waits (on storage or the network, as reading remote
records does; modelled by a sleep) and one that computes on the host (a matrix-vector product
per record, repeated). Without prefetch (`prefetch=0`) each batch is read, transformed and
placed when the loop asks for it; with `prefetch=2` a background thread does that for the next
batches while the step runs, and with `read_threads=2` as well two threads read two batches at
once. Each configuration runs in rounds of a fresh loader, alternating
which goes first (so both see the same load from other processes); every step is waited for.

    python benchmarks/input_pipeline.py [--quick]
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import _mlp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import Result, bench_devices, describe  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import fleetjax  # noqa: E402
from fleetjax.data import Loader  # noqa: E402

WIDTH, LAYERS, ROWS, RECORDS = 512, 8, 8, 4096
# (prefetch, read_threads): none; grain's prefetch thread; and grain's read threads as well.
CONFIGS = ((0, 0), (2, 0), (2, 2))
Transform = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def waiting(seconds: float) -> Transform:
    """A transformation that waits `seconds` per record (I/O: the GIL is released)."""

    def transform(record: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(seconds)
        return record

    return transform


def computing(seconds: float) -> Transform:
    """A transformation that computes for about `seconds` per record: repeated products of
    the record with a fixed random matrix, normalised (numpy, on the host's cores)."""
    mix = np.random.default_rng(1).normal(size=(WIDTH, WIDTH)).astype(np.float32) / WIDTH**0.5

    def project(x: np.ndarray, times: int) -> np.ndarray:
        for _ in range(times):
            x = np.tanh(mix @ x)
        return x

    probe = np.ones(WIDTH, np.float32)
    once = statistics.median(_seconds(lambda: project(probe, 10)) for _ in range(20)) / 10
    times = max(1, round(seconds / once))

    def transform(record: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**record, "x": project(record["x"], times)}

    return transform


class Case(NamedTuple):
    label: str
    make: Callable[[float], Transform]  # seconds per record -> the transformation


CASES = (Case("waits (I/O)", waiting), Case("computes (host CPU)", computing))


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _records() -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(RECORDS, WIDTH)).astype(np.float32)
    return {"x": x, "y": np.tanh(x[:, ::-1]).copy()}


def _round(step: Any, state: Any, loader: Loader, steps: int) -> tuple[Any, float, float]:
    """`steps` steps on `loader`'s batches after one to start it: (state, seconds per step,
    mean seconds the loop waited for a batch)."""
    state, metrics = step(state, next(loader))
    jax.block_until_ready(metrics)
    waits = []
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(loader)
        waits.append(loader.last_wait_s)
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
    return state, (time.perf_counter() - start) / steps, statistics.mean(waits)


def _input_seconds(step: Any, records: Any, transform: Transform, batches: int = 3) -> float:
    """Median seconds to read, transform and place a batch, without prefetch or a step."""
    with Loader(records, step, ROWS, transform=transform, prefetch=0) as loader:
        next(loader)
        return statistics.median(_seconds(lambda: next(loader)) for _ in range(batches))


def _step_seconds(step: Any, state: Any, batch: Any, steps: int = 8) -> tuple[Any, float]:
    """The state after `steps` steps on `batch` (placed), and their median seconds."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return state, statistics.median(times)


def _calibrated(
    case: Case, step: Any, records: Any, step_s: float, per_record: float | None
) -> tuple[Transform, float, float]:
    """`case`'s transformation, its seconds per record (from `per_record`, or a first guess)
    scaled so that a batch costs `step_s` as measured (the loader's own cost and the sleep's
    overshoot included), and what a batch then costs."""
    per_record = per_record or step_s / ROWS
    per_record *= step_s / _input_seconds(step, records, case.make(per_record))
    transform = case.make(per_record)
    return transform, _input_seconds(step, records, transform), per_record


def measure(case: Case, rounds: int, steps: int, devices: list[jax.Device]) -> list[dict]:
    """Each of `CONFIGS` on `case`, `rounds` rounds of `steps` steps each: a row for each."""
    params, batch = _mlp.inputs(LAYERS, WIDTH, ROWS)
    mesh = fleetjax.build_mesh(devices=devices)
    step = fleetjax.make_train_step(_mlp.loss_fn, optax.adam(1e-3), mesh=mesh)
    state = step.init(params)
    placed = step.shard_batch(batch)
    state, _ = _step_seconds(step, state, placed, 3)  # compile, warm caches
    records, per_record = _records(), None
    alone: dict[str, list[float]] = {"step": [], "input": []}
    times: dict[tuple[int, int], list[float]] = {config: [] for config in CONFIGS}
    waits: dict[tuple[int, int], list[float]] = {config: [] for config in CONFIGS}
    for r in range(rounds):
        # Calibrated each round: other processes' load changes the step's time, not a sleep's.
        state, step_s = _step_seconds(step, state, placed)
        transform, input_s, per_record = _calibrated(case, step, records, step_s, per_record)
        alone["step"].append(step_s)
        alone["input"].append(input_s)
        for prefetch, threads in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            options = {"transform": transform, "prefetch": prefetch, "read_threads": threads}
            with Loader(records, step, ROWS, seed=r, **options) as loader:
                state, seconds, wait = _round(step, state, loader, steps)
            times[prefetch, threads].append(seconds)
            waits[prefetch, threads].append(wait)
    rows = []
    for config in CONFIGS:
        # Per round: the round's configurations see the same load from other processes.
        ratios = np.array(times[CONFIGS[0]]) / np.array(times[config])
        rows.append(
            {
                "transformation": case.label,
                "prefetch": config[0],
                "read_threads": config[1],
                "step alone ms": 1e3 * statistics.median(alone["step"]),
                "input alone ms": 1e3 * statistics.median(alone["input"]),
                "ms per step": 1e3 * statistics.median(times[config]),
                "steps/s": 1 / statistics.median(times[config]),
                "host wait ms": 1e3 * statistics.median(waits[config]),
                "speedup": float(np.median(ratios)),
                "speedup quartiles": "{:.2f}-{:.2f}".format(*np.percentile(ratios, [25, 75])),
            }
        )
    return rows


def _figure(rows: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(9, 4))
    ax = fig.subplots()
    labels = [
        f"{r['transformation'].split()[0]}\nprefetch={r['prefetch']}\nread_threads={r['read_threads']}"
        for r in rows
    ]
    x = np.arange(len(rows))
    wait = np.array([r["host wait ms"] for r in rows])
    total = np.array([r["ms per step"] for r in rows])
    ax.bar(x, total - wait, 0.6, label="step and hand-over")
    ax.bar(x, wait, 0.6, bottom=total - wait, label="waiting for the batch")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['speedup']:.2f}x", (i, total[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, labels, fontsize=8)
    ax.set_ylabel("median ms per step")
    ax.set_title("Training with an input transformation as costly as the step")
    ax.legend(fontsize=8)
    return fig


def run(quick: bool = False) -> Result:
    (rounds, steps), devices = (2, 6) if quick else (6, 10), bench_devices(8)
    load = os.getloadavg()[0]  # other processes on these cores slow both sides
    rows = [row for case in CASES for row in measure(case, rounds, steps, devices)]
    waits, computes = rows[: len(CONFIGS)], rows[len(CONFIGS) :]
    notes = f"""
The tanh MLP of `_mlp` ({LAYERS} layers of width {WIDTH}, Adam), data parallel on
{describe(devices)}, trained on global batches of {ROWS} records (one a device) from
`fleetjax.data.Loader` over {RECORDS} in-memory records. Each record goes through a
transformation calibrated, at the start of each of {rounds} rounds, so that reading,
transforming and placing a batch ("input alone ms", without a step) costs what the step does
("step alone ms", on a placed batch): one that waits (I/O, modelled by a sleep) and one that
computes on the host (numpy). A round runs {steps} steps of a fresh loader in each
configuration, alternating which goes first. "ms per step" is the median over the rounds;
"host wait ms" the median of the rounds' mean `loader.last_wait_s`; "speedup" the median over
the rounds of the throughput over that without prefetch (a round's configurations see the same
load from other processes), "speedup quartiles" its spread.

With prefetch, grain's prefetch thread reads, transforms and places the next batches on the
devices while the step runs. For the transformation that waits, training runs
{waits[1]["speedup"]:.2f}x as fast with `prefetch=2` and the wait per step falls from
{waits[0]["host wait ms"]:.0f} to {waits[1]["host wait ms"]:.0f} ms; with two of grain's read
threads as well, which read two batches at once, {waits[2]["speedup"]:.2f}x and
{waits[2]["host wait ms"]:.0f} ms. With the transformation that computes, the ratios are
{computes[1]["speedup"]:.2f} and {computes[2]["speedup"]:.2f}: here the 8 devices are simulated
on the same CPU cores that transform the records, so the two compete for them instead of
overlapping (on an accelerator the step does not use the host's cores). The host's load
average was {load:.1f} when the benchmark started ({os.cpu_count()} cores): other processes on
these cores slow the step and the prefetch thread alike, and the speedup with them. Waiting in
a few long waits per batch (one record a device) rather than many short ones keeps the
thread's wake-ups, which other processes delay, few.
"""
    title = "Input pipeline: prefetch against an input transformation as costly as the step"
    return Result(title, rows, notes, _figure(rows), devices)


if __name__ == "__main__":
    from _report import main

    main("input_pipeline", run)
