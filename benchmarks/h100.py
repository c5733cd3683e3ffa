"""Compiled for H100: GPT 1.3B to 175B on 8 to 1024 H100s that are not there (deviceless).

For each GPT-3-shaped model (sequence 2048, bf16 compute with fp32 master weights, Adam) and
GPU count, `fleetjax.auto.search` lays the model out over compile-only H100s
(`fleetjax.targets`, 8 per host) and `fleetjax.explain` reads the chosen step's per-device HBM,
collectives and estimated step time; Megatron-LM's published 175B layouts (tensor 8 x pipeline 8
or 16) are compiled beside it. Then the CPU benchmarks' ZeRO staircase and pipeline schedules
are compiled again for H100s and compared with the CPU compiles. Nothing runs: every figure is
XLA:GPU's plan or the cost model's estimate, unverified on a real GPU.

    python benchmarks/h100.py [--quick] [--out DIR]     # pip install -e '.[aot]'
"""

from __future__ import annotations

import math
import pathlib
import sys
import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import _mlp  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import pipeline_memory  # noqa: E402
import zero_staircase  # noqa: E402
from _report import MiB, Result, bench_devices  # noqa: E402
from flax import nnx  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import fleetjax  # noqa: E402
from fleetjax import auto, targets  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
from gpt import GPT, GPTConfig, GPTFunctions  # noqa: E402

GiB = 2**30
SEQ, VOCAB = 2048, 51200
# name: (layers, hidden, heads, global batch in sequences): GPT-3's shapes and batch sizes
# (Brown et al. 2020, table 2.1; 16 heads of 128 for the 1.3B model).
MODELS = {
    "1.3B": (24, 2048, 16, 512),
    "6.7B": (32, 4096, 32, 1024),
    "13B": (40, 5120, 40, 1024),
    "175B": (96, 12288, 96, 1536),
}
GPUS = (8, 64, 512, 1024)
# Tensor parallelism fixed within a host for the models Megatron-LM splits 8 ways (the search
# over mp would compile each model a few more times on this 2-core machine).
FIXED_MP = {"13B": 8, "175B": 8}
# Megatron-LM's tensor x pipeline split for each model: Narayanan et al. 2021, table 1, the
# row of the same hidden size or the nearest (1.7B: 1 x 1; 7.5B: 4 x 1; 18B: 8 x 1; 145B and
# the 175B runs: 8 x 8), laid out on every GPU count that holds one copy and splits the batch.
MEGATRON_SPLIT = {"1.3B": (1, 1), "6.7B": (4, 1), "13B": (8, 1), "175B": (8, 8)}
# (model, GPUs, tensor, pipeline, chunks per stage): Megatron-LM's other published 175B
# layouts (tp 8 x pp 16, the interleaved schedule) and Megatron-Core's GPT-3 175B on H100.
MEGATRON_CORE = ("175B", 512, 4, 8, 1)
PUBLISHED = (
    ("175B", 1024, 8, 8, 1),
    ("175B", 1024, 8, 16, 1),
    ("175B", 1024, 8, 8, 2),
    MEGATRON_CORE,
)
Cell = tuple[str, int, int, int, int]  # (model, GPUs, tensor, pipeline, chunks per stage)
# Where auto searches in a full run: each model on the GPU count of its Megatron-LM run's
# scale (a search compiles tens of candidates; every cell would take hours on 2 cores).
AUTO_CELLS = (("1.3B", 8), ("6.7B", 64), ("13B", 512), ("175B", 512), ("175B", 1024))
PEAK = targets.get("h100").spec.peak_bf16_flops


def gpt(name: str) -> tuple[GPTFunctions, Any, dict[str, jax.ShapeDtypeStruct]]:
    """The example GPT at `name`'s size: its functions, abstract parameters and batch."""
    layers, hidden, heads, sequences = MODELS[name]
    config = GPTConfig(VOCAB, SEQ, hidden, heads, layers, 4 * hidden)
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    batch = {"tokens": jax.ShapeDtypeStruct((sequences, SEQ + 1), jnp.int32)}
    return GPTFunctions(model), nnx.to_pure_dict(nnx.state(model)), batch


