"""`paddle.distributed.fleet.base` at Paddle's module paths: `role_maker` and `util_factory`."""

from fleetjax.fleet.base import role_maker, util_factory

__all__ = ["role_maker", "util_factory"]
