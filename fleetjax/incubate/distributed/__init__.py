"""Paddle's ``paddle.incubate.distributed``: its ``models.moe``."""

from fleetjax.incubate.distributed import models

__all__ = ["models"]
