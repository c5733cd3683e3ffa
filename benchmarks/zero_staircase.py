"""The ZeRO staircase: per-device bytes of parameters and Adam state by sharding stage.

Compiles fleetjax train steps for an MLP of fp32 weight matrices with Adam at ZeRO stages
0 (none), 1, 2 and 3 over `sharding` = N = 8 devices (the accelerators where there are 8,
else simulated CPU devices) and compares each device's state bytes with ZeRO's formulas
(P = parameter bytes): no sharding 3P (parameters, Adam's two moments); stages 1 and 2:
P + 2P/N; stage 3: 3P/N. Measured twice: from XLA (`memory_analysis().argument_size_in_bytes`
less the device's batch rows) and from the placed state (the first device's shards). Also the
gradients each device keeps and XLA's temporaries, where stage 2 differs from stage 1. With
an accelerator, adds the same on all accelerators with `optimize_offload` off and on (the
optimizer state in pinned host memory).

    python benchmarks/zero_staircase.py [--out DIR]
"""

from __future__ import annotations

from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import _mlp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import MiB, Result, bench_devices, describe  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import fleetjax  # noqa: E402

N, WIDTH, LAYERS, ROWS = 8, 512, 4, 64
STAGES = (0, 1, 2, 3)


def inputs() -> tuple[_mlp.Arrays, _mlp.Arrays]:
    return _mlp.inputs(LAYERS, WIDTH, ROWS)


def formula(stage: int, p: float, n: int) -> float:
    """ZeRO's per-device bytes of fp32 parameters and Adam's two moments over `n` devices."""
    return {0: 3 * p, 1: p + 2 * p / n, 2: p + 2 * p / n, 3: 3 * p / n}[stage]


def strategy(stage: int, n: int, offload: bool) -> fleetjax.DistributedStrategy:
    if not stage:
        return fleetjax.DistributedStrategy()
    configs = {"stage": stage, "sharding_degree": n, "optimize_offload": offload}
    return fleetjax.DistributedStrategy(sharding=True, sharding_configs=configs)


def _shard_bytes(tree: Any, device: jax.Device, memory_kind: str | None = None) -> int:
    """Bytes of `tree`'s shards on `device` (in `memory_kind`, or in any memory)."""
    return sum(
        s.data.nbytes
        for x in jax.tree.leaves(tree)
        if memory_kind in (None, x.sharding.memory_kind)
        for s in x.addressable_shards
        if s.device == device
    )


def measure(stage: int, devices: list[jax.Device], offload: bool | None = None) -> dict[str, Any]:
    """One stage's row, sharding over all of `devices`; with `offload` given, with
    `optimize_offload` so, and columns saying which memory the state is in."""
    params, batch = inputs()
    n = len(devices)
    mesh = fleetjax.build_mesh(dp=1, sharding=n, devices=devices)
    step = fleetjax.make_train_step(
        _mlp.loss_fn, optax.adam(1e-3), strategy(stage, n, bool(offload)), mesh
    )
    state = step.init(params)
    explained = fleetjax.explain(step, batch, state, show=False)
    batch_bytes = sum(x.nbytes for x in batch.values()) // n  # each device's rows
    expected = formula(stage, sum(x.nbytes for x in params.values()), n)
    compiled = explained.arguments - batch_bytes
    held = (state.params, state.opt_state)
    placed = _shard_bytes(held, devices[0])
    row = {
        "devices": describe(devices),
        "stage": stage,
        "formula MiB": expected / MiB,
        "compiled MiB": compiled / MiB,
        "compiled / formula": compiled / expected,
        "placed MiB": placed / MiB,
        "placed / formula": placed / expected,
        "gradients MiB": explained.grads / MiB,
        "temp MiB": explained.temp / MiB,
    }
    if offload is not None:  # which memory the placed state is in; XLA's host arguments
        row |= {
            "optimize_offload": offload,
            "placed in device memory MiB": _shard_bytes(held, devices[0], "device") / MiB,
            "placed in pinned host MiB": _shard_bytes(held, devices[0], "pinned_host") / MiB,
            "compiled host MiB": explained.host_arguments / MiB,
        }
    return row


def _figure(rows: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(7, 3.6))
    ax = fig.subplots()
    x = np.arange(len(rows))
    bars = (
        ("formula MiB", "formula"),
        ("compiled MiB", "memory_analysis"),
        ("placed MiB", "placed shards"),
        ("temp MiB", "temporaries"),
    )
    for i, (key, label) in enumerate(bars):
        ax.bar(x + (i - 1.5) * 0.2, [r[key] for r in rows], 0.2, label=label)
    ax.set_xticks(x, [f"stage {r['stage']}" if r["stage"] else "no ZeRO" for r in rows])
    ax.set_ylabel("MiB per device")
    ax.set_title(f"ZeRO staircase: fp32 parameters + Adam, {rows[0]['devices']}")
    ax.legend(fontsize=8)
    return fig


def run(quick: bool = False) -> Result:
    del quick  # compiles only: four stages are quick already
    devices = bench_devices(N)
    rows = [measure(stage, devices) for stage in STAGES]
    accelerators = jax.devices()
    offloaded = accelerators[0].platform != "cpu"
    if offloaded:  # on CPU pinned host memory is the device's own: nothing to show there
        stages = STAGES if len(accelerators) > 1 else (0, 1)  # one device: nothing to shard
        rows += [measure(s, accelerators, False) for s in stages]
        rows += [measure(s, accelerators, True) for s in stages if s]
    params, _ = inputs()
    p = sum(x.nbytes for x in params.values())
    one, two, three = rows[1:4]
    notes = f"""
{LAYERS} layers of fp32 {WIDTH}x{WIDTH} weights and {WIDTH}-element biases, P = {p / MiB:.2f}
MiB, Adam; per-device bytes of parameters + optimizer state with the `sharding` axis over all
N devices. "compiled" is `memory_analysis().argument_size_in_bytes` less the device's batch
rows; "placed" sums the first device's shards of the state `step.init` made. Both follow the
formulas (no ZeRO 3P; stages 1, 2: P + 2P/N; stage 3: 3P/N) to within the biases, which ZeRO
keeps whole (under {fleetjax.mesh.ZERO_MIN_ELEMENTS} elements). Stage 2 also keeps only 1/N of
the gradients ({two["gradients MiB"]:.2f} vs {one["gradients MiB"]:.2f} MiB), which cuts XLA's
temporaries from {one["temp MiB"]:.2f} to {two["temp MiB"]:.2f} MiB; stage 3's temporaries
({three["temp MiB"]:.2f} MiB) hold the parameters it all-gathers for the forward and backward.
"""
    if offloaded:
        notes += f"""
On {describe(accelerators)}, with `optimize_offload` on and off: with it the optimizer state
is placed in pinned host memory ("placed in pinned host"), the parameters stay in device
memory; "compiled host" is what XLA's `memory_analysis()` counts as host arguments.
"""
    else:
        notes += """
On CPU pinned host memory is the device's own, so `optimize_offload` (device vs pinned host
bytes) is measured only on an accelerator: run `python benchmarks/run.py --only
zero_staircase` there.
"""
    title = "ZeRO staircase: per-device state bytes by stage"
    return Result(title, rows, notes, _figure(rows[:4]), devices)


if __name__ == "__main__":
    from _report import main

    main("zero_staircase", run)
