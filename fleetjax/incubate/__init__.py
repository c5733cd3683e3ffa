"""Paddle's ``paddle.incubate`` module path: ``fleetjax.incubate.distributed.models.moe`` is
``paddle.incubate.distributed.models.moe`` (`fleetjax.layers.moe`)."""

from fleetjax.incubate import distributed

__all__ = ["distributed"]
