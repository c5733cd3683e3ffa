"""Paddle's ``paddle.incubate.distributed.models``: its ``moe``."""

from fleetjax.incubate.distributed.models import moe

__all__ = ["moe"]
