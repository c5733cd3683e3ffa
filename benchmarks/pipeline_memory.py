"""Per-device temp memory of the pipeline vs the number of micro-batches, per schedule.

Compiles (does not run) `fleetjax.transforms.pipeline.pipeline` for 8 residual MLP layers on
pp=4 simulated CPU devices, for FThenB, 1F1B and VPP (vpp_degree=2), at m = pp, 2 pp, 4 pp and
8 pp micro-batches, and reads the per-device temp bytes from `compiled.memory_analysis()`. Also
lists each schedule's table: the most chunk forwards a stage holds residuals for, and the idle
fraction.

    python benchmarks/pipeline_memory.py [--quick]
"""

from __future__ import annotations

from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import jax.numpy as jnp  # noqa: E402
from _report import MiB, Result  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from fleetjax.mesh import build_mesh  # noqa: E402
from fleetjax.transforms.pipeline import PipelineParams, pipeline, pipeline_schedule  # noqa: E402

PP, LAYERS, HIDDEN, MICRO_BATCH_SIZE = 4, 8, 128, 128
SCHEDULES = (("FThenB", 1), ("1F1B", 1), ("VPP", 2))


Params = dict[str, jax.Array]
Batch = dict[str, jax.Array]


def embed(p: Params, batch: Batch) -> jax.Array:
    return batch["x"] @ p["w"]


def stage(p: Params, x: jax.Array) -> jax.Array:
    return x + jax.nn.gelu(x @ p["up"]) @ p["down"]


def head_loss(p: Params, x: jax.Array, batch: Batch) -> jax.Array:
    return jnp.mean((x @ p["w"] - batch["y"]) ** 2)


def cpu_devices() -> list[jax.Device]:
    """The devices compiled for: simulated CPU devices, on any machine."""
    return jax.devices("cpu")[:PP]


def temp_bytes(
    mode: str, vpp: int, micro_batches: int, devices: list[jax.Device] | None = None
) -> int:
    """The pipeline's compiled temp bytes per device on `devices` (default: `cpu_devices()`)."""
    mesh = build_mesh(dp=1, pp=PP, devices=devices or cpu_devices())

    def spec(shape: tuple[int, ...], *axes: str) -> jax.ShapeDtypeStruct:
        sharding = NamedSharding(mesh, PartitionSpec(*axes))
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)

    params = PipelineParams(
        {"w": spec((HIDDEN, HIDDEN))},
        {
            "up": spec((LAYERS, HIDDEN, 4 * HIDDEN), "pp"),
            "down": spec((LAYERS, 4 * HIDDEN, HIDDEN), "pp"),
        },
        {"w": spec((HIDDEN, 8))},
    )
    rows = micro_batches * MICRO_BATCH_SIZE
    batch = {"x": spec((rows, HIDDEN)), "y": spec((rows, 8))}
    step = pipeline(
        embed,
        stage,
        head_loss,
        mesh=mesh,
        micro_batch_size=MICRO_BATCH_SIZE,
        accumulate_steps=micro_batches,
        schedule_mode=mode,
        vpp_degree=vpp,
    )
    return jax.jit(step).lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def rows_for(mode: str, vpp: int, micro_batches: tuple[int, ...]) -> list[dict[str, Any]]:
    name = mode if vpp == 1 else f"{mode} (V={vpp})"
    rows: list[dict[str, Any]] = []
    for m in micro_batches:
        temp = temp_bytes(mode, vpp, m) / MiB
        table = pipeline_schedule(mode, PP, m, vpp)
        rows.append(
            {
                "schedule": name,
                "micro-batches": m,
                "temp MiB": temp,
                "temp vs m=pp": temp / rows[0]["temp MiB"] if rows else 1.0,
                "in flight (chunks)": int(table.in_flight.max()),
                "idle": table.idle_fraction(),
            }
        )
    return rows


def _figure(rows: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(6, 3.6))
    ax = fig.subplots()
    for name in dict.fromkeys(r["schedule"] for r in rows):
        mine = [r for r in rows if r["schedule"] == name]
        ax.plot([r["micro-batches"] for r in mine], [r["temp MiB"] for r in mine], "o-", label=name)
    ax.set_xscale("log", base=2)
    ticks = sorted({r["micro-batches"] for r in rows})
    ax.set_xticks(ticks, [str(m) for m in ticks])
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("temporaries, MiB per device")
    ax.set_title(f"Pipeline memory vs micro-batches, pp = {PP}")
    ax.legend(fontsize=8)
    return fig


def run(quick: bool = False) -> Result:
    micro_batches = (PP, 4 * PP) if quick else (PP, 2 * PP, 4 * PP, 8 * PP)
    rows = [row for mode, vpp in SCHEDULES for row in rows_for(mode, vpp, micro_batches)]
    notes = f"""
pp={PP} on {PP} simulated CPU devices; {LAYERS} layers `x + gelu(x W_up) W_down` (hidden
{HIDDEN}, up {4 * HIDDEN}, fp32), micro_batch_size {MICRO_BATCH_SIZE}; temp bytes per device from
`compiled.memory_analysis()`. In flight: the most micro-batch chunks a stage holds `jax.vjp`
residuals for (a VPP chunk is half a stage). Idle: the schedule's bubble with a backward costing
twice a forward. FThenB keeps every micro-batch's residuals, so its memory grows linearly in m.
1F1B keeps at most min(m, 2 pp - 1) = {2 * PP - 1} micro-batches in flight (Paddle's MPMD 1F1B
keeps pp: in lockstep SPMD a hop between stages costs a whole tick), and its buffer of residuals
is a ring of that many slots whatever m is, so its memory is the same for every m. VPP keeps at
most 2 (pp - 1) + (V - 1)(pp + m % pp) + 1 chunks and has the smallest bubble.
"""
    title = "Pipeline schedules: compiled temp memory vs micro-batches"
    return Result(title, rows, notes, _figure(rows), cpu_devices())


if __name__ == "__main__":
    from _report import main

    main("pipeline_memory", run)
