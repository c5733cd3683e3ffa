"""Throughput on a GPU: the example GPT's tokens/s and MFU, the example ResNet's images/s.

Runs only where JAX's default backend is a GPU (otherwise the section says so). Trains
`examples/gpt.py` sized for one 80 GB H100 (24 layers, hidden 1024, 16 heads, sequence 1024,
vocabulary 32768: about 370M parameters) under data parallel over all GPUs, AMP (bfloat16 O2)
with and without recompute, and, with several GPUs, ZeRO stages 2 and 3 and tensor parallel;
and `examples/resnet.py` (ResNet-56 on 32x32x3 images) in fp32 and under AMP.

MFU is computed as MaxText does: the model FLOPs of a training step over the devices' peak
dense bfloat16 FLOP/s (from `PEAK_BF16_FLOPS` by device kind), with per token

    6 x N + 6 x L x T x d

N the parameters used in matmuls (all but the token and position embedding tables, which are
lookups), L layers, T the sequence length, d the hidden size: the second term is attention's
q k^T and (softmax) v products, 12 L T d for forward and backward, halved for the causal mask.

    python benchmarks/gpu.py [--quick]
"""

from __future__ import annotations

import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import Result  # noqa: E402

import fleetjax  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
from gpt import GPTConfig, make_gpt  # noqa: E402

# Peak dense bfloat16 FLOP/s per device (vendor data sheets, SXM parts unless named); the first
# entry whose name is in `jax.Device.device_kind` applies.
PEAK_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
)
GPT = GPTConfig(
    vocab_size=32768,
    max_position_embeddings=1024,
    hidden_size=1024,
    num_attention_heads=16,
    num_hidden_layers=24,
    intermediate_size=4096,
)
SEQUENCES_PER_DEVICE = 8
RESNET_DEPTH, IMAGES_PER_DEVICE = 56, 256
AMP = {"amp": True, "amp_configs": {"use_pure_bf16": True}}
RECOMPUTE = {"recompute": True, "recompute_configs": {"policy": "nothing_saveable"}}


class Variant(NamedTuple):
    label: str
    strategy: fleetjax.DistributedStrategy
    mesh: Callable[[], jax.sharding.Mesh]


def variants(devices: int) -> list[Variant]:
    """What to measure on `devices` GPUs: data parallel in fp32 and AMP, AMP with recompute,
    and with several GPUs ZeRO-2, ZeRO-3 and tensor parallel over pairs (all with AMP)."""
    dp = lambda: fleetjax.build_mesh(dp=devices)  # noqa: E731
    found = [
        Variant(f"dp={devices}, fp32", fleetjax.DistributedStrategy(), dp),
        Variant(f"dp={devices}, AMP bf16 O2", fleetjax.DistributedStrategy(**AMP), dp),
        Variant(
            f"dp={devices}, AMP bf16 O2 + recompute",
            fleetjax.DistributedStrategy(**AMP, **RECOMPUTE),
            dp,
        ),
    ]
    if devices > 1:
        for stage in (2, 3):
            zero = {"sharding": True, "sharding_configs": {"stage": stage}}
            found.append(
                Variant(
                    f"ZeRO-{stage} sharding={devices}, AMP bf16 O2",
                    fleetjax.DistributedStrategy(**AMP, **zero),
                    lambda: fleetjax.build_mesh(dp=1, sharding=devices),
                )
            )
    if devices % 2 == 0:
        tp = {"tensor_parallel": True, "tensor_parallel_configs": {"tensor_parallel_degree": 2}}
        found.append(
            Variant(
                f"dp={devices // 2} x mp=2, AMP bf16 O2",
                fleetjax.DistributedStrategy(**AMP, **tp),
                lambda: fleetjax.build_mesh(dp=devices // 2, mp=2),
            )
        )
    return found


def peak_flops(device_kind: str) -> float | None:
    """The peak dense bfloat16 FLOP/s of one device of this kind, if the table knows it."""
    return next((peak for name, peak in PEAK_BF16_FLOPS if name in device_kind), None)


def gpt_flops_per_token(config: GPTConfig, params: Any) -> float:
    """MaxText-style training FLOPs per token (see the module docstring)."""
    total = sum(x.size for x in jax.tree.leaves(params))
    lookups = config.vocab_size + config.max_position_embeddings
    matmul = total - lookups * config.hidden_size
    length, layers = config.max_position_embeddings, config.num_hidden_layers
    return 6 * matmul + 6 * layers * length * config.hidden_size


def _timed(
    step: fleetjax.TrainStep, state: Any, batch: Any, steps: int
) -> tuple[float, Any, dict[str, Any]]:
    """Seconds per step over `steps` steps after two warm-up steps (compilation)."""
    batch = step.shard_batch(batch)
    for _ in range(2):
        state, metrics = step(state, batch)
    jax.block_until_ready(state)
    start = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    return (time.perf_counter() - start) / steps, state, metrics


def gpt_row(variant: Variant, config: GPTConfig, sequences: int, steps: int) -> dict[str, Any]:
    """Tokens/s and MFU of one variant, on `sequences` sequences per device."""
    model, params = make_gpt(config, seed=0)
    mesh = variant.mesh()
    step = fleetjax.make_train_step(
        model.loss_fn,
        optax.adamw(3e-4),
        variant.strategy,
        mesh,
        param_specs=model.partition_specs(mesh=mesh),
    )
    devices = mesh.devices.size
    rows = sequences * devices  # the same global batch for every variant
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, config.vocab_size, (rows, config.max_position_embeddings + 1))
    batch = {"tokens": tokens.astype(np.int32)}
    seconds, _, metrics = _timed(step, step.init(params), batch, steps)
    per_second = rows * config.max_position_embeddings / seconds
    peak = peak_flops(jax.devices()[0].device_kind)
    achieved = per_second * gpt_flops_per_token(config, params) / devices
    return {
        "model": "GPT",
        "variant": variant.label,
        "global batch": f"{rows} x {config.max_position_embeddings} tokens",
        "step ms": 1e3 * seconds,
        "tokens/s": per_second,
        "tokens/s/device": per_second / devices,
        "images/s": None,
        "TFLOP/s/device": achieved / 1e12,
        "MFU": None if peak is None else achieved / peak,
        "loss": float(metrics["loss"]),
    }


