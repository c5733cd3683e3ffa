"""Per-device memory of recompute and gradient merge, from what XLA compiled.

Compiles (does not run) fleetjax train steps for a 16-layer scanned MLP on 8 simulated CPU
devices (or the real devices, when an accelerator is present) and reads
`compiled.memory_analysis()`: temporaries (activations kept for the backward pass, gradient
buffers) and arguments (parameters, optimizer state, batch). Writes
benchmarks/results/memory_transforms.json and .md.

    python benchmarks/memory_transforms.py
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import write  # noqa: E402

import fleetjax  # noqa: E402

LAYERS, WIDTH, ROWS = 16, 128, 4096
MiB = 2**20


def block(w, x):
    hidden = fleetjax.checkpoint_name(jnp.tanh(x @ w["a"]), "hidden")
    return jnp.tanh(hidden @ w["b"]) + x


def loss_fn(params, batch):
    def body(x, w):
        return fleetjax.recompute(block)(w, x), None

    x, _ = jax.lax.scan(body, batch["x"], params["layers"])
    return jnp.mean((x - batch["y"]) ** 2)


def inputs():
    rng = np.random.RandomState(0)
    layer = lambda: rng.randn(LAYERS, WIDTH, WIDTH).astype(np.float32) / 12  # noqa: E731
    params = {"layers": {"a": layer(), "b": layer()}}
    batch = {
        "x": rng.randn(ROWS, WIDTH).astype(np.float32),
        "y": rng.randn(ROWS, WIDTH).astype(np.float32),
    }
    return params, batch


def memory(strategy):
    params, batch = inputs()
    step = fleetjax.make_train_step(loss_fn, optax.adam(1e-3), strategy)
    return step.lower(step.init(params), batch).compile().memory_analysis()


def recompute_rows():
    cases = [
        ("off", None),
        ("checkpoints=['hidden']", {"checkpoints": ["hidden"]}),
        ("checkpoints=['hidden'] + offload", {"checkpoints": ["hidden"], "enable_offload": True}),
        ("policy=dots_saveable", {"policy": "dots_saveable"}),
        ("policy=nothing_saveable", {"policy": "nothing_saveable"}),
    ]
    rows, base = [], None
    for label, configs in cases:
        s = fleetjax.DistributedStrategy()
        if configs:
            s.recompute, s.recompute_configs = True, configs
        m = memory(s)
        base = base or m.temp_size_in_bytes
        rows.append(
            {
                "feature": "recompute",
                "setting": label,
                "temp MiB": m.temp_size_in_bytes / MiB,
                "temp vs off": m.temp_size_in_bytes / base,
                "argument MiB": m.argument_size_in_bytes / MiB,
                "host temp MiB": m.host_temp_size_in_bytes / MiB,
            }
        )
    return rows


def gradient_merge_rows():
    rows, base = [], None
    for k in (1, 2, 4, 8):
        s = fleetjax.DistributedStrategy(gradient_merge=k > 1)
        s.gradient_merge_configs = {"k_steps": k, "mode": "in_step"}
        m = memory(s)
        base = base or m.temp_size_in_bytes
        rows.append(
            {
                "feature": "gradient merge (in one call)",
                "setting": f"k_steps={k}",
                "temp MiB": m.temp_size_in_bytes / MiB,
                "temp vs off": m.temp_size_in_bytes / base,
                "argument MiB": m.argument_size_in_bytes / MiB,
                "host temp MiB": m.host_temp_size_in_bytes / MiB,
            }
        )
    s = fleetjax.DistributedStrategy(gradient_merge=True)
    s.gradient_merge_configs = {"k_steps": 4}
    m = memory(s)
    rows.append(
        {
            "feature": "gradient merge (across calls)",
            "setting": "k_steps=4",
            "temp MiB": m.temp_size_in_bytes / MiB,
            "temp vs off": m.temp_size_in_bytes / base,
            "argument MiB": m.argument_size_in_bytes / MiB,
            "host temp MiB": m.host_temp_size_in_bytes / MiB,
        }
    )
    return rows


def main():
    rows = recompute_rows() + gradient_merge_rows()
    path = write(
        "memory_transforms",
        "Recompute and gradient merge: compiled per-device memory",
        rows,
        notes=f"""
A {LAYERS}-layer scanned MLP (width {WIDTH}, global batch {ROWS} rows, Adam), per device.
Recompute keeps only what its policy saves of each layer and recomputes the rest in the backward
pass. In-step gradient merge scans over k micro-batches, so activations are those of one
micro-batch; across-call merge keeps a gradient accumulator in the optimizer state (arguments
grow by one copy of the parameters) and leaves temporaries as they are. On CPU, pinned host
memory is the same memory as the device's, so offload shows no host figures here.
""",
    )
    print(path.read_text())


if __name__ == "__main__":
    main()