def formula_of(name: str, gpus: int, tp: int, pp: int, vpp: int = 1) -> targets.Megatron:
    """Megatron-LM's formulas for `name` laid out tp x pp x the rest as data replicas."""
    layers, hidden, heads, sequences = MODELS[name]
    dp = gpus // (tp * pp)
    return targets.Megatron(layers, hidden, heads, SEQ, VOCAB, sequences, tp, pp, dp, vpp)


def bf16() -> fleetjax.DistributedStrategy:
    """bf16 compute with fp32 master weights, the whole model in bf16 (AMP O2, Paddle's
    `use_pure_bf16`; Megatron-LM's --bf16): what every candidate keeps."""
    s = fleetjax.DistributedStrategy(amp=True)
    s.amp_configs = {"dtype": "bfloat16", "use_pure_bf16": True}
    return s


def collectives_text(report: fleetjax.Explanation) -> str:
    """The largest collectives, e.g. "all-gather/sharding x194 412 GiB"."""
    by_axis: dict[tuple[str, str], list[float]] = {}
    for c in report.collectives:
        totals = by_axis.setdefault((c.op, "+".join(c.axes) or "-"), [0, 0.0])
        totals[0] += c.count
        totals[1] += c.bytes
    largest = sorted(by_axis.items(), key=lambda item: -item[1][1])[:4]
    return ", ".join(f"{op}/{axes} x{n} {size / GiB:.3g} GiB" for (op, axes), (n, size) in largest)


def explained_row(
    gpus: int,
    step: fleetjax.TrainStep,
    params: Any,
    batch: Any,
    formula: targets.Megatron,
    compare: bool = True,
) -> dict:
    """What explain says of `step` compiled for `gpus` H100s, beside `formula`'s bytes (where
    `compare`: the layout is Megatron's kind) and the estimated MFU of `formula`'s model
    flops: the cost model's (no overlap; with the asynchronous collectives overlapped) and the
    plain model's (the compiled matmuls over the peak and collectives' ring bytes, no memory
    term: the model of the formula's own)."""
    state = step.abstract_init(params)
    start = time.perf_counter()
    against = formula if compare else None
    report = fleetjax.explain(step, batch, state, show=False, formula=against)
    gpu, t = report.gpu, report.gpu.time
    plain = t.compute + t.links + t.network + t.latency
    expected = sum(formula.hbm().values())
    flops = formula.model_flops
    row = {
        "HBM GiB": gpu.peak_bytes / GiB,
        "fits": gpu.verdict,
        "HBM / formula": gpu.peak_bytes / expected if compare else None,
        "temp GiB": report.temp / GiB,
        "collectives (largest)": collectives_text(report),
    }
    for traffic in report.traffic:
        if traffic.formula:
            row[f"{'+'.join(traffic.axes)} GiB (x formula)"] = (
                f"{traffic.bytes / GiB:,.1f} ({traffic.ratio:.2f})"
            )
    return row | {
        "est. step s": t.total,
        "est. step s, overlapped": t.overlapped,
        "est. MFU": flops / (t.total * gpus * PEAK),
        "est. MFU, overlapped": flops / (t.overlapped * gpus * PEAK),
        "plain-model MFU": flops / (plain * gpus * PEAK),
        "compile s": time.perf_counter() - start,
    }


