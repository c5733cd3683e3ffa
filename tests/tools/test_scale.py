"""Hybrid parallelism at the scale it exists for, compiled for H100s that are not there.

Megatron-LM's GPT-3 175B layouts (tensor x pipeline x the distributed optimizer over the data
replicas, micro-batches of one sequence, full recompute, bf16) compile under the H100's memory
with each device's HBM and each mesh axis's payload at Megatron's formulas
(`fleetjax.targets.Megatron`, within 1.25x); a GPT of a few layers on 64 GPUs guards the same
formulas in the default suite. The layouts are examples/megatron_layout.py's (docs/scale.md's
recipe). Nothing runs: every figure is XLA:GPU's plan.
"""

import pathlib
import sys

import optax
import pytest
from flax import nnx

import fleetjax
from fleetjax import targets

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
from gpt import GPT, GPTConfig, GPTFunctions
from megatron_layout import main, megatron_formula, megatron_step, parse_args

pytestmark = pytest.mark.skipif(
    not targets.plugin_installed(),
    reason="jax's CUDA plugin is not installed: pip install -e '.[aot]'",
)

H100 = targets.get("h100").spec
ROOT = next(p for p in pathlib.Path(__file__).parents if (p / "pyproject.toml").exists())


def assert_at_formula(
    formula: targets.Megatron, report: fleetjax.Explanation | None = None
) -> fleetjax.Explanation:
    """The layout compiles under the H100's memory, its HBM within 1.25x of the formula's and
    each axis's payload within [0.8, 1.25]x of it; every collective asynchronous (`report`:
    the layout's, when already explained)."""
    if report is None:
        step, state, batch = megatron_step(formula)
        report = fleetjax.explain(step, batch, state, show=False, formula=formula)
    expected = sum(formula.hbm().values())
    assert report.gpu.peak_bytes <= H100.hbm_bytes, report.gpu.verdict
    assert report.gpu.peak_bytes <= 1.25 * expected, (report.gpu.peak_bytes, formula.hbm())
    ratios = {"+".join(t.axes): t.ratio for t in report.traffic if t.formula}
    assert set(ratios) == {"mp", "pp", "sharding"}, ratios
    assert all(0.8 <= r <= 1.25 for r in ratios.values()), ratios
    assert all(c.asynchronous for c in report.collectives)
    return report


def test_a_few_layers_on_64_h100s_at_the_formulas():
    """A GPT of 8 layers (hidden 2048) on 64 H100s, tp 8 x pp 2 x ZeRO-1 over 4, 16
    micro-batches: HBM and every axis at formula, and the pipeline's own overhead at formula:
    an activation on and a cotangent back only in the ticks that run forwards and backwards
    (at most m + pp - 1 of each), a bf16 send each; the kept layer inputs split over mp and gathered
    once per layer in the backward; the stage's weights cast to bf16 outside the loops."""
    formula = targets.Megatron(8, 2048, 16, 2048, 8192, 64, tp=8, pp=2, dp=4)
    report = assert_at_formula(formula)
    m, pp, layers = formula.micro_batches, formula.pp, formula.layers // formula.pp
    by_kind = {(c.op, c.dtype, c.axes): c for c in report.collectives}
    permutes = by_kind["collective-permute", "bf16", ("pp",)]
    assert 2 * m <= permutes.count <= 2 * (m + pp - 1)
    assert permutes.bytes == permutes.count * formula.sequence * formula.hidden * 2
    gathered = by_kind["all-gather", "bf16", ("mp",)]
    assert gathered.bytes == (m + pp - 1) * layers * formula.sequence * formula.hidden * 2
    # The cost model's two bounds: XLA schedules some collectives beside computation.
    t = report.gpu.time
    assert max(t.compute, t.memory) < t.overlapped < t.total
    # Gradients: one reduce-scatter per parameter, updated weights gathered once (fp32).
    assert by_kind["reduce-scatter", "f32", ("sharding",)].count <= 20
    assert by_kind["all-gather", "f32", ("sharding",)].count <= 20


