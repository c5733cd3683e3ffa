"""A MoE layer's training step against a dense FFN of the same active FLOPs, and the experts'
grouped matmul against a loop over experts.

Two shapes of one width ``H``, each with ``k x F`` active hidden units a token:

* few-large: 8 experts of ``F`` = 512, top-2 (Mixtral's proportions);
* fine-grained: 64 experts of ``F`` = 128, top-8 (DeepSeek's).

Each step is `jax.value_and_grad` of the sum of squares of the layer's output over its
parameters and input, jitted on 8 devices (the accelerators where there are 8, else simulated CPU
devices), the tokens split over the 8:

* dense FFN: `ExpertMLP(H, k F)` on every token, data parallel (the baseline);
* MoE, grouped matmul: `MoELayer` of `ExpertMLP` experts over ``ep`` = 8, a `TopKRouter`,
  dropless all-to-all, `jax.lax.ragged_dot`;
* MoE, loop over experts: the same with ``grouped_gemm=False`` (tiles of one expert's rows);
* MoE, ep = 1: the grouped layer with every expert on every device (no all-to-all).

The variants alternate step by step in one process; a time is the median over the rounds and
"vs dense" the median of each round's ratio. "matmul GFLOP" counts one device's step from the
compiled HLO (`fleetjax.cost.hlo_cost`: every trip of a loop of known length, the overflow
rounds' loop once); "all-to-all KiB" is what a device sends in the first round's all-to-alls
(dispatch and combine, forward and backward), which `all_to_all_bytes` gives.

    python benchmarks/moe.py [--quick]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _report import Result, bench_devices  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from fleetjax import cost, hlo  # noqa: E402
from fleetjax.layers import (  # noqa: E402
    ExpertMLP,
    MoEAux,
    MoELayer,
    TopKRouter,
    moe_aux,
    partition_specs,
)

N, WIDTH = 8, 256


class Shape(NamedTuple):
    name: str
    experts: int
    top_k: int
    hidden: int  # F, an expert's


SHAPES = (Shape("few-large", 8, 2, 512), Shape("fine-grained", 64, 8, 128))
VARIANTS = ("dense FFN", "MoE, grouped matmul", "MoE, loop over experts", "MoE, ep = 1")


def model(shape: Shape, variant: str) -> nnx.Module:
    rngs = nnx.Rngs(0)
    if variant == "dense FFN":
        return ExpertMLP(WIDTH, shape.top_k * shape.hidden, rngs=rngs)
    experts = [ExpertMLP(WIDTH, shape.hidden, rngs=rngs) for _ in range(shape.experts)]
    router = TopKRouter(WIDTH, shape.experts, shape.top_k, aux_loss_coeff=1e-2, rngs=rngs)
    return MoELayer(WIDTH, experts, router, grouped_gemm=variant != "MoE, loop over experts")


def mesh_for(variant: str, devices: list[jax.Device]) -> Mesh:
    axis = "ep" if variant in ("MoE, grouped matmul", "MoE, loop over experts") else "dp"
    return Mesh(np.array(devices), (axis,), axis_types=(AxisType.Auto,))


class Step(NamedTuple):
    run: Callable[[], Any]
    text: str
    flops: float


def step(shape: Shape, variant: str, tokens: int, devices: list[jax.Device]) -> Step:
    """One variant's compiled step, its HLO text and XLA's FLOP count for it."""
    layer = model(shape, variant)
    mesh = mesh_for(variant, devices)
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    rest = nnx.to_pure_dict(rest)

    def loss(params: Any, x: jax.Array) -> jax.Array:
        module = nnx.merge(graphdef, params, rest)
        out, captured = nnx.capture(module, MoEAux)(x)
        return jnp.sum(out**2) + moe_aux(captured)[0]

    x = jax.random.normal(jax.random.key(1), (tokens, WIDTH))
    with jax.set_mesh(mesh):
        specs = partition_specs(params, mesh=mesh)
        params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        x = jax.device_put(x, NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names)))
        # The input's gradient too, as for a layer inside a model.
        compiled = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(params, x).compile()
    text = compiled.as_text()
    flops = cost.hlo_cost(text, dict(cost.DEVICE_SPECS)["cpu"], N).matmul_flops
    return Step(lambda: jax.block_until_ready(compiled(params, x)), text, flops)


def all_to_all_kib(text: str) -> float:
    """KiB a device sends to the others in the step's first-round all-to-alls (those outside
    the overflow rounds' loops), the experts' counts left out."""
    parts, entry = hlo.computations(text)
    found = hlo.collectives("\n".join(parts[entry]))
    sent = [c.result_bytes * (c.group_size - 1) / c.group_size for c in found if _rows(c)]
    return sum(sent) / 1024


def _rows(collective: hlo.Collective) -> bool:
    return collective.op == "all-to-all" and collective.arrays[0][0] != "s32"


def measure(shape: Shape, tokens: int, rounds: int, devices: list[jax.Device]) -> list[dict]:
    steps = {variant: step(shape, variant, tokens, devices) for variant in VARIANTS}
    times: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
    for s in steps.values():
        s.run()  # warm up
    for _ in range(rounds):
        for variant, s in steps.items():
            start = time.perf_counter()
            s.run()
            times[variant].append(time.perf_counter() - start)
    dense = times["dense FFN"]
    return [
        {
            "shape": shape.name,
            "experts x F, top-k": f"{shape.experts} x {shape.hidden}, top-{shape.top_k}",
            "variant": variant,
            "step ms": 1e3 * statistics.median(times[variant]),
            "vs dense": statistics.median(
                t / d for t, d in zip(times[variant], dense, strict=True)
            ),
            "matmul GFLOP": steps[variant].flops / 1e9,
            "all-to-all KiB": all_to_all_kib(steps[variant].text),
        }
        for variant in VARIANTS
    ]


def _figure(rows: list[dict]) -> Figure:
    fig = Figure(figsize=(8, 3.2))
    ax = fig.subplots()
    width = 0.2
    for i, variant in enumerate(VARIANTS):
        mine = [r for r in rows if r["variant"] == variant]
        ratios = [r["vs dense"] for r in mine]
        ax.bar(np.arange(len(mine)) + i * width, ratios, width, label=variant)
    ax.set_xticks(np.arange(len(SHAPES)) + 1.5 * width, [s.name for s in SHAPES])
    ax.axhline(1, color="gray", linewidth=0.8)
    ax.set_ylabel("step time / dense FFN's")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title(f"MoE layer vs a dense FFN of the same active FLOPs (H = {WIDTH}, N = {N})")
    return fig


def run(quick: bool = False) -> Result:
    devices = bench_devices(N)
    tokens = N * (128 if quick else 256)
    rounds = 3 if quick else 10
    rows = [row for shape in SHAPES for row in measure(shape, tokens, rounds, devices)]
    title = "MoE layer vs a dense FFN of the same active FLOPs"
    return Result(title, rows, _notes(rows, tokens), _figure(rows), devices)


def _notes(rows: list[dict], tokens: int) -> str:
    at = {(r["shape"], r["variant"]): r for r in rows}

    def of(shape: str, variant: str, column: str = "vs dense") -> str:
        return f"{at[shape, variant][column]:.2f}"

    def flops(shape: str, variant: str) -> str:
        return of(shape, variant, "matmul GFLOP")

    grouped, loop = "MoE, grouped matmul", "MoE, loop over experts"
    faster = {
        shape.name: "faster" if at[shape.name, loop]["step ms"] < at[shape.name, grouped]["step ms"]
        else "slower"
        for shape in SHAPES
    }  # fmt: skip
    return f"""
{tokens} tokens of width {WIDTH} a step ({tokens // N} a device), forward and backward, on
{N} devices. The dense FFN runs the same `k x F` hidden units a token as the experts, so a MoE
layer's extra time is the routing (the router, its top-k and loss), sorting the assignments,
packing the all-to-all buffers, grouping the rows by expert and the experts' own work. The
grouped layer's step takes {of("few-large", grouped)}x the dense step's time with few-large
experts and {of("fine-grained", grouped)}x with fine-grained ones; the loop over experts
{of("few-large", loop)}x and {of("fine-grained", loop)}x.

Where the time goes: XLA:CPU has no grouped matmul. It compiles `jax.lax.ragged_dot` to one
matmul against every local expert's weights, masked, so the grouped layer computes every local
expert on every row it received: {flops("few-large", grouped)} matmul GFLOP a device with
few-large experts (1 a device) and {flops("fine-grained", grouped)} with fine-grained ones (8 a
device), against {flops("few-large", "dense FFN")} for the dense step, and with every expert on
every device (ep = 1) {flops("few-large", "MoE, ep = 1")} and
{flops("fine-grained", "MoE, ep = 1")}. The rows are the receive buffer's, 1.25 x the balanced
count, and the overflow rounds' loop, counted once, adds a buffer more. The loop over experts
runs each expert on its own rows, tile by tile ({flops("few-large", loop)} and
{flops("fine-grained", loop)} GFLOP), and is {faster["few-large"]} than the grouped matmul
with few-large experts and {faster["fine-grained"]} with fine-grained ones here. On GPUs XLA
runs `ragged_dot` as a grouped GEMM over the rows alone; the compile-only H100 targets are the
place to measure that. On simulated CPU devices an all-to-all is a memory copy; the KiB are
exactly 4 x `all_to_all_bytes` (the tests read the same from the HLO).
"""


if __name__ == "__main__":
    from _report import main

    main("moe", run)