def auto_row(name: str, gpus: int) -> dict[str, Any]:
    """The layout `auto.search` picks for `name` on `gpus` H100s, explained. For the models
    Megatron-LM splits 8 ways (mp fixed at 8) pipelines are among the candidates (the model
    is a `PipelineLayer`); the smaller ones train unpipelined (a search over pipelines too
    would compile most of them on this 2-core machine, where data parallelism wins anyway)."""
    fns, params, batch = gpt(name)
    strategy = bf16()
    pipelines = name in FIXED_MP and gpus >= 8
    if pipelines:
        strategy.hybrid_configs = {"mp_degree": FIXED_MP[name]}
    specs = fns.partition_specs(mesh=targets.mesh("h100", gpus, mp=8))
    loss, cut = (fns.pipeline_layer(), fns.pipeline_params) if pipelines else (fns.loss_fn, _same)
    start = time.perf_counter()
    try:
        found = auto.search(
            loss,
            optax.adam(1e-4),
            cut(params),
            batch,
            strategy=strategy,
            param_specs=cut(specs),
            devices=targets.devices("h100", gpus),
        )
    except ValueError as e:  # nothing fits: the smallest candidate says by how much
        reason = str(e).splitlines()[0].split(": ", 1)[1].split(". Raise")[0]
        return {"model": name, "GPUs": gpus, "by": "auto", "layout": f"nothing fits: {reason}"}
    seconds = time.perf_counter() - start
    chosen = found.chosen
    row = {"model": name, "GPUs": gpus, "by": "auto", "layout": str(chosen.layout)}
    layout = chosen.layout
    formula = formula_of(name, gpus, layout.mp, layout.pp, layout.vpp)
    # Megatron's formulas hold for a pipeline of one sequence per micro-batch under ZeRO-1/2.
    like = layout.pp > 1 and layout.stage < 3 and layout.micro_batches == formula.micro_batches
    step = found.make_train_step()
    row |= explained_row(gpus, step, cut(params), batch, formula, like)
    compiled = sum(c.device_bytes is not None for c in found.candidates)
    return row | {
        "compiled / considered": f"{compiled} / {len(found.candidates)}",
        "search s": seconds,
    }


def _same(tree: Any) -> Any:
    return tree


