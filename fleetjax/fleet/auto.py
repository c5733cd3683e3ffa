"""`paddle.distributed.fleet.auto`: the older auto-parallel `Strategy`.

fleetjax trains with the newer `fleetjax.Strategy` (`paddle.distributed.Strategy`); convert
with `fleetjax.Strategy()._from_legacy_strategy(strategy)`, as Paddle does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetjax import _schema
from fleetjax.strategy import _Whole

__all__ = ["Strategy"]


class Strategy(_Whole):
    """`paddle.distributed.fleet.auto.Strategy`: the sections of Paddle's auto-parallel Engine.

    Sections (Paddle's keys and defaults): `recompute`, `amp`, `sharding`, `gradient_merge`,
    `pipeline`, `qat`, `tuning`, `dataset`, `fused_passes` (enable, fused_passes_list),
    `fused_linear_promotion`, `dp_optimization`, `mp_optimization`, `sp_optimization`; and the
    top-level keys `auto_mode`, `gradient_scale`, `split_data`, `seed`, ...

    Examples:
      >>> from fleetjax.fleet import auto
      >>> s = auto.Strategy({"sharding": {"enable": True, "stage": 2}})
      >>> s.qat.weight_bits
      8

    As with `fleetjax.Strategy`, unknown sections or keys raise `UnknownFieldError` (Paddle
    stores any attribute) and values are checked.
    """

    SPEC = _schema.LEGACY_AUTO_STRATEGY

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