@pytest.mark.slow
@pytest.mark.parametrize(
    "gpus, tp, pp, vpp",
    [
        (1024, 8, 8, 1),  # Narayanan et al. 2021
        (1024, 8, 16, 1),
        (512, 4, 8, 1),  # Megatron-Core's GPT-3 175B on H100
        (1024, 8, 8, 2),  # interleaved, 2 chunks per stage
    ],
)
def test_megatron_175b_layouts_fit_at_the_formulas(gpus, tp, pp, vpp, capsys):
    dp = gpus // (tp * pp)
    formula = targets.Megatron(96, 12288, 96, 2048, 51200, 1536, tp=tp, pp=pp, dp=dp, vpp=vpp)
    default = parse_args([])
    if formula == megatron_formula(default):  # the script's default: the page shows its output
        report = assert_at_formula(formula, main(default))
        assert capsys.readouterr().out in (ROOT / "docs" / "scale.md").read_text()
    else:
        report = assert_at_formula(formula)
    # A plain no-overlap model of the compiled step (its matmuls over the peak, its
    # collectives over NVLink and InfiniBand) gives at least 40% MFU; the formula's 45-50%.
    t = report.gpu.time
    seconds = t.compute + t.links + t.network + t.latency
    assert formula.model_flops / (seconds * gpus * H100.peak_bf16_flops) >= 0.40
    assert 0.44 <= formula.mfu(H100) <= 0.60


@pytest.mark.slow
def test_auto_ranks_175b_pipelines_no_slower_than_megatrons_layout():
    """`auto.search` given GPT-3 175B's layouts on 1024 H100s (mp fixed at 8, as Megatron-LM
    splits it; one sequence per micro-batch, recompute): ZeRO-3 over 128 without a pipeline
    (what it picks for the unpipelined loss), pp 8 and pp 16 in 1F1B, pp 8 in VPP. It compiles
    each and picks a pipeline whose estimated step is no slower than Megatron-LM's tp 8 x pp 8
    x ZeRO-1 16 under the same cost model. The search over every layout of the 1024 devices
    (42 of 529 candidates compiled, about 20 minutes on 2 cores, too long for CI) is
    benchmarks/h100.py's 175B auto row (benchmarks/RESULTS.md), and picks the same layout."""
    formula = targets.Megatron(96, 12288, 96, 2048, 51200, 1536, tp=8, pp=8, dp=16)
    step, state, batch = megatron_step(formula)
    megatron = fleetjax.explain(step, batch, state, show=False).gpu.time.total
    config = GPTConfig(51200, 2048, 12288, 96, 96, 4 * 12288)
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    fns, params = GPTFunctions(model), nnx.to_pure_dict(nnx.state(model))
    strategy = fleetjax.DistributedStrategy(amp=True)
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_bf16": True}
    strategy.hybrid_configs = {"mp_degree": 8}
    specs = fns.partition_specs(mesh=targets.mesh("h100", 1024, mp=8))
    one_sequence = {"mp": 8, "recompute": True}
    found = fleetjax.auto.search(
        fns.pipeline_layer(),
        optax.adam(1e-4),
        fns.pipeline_params(params),
        batch,
        strategy=strategy,
        param_specs=fns.pipeline_params(specs),
        devices=targets.devices("h100", 1024),
        candidates=[
            {"sharding": 128, "stage": 3, **one_sequence},
            {"pp": 8, "micro_batches": 96, **one_sequence},
            {"pp": 16, "micro_batches": 192, **one_sequence},
            {"pp": 8, "vpp": 2, "micro_batches": 96, **one_sequence},
        ],
    )
    assert all(c.device_bytes is not None for c in found.candidates), found
    assert found.chosen.layout.pp > 1
    assert found.chosen.time_s <= megatron * 1.01, (str(found.chosen.layout), megatron)