def megatron_layouts(quick: bool) -> list[Cell]:
    """(model, GPUs, tensor, pipeline, chunks per stage) of the Megatron rows: the published
    175B layouts; in a full run also each model's split on every GPU count it fits."""
    if quick:
        return list(PUBLISHED)
    grid = [
        (name, gpus, tp, pp, 1)
        for name, (tp, pp) in MEGATRON_SPLIT.items()
        for gpus in GPUS
        if gpus % (tp * pp) == 0 and MODELS[name][3] % (gpus // (tp * pp)) == 0
    ]
    return grid + [layout for layout in PUBLISHED if layout not in grid]


def megatron_row(name: str, gpus: int, tp: int, pp: int, vpp: int = 1) -> dict[str, Any]:
    """Megatron-LM's layout: tensor `tp` x pipeline `pp` (1F1B, or interleaved over `vpp`
    chunks per stage), data parallel over the rest with the optimizer state split over it
    (its distributed optimizer = ZeRO-1), micro-batches of one sequence (in-step gradient
    merge without a pipeline), full recompute."""
    fns, params, batch = gpt(name)
    formula = formula_of(name, gpus, tp, pp, vpp)
    dp = formula.dp
    layout = auto.Layout(
        dp=1,
        sharding=dp,
        stage=1 if dp > 1 else 0,
        mp=tp,
        pp=pp,
        recompute=True,
        micro_batches=formula.micro_batches,
        vpp=vpp,
    )
    strategy = layout.strategy(bf16(), MODELS[name][3])
    mesh = targets.mesh("h100", gpus, sharding=dp, pp=pp, mp=tp)
    specs = fns.partition_specs(mesh=mesh)
    loss = fns.loss_fn
    if pp > 1:
        loss = layout.loss(fns.pipeline_layer())
        params, specs = fns.pipeline_params(params), fns.pipeline_params(specs)
    step = fleetjax.make_train_step(loss, optax.adam(1e-4), strategy, mesh, param_specs=specs)
    parts = [f"dp={dp}" + (" (ZeRO-1)" if dp > 1 else ""), f"mp={tp}"]
    parts += [f"pp={pp} VPP (V={vpp})" if vpp > 1 else f"pp={pp} 1F1B"] if pp > 1 else []
    parts += [f"{formula.micro_batches} micro-batches", "recompute"]
    cell = (name, gpus, tp, pp, vpp)
    by = "Megatron-Core" if cell == MEGATRON_CORE else "Megatron-LM"
    row = {
        "model": name,
        "GPUs": gpus,
        "by": by,
        "layout": " ".join(parts),
        "formula HBM GiB": sum(formula.hbm().values()) / GiB,
        "formula MFU": formula.mfu(targets.get("h100").spec),
    }
    return row | explained_row(gpus, step, params, batch, formula)


def zero_rows() -> list[dict[str, Any]]:
    """The ZeRO staircase's MLP at each stage over 8 devices: CPU compile vs H100 compile."""
    params, batch = zero_staircase.inputs()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    p = sum(x.nbytes for x in params.values())
    batch_bytes = sum(x.nbytes for x in batch.values()) // 8
    rows = []
    for stage in zero_staircase.STAGES:
        found = {}
        for where, mesh in (
            ("CPU", fleetjax.build_mesh(dp=1, sharding=8, devices=bench_devices(8))),
            ("H100", targets.mesh("h100", 8, dp=1, sharding=8)),
        ):
            strategy = zero_staircase.strategy(stage, 8, False)
            step = fleetjax.make_train_step(_mlp.loss_fn, optax.adam(1e-3), strategy, mesh)
            step.abstract_init(abstract[0])
            found[where] = fleetjax.explain(step, abstract[1], show=False)
        rows.append(
            {
                "stage": stage,
                "formula MiB": zero_staircase.formula(stage, p, 8) / MiB,
                **{f"{w} state MiB": (r.arguments - batch_bytes) / MiB for w, r in found.items()},
                **{f"{w} temp MiB": r.temp / MiB for w, r in found.items()},
                **{f"{w} collectives": _ops(r) for w, r in found.items()},
            }
        )
    return rows


def _ops(report: fleetjax.Explanation) -> str:
    counts: dict[str, int] = {}
    for c in report.collectives:
        counts[c.op] = counts.get(c.op, 0) + c.count
    return ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))


