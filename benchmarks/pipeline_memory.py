"""Per-device temp memory of the pipeline vs the number of micro-batches, per schedule.

Compiles (does not run) `fleetjax.transforms.pipeline.pipeline` for 8 residual MLP layers on
pp=4 simulated CPU devices, for FThenB, 1F1B and VPP (vpp_degree=2), at m = pp, 2 pp, 4 pp and
8 pp micro-batches, and reads the per-device temp bytes from `compiled.memory_analysis()`. Also
lists each schedule's table: the most chunk forwards a stage holds residuals for, and the idle
fraction. Writes benchmarks/results/pipeline_memory.json and .md.

    python benchmarks/pipeline_memory.py
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import jax.numpy as jnp  # noqa: E402
from _report import write  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from fleetjax.mesh import build_mesh  # noqa: E402
from fleetjax.transforms.pipeline import PipelineParams, pipeline, pipeline_schedule  # noqa: E402

PP, LAYERS, HIDDEN, MICRO_BATCH_SIZE = 4, 8, 128, 128
SCHEDULES = (("FThenB", 1), ("1F1B", 1), ("VPP", 2))
MiB = 2**20


def embed(p, batch):
    return batch["x"] @ p["w"]


def stage(p, x):
    return x + jax.nn.gelu(x @ p["up"]) @ p["down"]


def head_loss(p, x, batch):
    return jnp.mean((x @ p["w"] - batch["y"]) ** 2)


def temp_bytes(mode: str, vpp: int, micro_batches: int) -> int:
    mesh = build_mesh(dp=1, pp=PP, devices=jax.devices("cpu")[:PP])

    def spec(shape, *axes):
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


def main() -> None:
    rows = []
    for mode, vpp in SCHEDULES:
        name = mode if vpp == 1 else f"{mode} (V={vpp})"
        base = None
        for m in (PP, 2 * PP, 4 * PP, 8 * PP):
            temp = temp_bytes(mode, vpp, m)
            base = base or temp
            table = pipeline_schedule(mode, PP, m, vpp)
            rows.append(
                {
                    "schedule": name,
                    "micro-batches": m,
                    "temp MiB": temp / MiB,
                    "temp vs m=pp": temp / base,
                    "in flight (chunks)": int(table.in_flight.max()),
                    "idle": table.idle_fraction(),
                }
            )
            print(rows[-1], flush=True)
    notes = f"""
pp={PP} on {PP} simulated CPU devices; {LAYERS} layers `x + gelu(x W_up) W_down` (hidden
{HIDDEN}, up {4 * HIDDEN}, fp32), micro_batch_size {MICRO_BATCH_SIZE}; temp bytes per device
from `compiled.memory_analysis()`. In flight: the most micro-batch chunks a stage holds `jax.vjp`
residuals for (a VPP chunk is half a stage). Idle: the schedule's bubble with a backward costing
twice a forward. FThenB keeps every micro-batch's residuals, so its memory grows linearly in m.
1F1B keeps at most min(m, 2 pp - 1) = 7 micro-batches in flight (Paddle's MPMD 1F1B keeps pp:
in lockstep SPMD a hop between stages costs a whole tick), so its memory stops growing from
m = 2 pp - 1 on; between m = pp and m = 2 pp it still grows, by pp - 1 residual slots. VPP keeps
at most 2 (pp - 1) + (V - 1)(pp + m % pp) + 1 chunks and has the smallest bubble.
"""
    print(
        write(
            "pipeline_memory",
            "Pipeline schedules: compiled temp memory vs micro-batches",
            rows,
            notes,
        )
    )


if __name__ == "__main__":
    main()
