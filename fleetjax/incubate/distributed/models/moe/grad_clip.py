"""Paddle's ``ClipGradForMOEByGlobalNorm``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fleetjax.optimizers import ClipGradByGlobalNorm

__all__ = ["ClipGradForMOEByGlobalNorm"]


class ClipGradForMOEByGlobalNorm(ClipGradByGlobalNorm):
    """Paddle's ``ClipGradForMOEByGlobalNorm(clip_norm, is_expert_param_func=None,
    moe_group=None, group_name="default_moe_group")``: every gradient scaled by ``clip_norm /
    max(global_norm, clip_norm)``, the global norm over all gradients, the experts' included.

    Paddle adds the experts' squared norms up over the ``moe_group``, because each of its ranks
    holds other experts. Here a gradient is a global array that holds every expert once, so this
    is `ClipGradByGlobalNorm` (``optax.clip_by_global_norm``), and ``is_expert_param_func`` and
    ``moe_group`` (which only pick the parameters to sum over the group) change nothing.
    """

    def __init__(
        self,
        clip_norm: float,
        is_expert_param_func: Callable[[Any], bool] | None = None,
        moe_group: Any = None,
        group_name: str = "default_moe_group",
    ) -> None:
        super().__init__(clip_norm, group_name)
        object.__setattr__(self, "is_expert_param_func", is_expert_param_func)
        object.__setattr__(self, "moe_group", moe_group)
