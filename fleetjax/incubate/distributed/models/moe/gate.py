"""Paddle's ``paddle.incubate.distributed.models.moe.gate``: the gates (`fleetjax.layers.moe`)."""

from fleetjax.layers.moe import BaseGate, GShardGate, NaiveGate, SwitchGate

__all__ = ["BaseGate", "GShardGate", "NaiveGate", "SwitchGate"]
