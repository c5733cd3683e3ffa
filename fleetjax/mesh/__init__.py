"""The device mesh with Paddle's hybrid-parallel axes `dp`, `sharding`, `pp` and `mp`."""

from fleetjax.mesh._mesh import (
    AXES,
    DEFAULT_ORDER,
    build_mesh,
    mesh_from_strategy,
    strategy_degrees,
)
from fleetjax.mesh._placement import (
    DATA_AXES,
    batch_sharding,
    data_axes,
    data_parallel_size,
    replicated,
)

__all__ = [
    "AXES",
    "DATA_AXES",
    "DEFAULT_ORDER",
    "batch_sharding",
    "build_mesh",
    "data_axes",
    "data_parallel_size",
    "mesh_from_strategy",
    "replicated",
    "strategy_degrees",
]