def resnet_row(variant: Variant, depth: int, images: int, steps: int) -> dict[str, Any]:
    """Images/s of the example ResNet on 32x32x3 images, `images` per data-parallel replica."""
    from resnet import make_resnet

    mesh = variant.mesh()
    replicas = fleetjax.mesh.data_parallel_size(mesh)
    model, params = make_resnet(depth, 10, in_channels=3, replicas=replicas)
    step = fleetjax.make_train_step(
        model.loss_fn,
        optax.sgd(0.1, momentum=0.9),
        variant.strategy,
        mesh,
        has_aux=True,
        has_state=True,
        state_specs=model.stats_specs(mesh=mesh),
    )
    rows = images * replicas
    rng = np.random.RandomState(0)
    batch = {
        "image": rng.randn(rows, 32, 32, 3).astype(np.float32),
        "label": rng.randint(0, 10, rows).astype(np.int32),
    }
    state = step.init(params, model_state=model.initial_stats())
    seconds, _, metrics = _timed(step, state, batch, steps)
    return {
        "model": f"ResNet-{depth}",
        "variant": variant.label,
        "global batch": f"{rows} images",
        "step ms": 1e3 * seconds,
        "tokens/s": None,
        "tokens/s/device": None,
        "images/s": rows / seconds,
        "TFLOP/s/device": None,
        "MFU": None,
        "loss": float(metrics["loss"]),
    }


def _resnet_available() -> bool:
    return (pathlib.Path(__file__).parents[1] / "examples" / "resnet.py").exists()


def run(quick: bool = False) -> Result:
    title = "GPU throughput: GPT tokens/s and MFU, ResNet images/s"
    device = jax.devices()[0]
    if device.platform != "gpu":
        return Result(
            title,
            [],
            f"""
No GPU in this run (JAX's default backend is {device.platform}), so nothing was measured.
On a machine with NVIDIA GPUs: `pip install -e ".[gpu]"` (CUDA 13; `.[gpu-cuda12]` for
CUDA 12), then `python benchmarks/run.py --only gpu` (or `python benchmarks/gpu.py`). It
trains the example GPT ({GPT.num_hidden_layers} layers, hidden {GPT.hidden_size}, sequence
{GPT.max_position_embeddings}, vocabulary {GPT.vocab_size}) in fp32, AMP bf16 O2 and AMP with
recompute over all GPUs, plus ZeRO-2, ZeRO-3 and tensor parallel with several GPUs, and
reports tokens/s and MaxText-style MFU (6 N + 6 L T d FLOPs per token over the peak dense
bf16 FLOP/s), and the example ResNet-{RESNET_DEPTH}'s images/s.
""",
        )
    steps = 5 if quick else 20
    todo = variants(len(jax.devices()))
    todo = todo[1:2] if quick else todo
    rows = [_or_error("GPT", gpt_row, v, GPT, SEQUENCES_PER_DEVICE, steps) for v in todo]
    if _resnet_available():
        resnet = f"ResNet-{RESNET_DEPTH}"
        for v in todo[:2]:
            rows.append(_or_error(resnet, resnet_row, v, RESNET_DEPTH, IMAGES_PER_DEVICE, steps))
    peak = peak_flops(device.device_kind)
    notes = f"""
{len(jax.devices())} x {device.device_kind}; {steps} timed steps after 2 warm-up steps, AdamW for
the GPT and SGD with momentum for the ResNet. The GPT ({GPT.num_hidden_layers} layers, hidden
{GPT.hidden_size}, {GPT.num_attention_heads} heads, sequence {GPT.max_position_embeddings},
vocabulary {GPT.vocab_size}) trains on {SEQUENCES_PER_DEVICE} sequences per device (the same
global batch in every variant); MFU is MaxText's: (6 N + 6 L T d) FLOPs per token, N the
parameters in matmuls (embedding tables excluded), over the peak dense bf16 FLOP/s
({"unknown for this device kind: no MFU" if peak is None else f"{peak / 1e12:.0f} TFLOP/s"}),
also for the fp32 rows. The ResNet-{RESNET_DEPTH} (CIFAR shape, 32x32x3 images) trains on
{IMAGES_PER_DEVICE} images per replica with per-replica batch statistics.
"""
    if not _resnet_available():
        notes += "\nexamples/resnet.py is not in this checkout: no ResNet rows."
    return Result(title, rows, notes)


def _or_error(
    model: str, measure: Callable[..., dict[str, Any]], variant: Variant, *args: Any
) -> dict[str, Any]:
    """`measure(variant, *args)`, or where XLA fails (out of memory) a row saying so, so the
    other variants still run."""
    try:
        return measure(variant, *args)
    except jax.errors.JaxRuntimeError as error:
        return {"model": model, "variant": variant.label, "error": str(error).splitlines()[0]}


if __name__ == "__main__":
    from _report import main

    main("gpu", run)
