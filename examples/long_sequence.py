"""The example GPT at 32k-token sequences on 8 compile-only H100s: with the batch split over
the devices (ZeRO-1 over `sharding`, one sequence a device) it does not fit; with each sequence
split over them by context parallelism (`cp_degree`: a ring, its scores a tile of queries at a
time), alone or with segment parallelism (`sep_degree`: all-to-all around attention), it does.
`fleetjax.explain` shows each (nothing runs: the steps are compiled for H100s that are not
there, from shapes alone). Segment parallelism alone does not fit either: after its all-to-all
each device attends whole sequences for heads / sep heads, and attention over a whole sequence
keeps its bf16 probabilities (32 heads x 32k x 32k x 2 bytes: 64 GiB a sequence).

    python examples/long_sequence.py

Needs jax's CUDA plugin (`pip install -e '.[aot]'` in this clone) for the compile-only H100s.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import optax
from flax import nnx
from gpt import GPT, GPTConfig, GPTFunctions

import fleetjax
from fleetjax import targets
from fleetjax.plan import mesh_for, read_plan

CONFIG = GPTConfig(
    vocab_size=32768,
    max_position_embeddings=32768,
    hidden_size=4096,
    num_attention_heads=32,  # of 128, as LLaMA-7B's
    num_hidden_layers=4,
    intermediate_size=16384,
)
ROWS = 8  # sequences of 32k tokens per step
LAYOUTS = {
    "batch over sharding": {"sharding_degree": 8},
    "sequence over cp": {"sharding_degree": 8, "cp_degree": 8},
    "sequence over sep": {"sep_degree": 8},
    "sequence over sep and cp": {"sharding_degree": 4, "cp_degree": 4, "sep_degree": 2},
}


def explain(hybrid_configs: dict[str, int], show: bool = True) -> fleetjax.Explanation:
    """`fleetjax.explain` of the GPT's train step (bf16 AMP O2, ZeRO-1 where `sharding` > 1,
    the blocks recomputed) on 8 compile-only H100s laid out by `hybrid_configs`."""
    strategy = fleetjax.DistributedStrategy(amp=True, recompute=True, hybrid_configs=hybrid_configs)
    strategy.amp_configs = {"dtype": "bfloat16", "use_pure_fp16": True, "use_fp16_guard": False}
    strategy.recompute_configs = {"policy": "nothing_saveable"}
    mesh = mesh_for(read_plan(strategy), targets.devices("h100", 8))
    model = nnx.eval_shape(lambda: GPT(CONFIG, rngs=nnx.Rngs(0)))
    functions, params = GPTFunctions(model), nnx.to_pure_dict(nnx.state(model))
    step = fleetjax.make_train_step(
        functions.pipeline_layer(),
        optax.adamw(1e-4),
        strategy,
        mesh,
        param_specs=functions.pipeline_params(functions.partition_specs(mesh=mesh)),
    )
    step.abstract_init(functions.pipeline_params(params))
    tokens = jax.ShapeDtypeStruct((ROWS, CONFIG.max_position_embeddings + 1), "int32")
    return fleetjax.explain(step, {"tokens": tokens}, show=show)


if __name__ == "__main__":
    for name, hybrid in LAYOUTS.items():
        print(f"== {name}: {hybrid}")
        explain(hybrid)
