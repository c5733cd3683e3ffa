"""Per-device memory of recompute and gradient merge, from what XLA compiled.

Compiles (does not run) fleetjax train steps for a 16-layer scanned MLP on 8 simulated CPU
devices (or the real devices, when an accelerator is present) and reads
`compiled.memory_analysis()`: temporaries (activations kept for the backward pass, gradient
buffers) and arguments (parameters, optimizer state, batch).

    python benchmarks/memory_transforms.py [--quick]
"""

from __future__ import annotations

from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import MiB, Result  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import fleetjax  # noqa: E402

LAYERS, WIDTH, ROWS = 16, 128, 4096


Params = dict[str, Any]
Batch = dict[str, jax.Array]


def block(w: Params, x: jax.Array) -> jax.Array:
    hidden = fleetjax.checkpoint_name(jnp.tanh(x @ w["a"]), "hidden")
    return jnp.tanh(hidden @ w["b"]) + x


def loss_fn(params: Params, batch: Batch) -> jax.Array:
    def body(x: jax.Array, w: Params) -> tuple[jax.Array, None]:
        return fleetjax.recompute(block)(w, x), None

    x, _ = jax.lax.scan(body, batch["x"], params["layers"])
    return jnp.mean((x - batch["y"]) ** 2)


def inputs() -> tuple[Params, dict[str, np.ndarray]]:
    rng = np.random.RandomState(0)
    layer = lambda: rng.randn(LAYERS, WIDTH, WIDTH).astype(np.float32) / 12  # noqa: E731
    params = {"layers": {"a": layer(), "b": layer()}}
    batch = {
        "x": rng.randn(ROWS, WIDTH).astype(np.float32),
        "y": rng.randn(ROWS, WIDTH).astype(np.float32),
    }
    return params, batch


def memory(strategy: fleetjax.DistributedStrategy) -> Any:
    params, batch = inputs()
    step = fleetjax.make_train_step(loss_fn, optax.adam(1e-3), strategy)
    return step.lower(step.init(params), batch).compile().memory_analysis()


RECOMPUTE = (
    ("off", None),
    ("checkpoints=['hidden']", {"checkpoints": ["hidden"]}),
    ("checkpoints=['hidden'] + offload", {"checkpoints": ["hidden"], "enable_offload": True}),
    ("policy=dots_saveable", {"policy": "dots_saveable"}),
    ("policy=nothing_saveable", {"policy": "nothing_saveable"}),
)
QUICK_RECOMPUTE = (RECOMPUTE[0], RECOMPUTE[1], RECOMPUTE[4])


def row(
    feature: str, setting: str, strategy: fleetjax.DistributedStrategy, off: dict | None
) -> dict[str, Any]:
    """One setting's memory; `off` is the row to compare temporaries with (None: this one)."""
    m = memory(strategy)
    temp = m.temp_size_in_bytes / MiB
    return {
        "feature": feature,
        "setting": setting,
        "temp MiB": temp,
        "temp vs off": temp / off["temp MiB"] if off else 1.0,
        "argument MiB": m.argument_size_in_bytes / MiB,
        "host temp MiB": m.host_temp_size_in_bytes / MiB,
    }


def recompute_rows(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for label, configs in QUICK_RECOMPUTE if quick else RECOMPUTE:
        s = fleetjax.DistributedStrategy()
        if configs:
            s.recompute, s.recompute_configs = True, configs
        rows.append(row("recompute", label, s, rows[0] if rows else None))
    return rows


def gradient_merge_rows(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for k in (1, 4) if quick else (1, 2, 4, 8):
        s = fleetjax.DistributedStrategy(gradient_merge=k > 1)
        s.gradient_merge_configs = {"k_steps": k, "mode": "in_step"}
        off = rows[0] if rows else None
        rows.append(row("gradient merge (in one call)", f"k_steps={k}", s, off))
    s = fleetjax.DistributedStrategy(gradient_merge=True)
    s.gradient_merge_configs = {"k_steps": 4}
    rows.append(row("gradient merge (across calls)", "k_steps=4", s, rows[0]))
    return rows


def _figure(rows: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(7, 3.8))
    ax = fig.subplots()
    labels = [f"{r['feature']}: {r['setting']}" for r in rows]
    colors = ["tab:blue" if r["feature"] == "recompute" else "tab:orange" for r in rows]
    ax.barh(np.arange(len(rows)), [r["temp MiB"] for r in rows], color=colors)
    ax.set_yticks(np.arange(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("temporaries, MiB per device")
    ax.set_title("Recompute and gradient merge: compiled temp memory")
    return fig


def run(quick: bool = False) -> Result:
    rows = recompute_rows(quick) + gradient_merge_rows(quick)
    notes = f"""
A {LAYERS}-layer scanned MLP (width {WIDTH}, global batch {ROWS} rows, Adam), per device, from
`compiled.memory_analysis()` (compiled, not run). Recompute keeps only what its policy saves of
each layer and recomputes the rest in the backward pass. In-step gradient merge scans over k
micro-batches, so activations are those of one micro-batch; across-call merge keeps a gradient
accumulator in the optimizer state (arguments grow by one copy of the parameters) and leaves
temporaries as they are. On CPU, pinned host memory is the same memory as the device's, so
offload shows no host figures here.
"""
    return Result(
        "Recompute and gradient merge: compiled per-device memory", rows, notes, _figure(rows)
    )


if __name__ == "__main__":
    from _report import main

    main("memory_transforms", run)
