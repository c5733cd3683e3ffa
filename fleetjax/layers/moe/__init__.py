"""Mixture of experts: Paddle's ``MoELayer`` and gates, Megatron-Core's, MaxText's and
DeepSeek-V3's routers, and the dispatch of tokens over the expert mesh axes.

One concept per module:

* `routing`: what a gate decides (`Routing`), the gates' base (`BaseGate`), capacity;
* `gates`: Paddle's `NaiveGate`, `GShardGate`, `SwitchGate`;
* `router`: `TopKRouter` (softmax or sigmoid, top-k, group-limited, aux-loss-free bias);
* `losses`: the auxiliary losses, MaxVio, `MoEStats` and how they reach the loss (`moe_aux`);
* `experts`: stacking the experts, `ExpertMLP`, grouped matmul or tile loop;
* `dispatch`: dropless and capacity all-to-all, allgather, `all_to_all_bytes`;
* `layer`: `MoELayer`.

docs/moe.md has the formulas, the buffer, and Paddle's names beside Megatron's and MaxText's.
"""

from fleetjax.layers.moe.dispatch import (
    DISPATCHERS,
    DROP_POLICIES,
    Dispatch,
    all_to_all_bytes,
)
from fleetjax.layers.moe.experts import ExpertMLP, stack_experts
from fleetjax.layers.moe.gates import GShardGate, NaiveGate, SwitchGate
from fleetjax.layers.moe.layer import GATES, MoELayer
from fleetjax.layers.moe.losses import (
    MoEAux,
    MoEStats,
    load_balancing_loss,
    max_violation,
    moe_aux,
    sequence_load_balancing_loss,
    z_loss,
)
from fleetjax.layers.moe.router import SCORE_FUNCTIONS, ExpertBias, TopKRouter
from fleetjax.layers.moe.routing import BaseGate, Routing

__all__ = [
    "BaseGate",
    "Dispatch",
    "ExpertBias",
    "ExpertMLP",
    "GShardGate",
    "MoEAux",
    "MoELayer",
    "MoEStats",
    "NaiveGate",
    "Routing",
    "SwitchGate",
    "TopKRouter",
    "all_to_all_bytes",
    "load_balancing_loss",
    "max_violation",
    "moe_aux",
    "sequence_load_balancing_loss",
    "stack_experts",
    "z_loss",
    "DISPATCHERS",
    "DROP_POLICIES",
    "GATES",
    "SCORE_FUNCTIONS",
]
