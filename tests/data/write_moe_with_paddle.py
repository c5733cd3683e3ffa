"""Writes paddle<version>_moe_gates.npz here: Paddle's MoE gates run on CPU.

    /work/paddle-venv/bin/python tests/data/write_moe_with_paddle.py tests/data

Paddle's gates call ``limit_by_capacity``, which has no CPU kernel. With one rank
(``world_size=1``) it is the identity: an expert's capacity, ``ceil(rate x T)``, is at least
the ``T`` assignments it can receive (a token's top-k experts are distinct). So it is replaced by
the identity here, and the gates' own code computes everything else. GShard's random routing
(``random_routing`` op, no CPU kernel) is off.
"""

import sys

import numpy as np
import paddle
from paddle.incubate.distributed.models.moe import GShardGate, NaiveGate, SwitchGate
from paddle.incubate.distributed.models.moe.gate import gshard_gate, switch_gate


def identity(topk_idx, *args, **kwargs):
    return None, None, topk_idx


gshard_gate.limit_by_capacity = identity
switch_gate.limit_by_capacity = identity

out = sys.argv[1]
paddle.seed(0)
rng = np.random.default_rng(0)
TOKENS, D_MODEL, EXPERTS = 16, 8, 8
x = rng.normal(size=(TOKENS, D_MODEL)).astype(np.float32)
weight = rng.normal(size=(D_MODEL, EXPERTS)).astype(np.float32)
bias = rng.normal(size=EXPERTS).astype(np.float32) / 4
found = {"x": x, "weight": weight, "bias": bias}
for name, gate in (
    ("naive", NaiveGate(D_MODEL, EXPERTS, 1, topk=2)),
    ("gshard", GShardGate(D_MODEL, EXPERTS, 1, topk=2, random_routing=False)),
    ("switch", SwitchGate(D_MODEL, EXPERTS, 1, topk=1)),
):
    gate.gate.weight.set_value(weight)
    gate.gate.bias.set_value(bias)
    for mode in ("train", "eval"):
        if name == "switch" and mode == "train":
            continue  # its jitter is Paddle's random draw
        getattr(gate, mode)()
        values, experts = gate(paddle.to_tensor(x))
        loss = gate.get_loss()
        found[f"{name}_{mode}_values"] = values.numpy()
        found[f"{name}_{mode}_experts"] = experts.numpy()
        if loss is not None:
            found[f"{name}_{mode}_loss"] = np.float32(loss.numpy())
np.savez(f"{out}/paddle{paddle.__version__}_moe_gates.npz", **found)
