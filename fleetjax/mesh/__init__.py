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
    ZERO_MIN_ELEMENTS,
    batch_sharding,
    constrain,
    data_axes,
    data_parallel_size,
    replicated,
    zero_spec,
)

__all__ = [
    "AXES",
    "DATA_AXES",
    "ZERO_MIN_ELEMENTS",
    "DEFAULT_ORDER",
    "batch_sharding",
    "build_mesh",
    "constrain",
    "data_axes",
    "data_parallel_size",
    "mesh_from_strategy",
    "replicated",
    "strategy_degrees",
    "zero_spec",
]
