"""Paddle's ``paddle.incubate.distributed.models.moe``: ``MoELayer``, its gates and the MoE
gradient clip, at Paddle's module path (the layers are `fleetjax.layers.moe`'s).

    from fleetjax.incubate.distributed.models.moe import MoELayer   # was: from paddle.incubate...
"""

from fleetjax.incubate.distributed.models.moe import gate
from fleetjax.incubate.distributed.models.moe.gate import (
    BaseGate,
    GShardGate,
    NaiveGate,
    SwitchGate,
)
from fleetjax.incubate.distributed.models.moe.grad_clip import ClipGradForMOEByGlobalNorm
from fleetjax.layers.moe import MoELayer

# Paddle exports the MoE clip under the plain name too.
ClipGradByGlobalNorm = ClipGradForMOEByGlobalNorm

__all__ = [
    "BaseGate",
    "ClipGradByGlobalNorm",
    "ClipGradForMOEByGlobalNorm",
    "GShardGate",
    "MoELayer",
    "NaiveGate",
    "SwitchGate",
    "gate",
]