def pipeline_rows(quick: bool) -> list[dict[str, Any]]:
    """The pipeline benchmark's temp bytes per device: CPU compile vs H100 compile."""
    pp = pipeline_memory.PP
    micro_batches = (pp, 4 * pp) if quick else (pp, 2 * pp, 4 * pp, 8 * pp)
    h100s = targets.devices("h100", pp)
    rows = []
    for mode, vpp in pipeline_memory.SCHEDULES:
        for m in micro_batches:
            cpu = pipeline_memory.temp_bytes(mode, vpp, m) / MiB
            gpu = pipeline_memory.temp_bytes(mode, vpp, m, h100s) / MiB
            name = mode if vpp == 1 else f"{mode} (V={vpp})"
            rows.append(
                {
                    "schedule": name,
                    "micro-batches": m,
                    "CPU temp MiB": cpu,
                    "H100 temp MiB": gpu,
                    "H100 / CPU": gpu / cpu,
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """`rows` as a markdown table."""
    columns = list(dict.fromkeys(c for row in rows for c in row))

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _splits(hands: dict[Cell, dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The compiled rows of `name`'s Megatron-LM split (`MEGATRON_SPLIT`), in GPU order (as
    `megatron_layouts` lists them)."""
    split = (*MEGATRON_SPLIT[name], 1)  # tensor, pipeline, chunks per stage
    return [r for c, r in hands.items() if c[0] == name and c[2:] == split and "HBM GiB" in r]


def _figure(rows: list[dict[str, Any]], hands: dict[Cell, dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(10, 3.8))
    memory, mfu = fig.subplots(1, 2)
    for color, name in zip(("C0", "C1", "C2", "C3"), MODELS, strict=True):
        searched = [r for r in rows if r["model"] == name and r["by"] == "auto" and "HBM GiB" in r]
        for by, style, mine in (
            ("auto", "o", searched),
            ("Megatron-LM", "x--", _splits(hands, name)),
        ):
            if mine:
                gpus = [r["GPUs"] for r in mine]
                label = f"GPT {name}, {by}"
                memory.plot(gpus, [r["HBM GiB"] for r in mine], style, color=color, label=label)
                mfu.plot(gpus, [100 * r["est. MFU"] for r in mine], style, color=color, label=label)
    memory.axhline(targets.get("h100").spec.hbm_bytes / GiB, color="k", ls="--", lw=1)
    memory.set_yscale("log")
    memory.set_ylabel("per-device HBM, GiB (peak estimate)")
    memory.set_title("Per-device HBM (H100: 79.1 GiB)")
    mfu.axhline(47, color="g", ls=":", lw=1, label="Megatron-LM, H100 (47%)")
    mfu.axhline(50, color="m", ls=":", lw=1, label="MaxText (~50%)")
    mfu.set_ylabel("estimated MFU, %")
    mfu.set_title("Estimated MFU (cost model, no overlap)")
    for ax in (memory, mfu):
        ax.set_xscale("log", base=2)
        ax.set_xticks(GPUS, [str(g) for g in GPUS])
        ax.set_xlabel("H100s")
        ax.legend(fontsize=7)
    return fig


def run(quick: bool = False) -> Result:
    title = "Compiled for H100 (deviceless): GPT 1.3B to 175B on 8 to 1024 GPUs"
    if not targets.plugin_installed():
        missing = "Not run: jax's CUDA plugin is missing (`pip install -e '.[aot]'`)."
        return Result(title, [], missing)
    cases = [("1.3B", 8), ("175B", 1024)] if quick else AUTO_CELLS
    start = time.perf_counter()
    rows = [auto_row(name, gpus) for name, gpus in cases]
    hands = {cell: megatron_row(*cell) for cell in megatron_layouts(quick)}
    rows += hands.values()
    zero, pipe = zero_rows(), pipeline_rows(quick)
    notes = NOTES.format(
        seconds=time.perf_counter() - start,
        zero=markdown(zero),
        pipeline=markdown(pipe),
        **_figures(rows, hands, zero, pipe),
    )
    return Result(title, rows, notes, _figure(rows, hands))


def _slowest(rows: list[dict]) -> str:
    searched = [r for r in rows if "search s" in r]
    r = max(searched, key=lambda r: r["search s"], default=None)
    if r is None:
        return "-"
    return (
        f"GPT {r['model']} on {r['GPUs']} H100s compiled {r['compiled / considered']} "
        f"candidates in {r['search s']:.0f} s"
    )


def _figures(
    rows: list[dict], hands: dict[Cell, dict], zero: list[dict], pipe: list[dict]
) -> dict[str, str]:
    """The numbers the notes quote."""
    fitted = [r for r in rows if "est. MFU" in r and r["by"] == "auto"]
    big = next((r for r in fitted if (r["model"], r["GPUs"]) == ("175B", 1024)), {})
    megatron = [r for cell, r in hands.items() if cell in PUBLISHED and "HBM GiB" in r]
    compiled = [r for r in hands.values() if "HBM GiB" in r]
    same_gpus = [r for r in megatron if r["GPUs"] == big.get("GPUs")]
    ratios = [
        float(v.split("(")[1][:-1]) for r in compiled for k, v in r.items() if "x formula" in k
    ]
    cells = [
        f"{r['model']} on {r['GPUs']}: {r['est. step s']:.2f} s vs {m['est. step s']:.2f} s"
        for r in fitted
        for m in _splits(hands, r["model"])
        if m["GPUs"] == r["GPUs"]
    ]
    hand = min(same_gpus, key=lambda r: r["est. step s"], default={})
    ratio = [r["H100 / CPU"] for r in pipe]
    return {
        "best_mfu": f"{100 * max((r['est. MFU'] for r in fitted), default=0):.1f}",
        "big_hbm": f"{big.get('HBM GiB', math.nan):.1f}",
        "big_layout": big.get("layout", "-"),
        "big_search": f"{big.get('search s', math.nan):.0f}",
        "big_step": f"{big.get('est. step s', math.nan):.2f}",
        "hand_layout": hand.get("layout", "-"),
        "hand_step": f"{hand.get('est. step s', math.nan):.2f}",
        "megatron_hbm": ", ".join(f"{r['HBM GiB']:.0f}" for r in megatron) or "-",
        "megatron_ratio": ", ".join(f"{r['HBM / formula']:.2f}" for r in megatron) or "-",
        "megatron_plain": ", ".join(f"{100 * r['plain-model MFU']:.0f}%" for r in megatron),
        "formula_mfu": ", ".join(f"{100 * r['formula MFU']:.0f}%" for r in megatron),
        "slowest": _slowest(rows),
        "hands": str(len(compiled)),
        "hand_hbm_low": f"{min((r['HBM / formula'] for r in compiled), default=math.nan):.2f}",
        "hand_hbm_high": f"{max((r['HBM / formula'] for r in compiled), default=math.nan):.2f}",
        "axis_low": f"{min(ratios, default=math.nan):.2f}",
        "axis_high": f"{max(ratios, default=math.nan):.2f}",
        "auto_vs_hand": "; ".join(cells) or "-",
        "zero_temp": ", ".join(f"{r['H100 temp MiB'] / r['CPU temp MiB']:.2f}" for r in zero),
        "pipe_low": f"{min(ratio):.2f}",
        "pipe_high": f"{max(ratio):.2f}",
    }


NOTES = """
**Deviceless, unverified on a real GPU.** Every figure here is what XLA:GPU (jaxlib's CUDA
plugin, no GPU attached) planned for compile-only H100s (`fleetjax.targets`, 8 per host), or
fleetjax's roofline estimate of it; no GPU was lent to this project, so none is measured. A
real run adds the CUDA context, NCCL's buffers and allocator fragmentation to the HBM, and its
speed depends on kernels that XLA autotunes on a GPU (here it cannot).

GPT-3's shapes (Brown et al. 2020: 1.3B 24 x 2048, 6.7B 32 x 4096, 13B 40 x 5120, 175B
96 x 12288, heads of 128) with the example GPT (`examples/gpt.py`: scanned blocks, Megatron
layers), vocabulary 51200, sequence 2048, GPT-3's batch sizes (512, 1024, 1024 and 1536
sequences); the whole model in bf16 with fp32 master weights (AMP O2, Paddle's
`use_pure_bf16`, Megatron-LM's `--bf16`), Adam. A layout "by auto" is what
`fleetjax.auto.search(..., devices=targets.devices("h100", N))` chose from its candidates
(dp, ZeRO stage and degree, mp up to a host's 8, pp with 1F1B and VPP, recompute, in-step
micro-batches, offload), the 13B and 175B with mp fixed at 8 as Megatron-LM splits them. "HBM
GiB" is the step's arguments + outputs - aliased + temporaries per device (`explain`'s peak
estimate) against the H100's 79.1 GiB; "HBM / formula" the same over Megatron's formula for
the layout (`fleetjax.targets.Megatron.hbm`: fp32 weights and gradients, Adam over the data
replicas, bf16 weights, the first stage's kept layer inputs, a layer's recompute working set,
the logits), and "mp / pp / sharding GiB (x formula)" each axis's payload per step against
`Megatron.axis_bytes`. "est. step s" is the cost model's step time: max(matmul flops /
989.4 TFLOP/s, HBM bytes / 3.35 TB/s) plus every collective's ring bytes over NVLink
(450 GB/s) within a host and InfiniBand (50 GB/s per GPU) across hosts, with no overlap; "...,
overlapped" takes off what the asynchronous collectives can hide behind the computation XLA
scheduled between each start and done. "est. MFU" is PaLM's model flops (6 N + 12 L h s per
token) over that time and the bf16 peak; "plain-model MFU" uses the compiled matmuls and
collectives without the memory term, the model of Megatron's formula ("formula MFU": model
flops x 4/3 for recompute, stretched by the bubble (pp - 1) / (m V), plus each axis's ring
bytes). The best estimate here is {best_mfu}% (Megatron-LM reports up to 47% MFU on H100 for
GPT models of 2B to 462B; MaxText about 50%).

