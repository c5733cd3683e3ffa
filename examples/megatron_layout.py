"""A layout's numbers before booking a cluster: the example GPT laid out as Megatron-LM lays it
out (tensor `tp` x pipeline `pp` x the distributed optimizer, ZeRO-1, over `dp` replicas;
micro-batches of one sequence, full recompute, bf16 with fp32 master weights), compiled for
compile-only GPUs (nothing runs) and explained beside Megatron's formulas
(`fleetjax.targets.Megatron`): per-device HBM against the GPU's memory, every collective with
its mesh axis, each axis's payload beside the formula's, and the estimated step time.

    python examples/megatron_layout.py                # GPT-3 175B: tp 8 x pp 8 x dp 16, 1024 H100s
    python examples/megatron_layout.py --tp 8 --pp 16 --dp 8
    python examples/megatron_layout.py --tp 4 --pp 8 --dp 16  # Megatron-Core's, 512 H100s
    python examples/megatron_layout.py --pp 8 --vpp 2   # interleaved, 2 chunks per stage
    python examples/megatron_layout.py --layers 8 --hidden 2048 --heads 16 --vocab 8192 \\
        --global-batch 64 --tp 8 --pp 2 --dp 4            # a small GPT on 64 H100s

Needs jax's CUDA plugin (`pip install -e '.[aot]'` in this clone). GPT-3 175B on 1024 GPUs
compiles in a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from gpt import GPT, GPTConfig, GPTFunctions

import fleetjax
from fleetjax import targets

# GPT-3 175B (Brown et al. 2020) as Narayanan et al. 2021 train it: --flag: default.
GPT3_175B = {
    "layers": 96,
    "hidden": 12288,
    "heads": 96,
    "sequence": 2048,
    "vocab": 51200,
    "global_batch": 1536,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("the GPT (default GPT-3 175B)")
    for name, default in GPT3_175B.items():
        model.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    layout = parser.add_argument_group("the layout (default Megatron-LM's, on 1024 GPUs)")
    layout.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (mp)")
    layout.add_argument("--pp", type=int, default=8, help="pipeline stages")
    layout.add_argument("--dp", type=int, default=16, help="data replicas, ZeRO-1 over them")
    layout.add_argument("--vpp", type=int, default=1, help="model chunks per stage (VPP)")
    layout.add_argument("--gpu", default="h100", choices=sorted(targets.TARGETS))
    return parser.parse_args(argv)


def megatron_step(formula: targets.Megatron, gpu: str = "h100") -> tuple[Any, Any, Any]:
    """The example GPT at `formula`'s shapes, laid out as `formula` says on compile-only
    `gpu`s: (the step, its abstract state, an abstract batch)."""
    f = formula
    config = GPTConfig(f.vocab, f.sequence, f.hidden, f.heads, f.layers, 4 * f.hidden)
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))  # shapes only
    fns, params = GPTFunctions(model), nnx.to_pure_dict(nnx.state(model))
    s = fleetjax.DistributedStrategy(amp=True, sharding=True, pipeline=True, recompute=True)
    s.amp_configs = {"dtype": "bfloat16", "use_pure_bf16": True}  # Megatron's --bf16
    s.hybrid_configs = {"sharding_degree": f.dp, "mp_degree": f.tp, "pp_degree": f.pp}
    s.sharding_configs = {"sharding_degree": f.dp, "stage": 1}  # the distributed optimizer
    s.pipeline_configs = {
        "accumulate_steps": f.micro_batches,
        "micro_batch_size": f.micro_batch,
        "schedule_mode": "VPP" if f.vpp > 1 else "1F1B",
    }
    s.recompute_configs = {"policy": "nothing_saveable"}
    mesh = targets.mesh(gpu, f.gpus, sharding=f.dp, pp=f.pp, mp=f.tp)
    loss = fns.pipeline_layer(f.vpp)
    specs = fns.pipeline_params(fns.partition_specs(mesh=mesh))
    step = fleetjax.make_train_step(loss, optax.adam(1e-4), s, mesh, param_specs=specs)
    state = step.abstract_init(fns.pipeline_params(params))
    batch = {"tokens": jax.ShapeDtypeStruct((f.global_batch, f.sequence + 1), jnp.int32)}
    return step, state, batch


def megatron_formula(args: argparse.Namespace) -> targets.Megatron:
    """The model and layout the command line describes."""
    model = {name: getattr(args, name) for name in GPT3_175B}
    return targets.Megatron(**model, tp=args.tp, pp=args.pp, dp=args.dp, vpp=args.vpp)


def main(args: argparse.Namespace) -> fleetjax.Explanation:
    formula = megatron_formula(args)
    print(
        f"GPT {formula.parameters / 1e9:.1f}B on {formula.gpus} {args.gpu} GPUs: tp {args.tp} "
        f"x pp {args.pp}"
        + (f" (VPP, {args.vpp} chunks)" if args.vpp > 1 else " (1F1B)")
        + f" x ZeRO-1 over dp {args.dp}, {formula.micro_batches} micro-batches of one sequence"
    )
    step, state, batch = megatron_step(formula, args.gpu)
    return fleetjax.explain(step, batch, state, formula=formula)


if __name__ == "__main__":
    main(parse_args())
