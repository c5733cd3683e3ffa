"""Bytes each device sends per step, read from the compiled HLO: dense vs fp16 all-reduce vs DGC.

Compiles one fleetjax step of the same MLP (Paddle's Momentum, data parallel over 8 devices:
the accelerators where there are 8, else simulated CPU devices)
three ways: the dense fp32 gradient all-reduce, `fp16_allreduce=True`, and `dgc=True` at
sparsity 0.999 (DGC's default `rampup_begin_step=0`: the sparse exchange is the only path
compiled). Every collective in `compiled.as_text()` is counted once per step (the model has
no loops) with what a ring algorithm has each device send, for a group of N devices and an
array of S bytes:

    all-reduce 2 (N - 1) / N x S        all-gather (N - 1) / N x S (its result)
    reduce-scatter (N - 1) x S (its result, 1/N of the input)
    all-to-all (N - 1) / N x S          collective-permute S

Arrays are split into DGC-eligible gradients (float32, >= 16384 elements: Paddle's
`_is_use_dgc`), recognised by their element count (a weight's, or DGC's N x 2k gathered
(index, value) pairs), and the rest (small gradients, the loss).

    python benchmarks/comm_bytes.py
"""

from __future__ import annotations

import math
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import Result, bench_devices  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import fleetjax  # noqa: E402
from fleetjax import hlo  # noqa: E402
from fleetjax import optimizers as fo  # noqa: E402

N, ROWS, SPARSITY = 8, 64, 0.999
# Two DGC-eligible weights; the output weight and the biases are sent dense by every mode.
SHAPES = {
    "w_in": (128, 512),
    "b_in": (512,),
    "w_hidden": (512, 512),
    "b_hidden": (512,),
    "w_out": (512, 10),
    "b_out": (10,),
}
MODES = ("dense all-reduce", "fp16_allreduce", "DGC")


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = jnp.tanh(batch["x"] @ params["w_in"] + params["b_in"])
    h = jnp.tanh(h @ params["w_hidden"] + params["b_hidden"])
    return jnp.mean((h @ params["w_out"] + params["b_out"] - batch["y"]) ** 2)


def inputs() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.RandomState(0)
    params = {k: (rng.randn(*s) * 0.05).astype(np.float32) for k, s in SHAPES.items()}
    batch = {
        "x": rng.randn(ROWS, SHAPES["w_in"][0]).astype(np.float32),
        "y": rng.randn(ROWS, SHAPES["w_out"][1]).astype(np.float32),
    }
    return params, batch


def strategy(mode: str) -> fleetjax.DistributedStrategy:
    if mode == "fp16_allreduce":
        return fleetjax.DistributedStrategy(fp16_allreduce=True)
    if mode == "DGC":
        return fleetjax.DistributedStrategy(dgc=True, dgc_configs={"sparsity": [SPARSITY]})
    return fleetjax.DistributedStrategy()


def ring_bytes(op: str, group: int, size: int) -> float:
    """Bytes one device sends for a collective of `size` result bytes over `group` devices,
    on a ring."""
    if group == 1:
        return 0.0
    return {
        "all-reduce": 2 * (group - 1) / group * size,
        "all-gather": (group - 1) / group * size,
        "reduce-scatter": (group - 1) * size,
        "all-to-all": (group - 1) / group * size,
        "collective-permute": float(size),
    }[op]


def eligible_sizes(params: dict[str, np.ndarray]) -> set[int]:
    """Element counts of the arrays that carry DGC-eligible gradients: the gradient itself
    (dense modes) or the N x 2k packed (index, value) pairs DGC gathers."""
    sizes = set()
    for p in params.values():
        if fo.is_eligible(p):
            sizes |= {p.size, N * 2 * fo.top_k_count(p.size, SPARSITY)}
    return sizes


def measure(mode: str, devices: list[jax.Device]) -> dict[str, Any]:
    params, batch = inputs()
    mesh = fleetjax.build_mesh(dp=N, devices=devices)
    step = fleetjax.make_train_step(loss_fn, fo.momentum(0.1, 0.9), strategy(mode), mesh)
    text = step.lower(step.init(params), batch).compile().as_text()
    eligible = eligible_sizes(params)
    sent = {"eligible": 0.0, "rest": 0.0}
    ops = set()
    for c in hlo.collectives(text):
        if c.group_size is None:
            raise RuntimeError(f"no replica group size in the HLO for {c}")
        ops.add(c.op)
        for dtype, dims in c.arrays:
            size = math.prod(dims)
            part = "eligible" if size in eligible else "rest"
            sent[part] += ring_bytes(c.op, c.group_size, size * hlo.itemsize(dtype))
    dtypes = sorted(
        {d for c in hlo.collectives(text) for d, dims in c.arrays if math.prod(dims) in eligible}
    )
    return {
        "mode": mode,
        "collectives": ", ".join(sorted(ops)),
        "eligible dtype": ", ".join(dtypes),
        "eligible KiB sent": sent["eligible"] / 1024,
        "rest KiB sent": sent["rest"] / 1024,
        "total KiB sent": (sent["eligible"] + sent["rest"]) / 1024,
    }


def _figure(rows: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(6.5, 3.4))
    ax = fig.subplots()
    x = np.arange(len(rows))
    ax.bar(x - 0.2, [r["eligible KiB sent"] for r in rows], 0.4, label="DGC-eligible gradients")
    ax.bar(x + 0.2, [r["rest KiB sent"] for r in rows], 0.4, label="the rest")
    ax.set_yscale("log")
    ax.set_xticks(x, [r["mode"] for r in rows])
    ax.set_ylabel("KiB each device sends per step")
    ax.set_title(f"Communicated bytes per step (ring), N = {N}")
    ax.legend(fontsize=8)
    return fig


def run(quick: bool = False) -> Result:
    del quick  # three compilations
    devices = bench_devices(N)
    rows = [measure(mode, devices) for mode in MODES]
    dense = rows[0]
    for row in rows:
        row["eligible vs dense"] = row["eligible KiB sent"] / dense["eligible KiB sent"]
        row["total vs dense"] = row["total KiB sent"] / dense["total KiB sent"]
    params, _ = inputs()
    eligible = {k: p.size for k, p in params.items() if fo.is_eligible(p)}
    dgc = rows[-1]["eligible vs dense"]
    notes = f"""
A 3-layer tanh MLP ({", ".join(f"{k} {list(s)}" for k, s in SHAPES.items())}), Paddle's
Momentum, data parallel over N = {N} devices. Bytes are what each device sends on a ring
(all-reduce 2(N-1)/N x S, all-gather (N-1)/N x S of its result, reduce-scatter (N-1) x its
result), read from the compiled HLO, one step. DGC-eligible (float32, >= 16384 elements):
{", ".join(f"{k} ({n} elements)" for k, n in eligible.items())}. fp16 all-reduce halves them;
DGC at sparsity {SPARSITY} all-gathers each replica's k = int(numel x (1 - sparsity)) (index,
value) pairs instead, N x 2k numbers per tensor: N k / numel = {dgc:.4f} of the dense bytes
(<= 1/100 as long as N x (1 - sparsity) <= 1/100). The rest (the output layer, biases, the
loss) is all-reduced densely in fp32 by the dense and DGC modes and in fp16 by fp16_allreduce
(the loss stays fp32).
"""
    title = "Communicated bytes per step: dense vs fp16 all-reduce vs DGC"
    return Result(title, rows, notes, _figure(rows), devices)


if __name__ == "__main__":
    from _report import main

    main("comm_bytes", run)