**Megatron's splits on every GPU count.** Each model also runs Megatron-LM's tensor x
pipeline split for its size (Narayanan et al. 2021, table 1, the nearest row: 1.3B 1 x 1,
6.7B 4 x 1, 13B 8 x 1, 175B 8 x 8) on every GPU count that holds a copy and splits the batch,
data parallel over the rest with ZeRO-1 (Megatron's distributed optimizer), micro-batches of
one sequence (in-step gradient merge where there is no pipeline) and full recompute: the
dashed lines of the plot. Their {hands} compiles come to {hand_hbm_low} to {hand_hbm_high} x
the formula's HBM, each axis's payload {axis_low} to {axis_high} x its formula. Auto against
the split on the same GPUs (est. step, no overlap): {auto_vs_hand}.

Megatron's published layouts for 175B ({megatron_hbm} GiB per device; {megatron_ratio} x its
formula) compile with every axis's payload within 1.25x of the formula and a plain-model MFU
of {megatron_plain} (the formula's own: {formula_mfu}). The pipeline keeps each in-flight
micro-batch's layer inputs only (full recompute), split over mp (each mp device keeps its part
of the sequence; the backward gathers it), casts the stage's weights to bf16 once per step,
adds each layer's weight gradients into the stage's fp32 accumulator as they are made,
reduce-scatters the accumulated gradients over the data replicas once after its loop and
gathers the updated weights once (ZeRO-1), and sends an activation and a cotangent only in
the ticks that run forwards and backwards. Lockstep SPMD ticks keep up to 2 pp - 1
micro-batches in flight on the first stage (Megatron's asynchronous 1F1B keeps pp); splitting
the kept inputs over mp more than makes up for it. The whole 175B search on 1024 H100s chose
{big_layout} ({big_hbm} GiB per device, est. {big_step} s) in {big_search} s; Megatron-LM's
fastest hand layout here ({hand_layout}) is est. {hand_step} s under the same cost model.
Where many layouts fit, the lower bound prunes little and the search compiles most of them
(the slowest: {slowest}).

**ZeRO staircase, CPU vs H100 compiles** (the CPU benchmark's MLP, 8 devices):

{zero}

The state bytes agree (they follow from the placement, whatever the backend). The
temporaries need not (H100 / CPU by stage: {zero_temp}): each backend fuses and assigns
buffers its own way, XLA:GPU makes every collective asynchronous (a -start keeps its buffers
live until its -done), and at stage 3, where XLA chooses the collectives, the two backends
choose differently (the columns of collectives). Which of these makes each difference was
not isolated.

**Pipeline memory, CPU vs H100 compiles** (the CPU benchmark's pp=4 model):

{pipeline}

The curves agree in shape (FThenB grows with m, 1F1B stays flat, VPP levels off: the
schedules keep the same residual slots on both backends), not in size: XLA:GPU's temporaries
are {pipe_low} to {pipe_high} times the CPU's, for the same reasons as above (asynchronous
permutes keep their send and receive buffers live across a tick; fusion and buffer assignment
differ); not isolated further.

This run compiled for {seconds:.0f} s on this project's 2-core machine.
"""


if __name__ == "__main__":
    from _report import main

    main("h100", run)
