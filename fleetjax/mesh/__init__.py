"""The device mesh with Paddle's hybrid-parallel axes `dp`, `sharding`, `pp` and `mp`, and the
sequence axes `sep` and `cp`."""

from fleetjax.mesh._mesh import (
    AXES,
    DEFAULT_ORDER,
    REQUIRED_AXES,
    SEQUENCE_AXES,
    build_mesh,
    check_order,
    simulation_hint,
)
from fleetjax.mesh._rules import (
    DATA_AXES,
    ZERO_MIN_ELEMENTS,
    batch_sharding,
    constrain,
    data_axes,
    data_parallel_size,
    replicated,
    restrict,
    spec_axes,
    zero_spec,
)

__all__ = [
    "AXES",
    "DATA_AXES",
    "ZERO_MIN_ELEMENTS",
    "DEFAULT_ORDER",
    "REQUIRED_AXES",
    "SEQUENCE_AXES",
    "batch_sharding",
    "build_mesh",
    "check_order",
    "simulation_hint",
    "constrain",
    "data_axes",
    "data_parallel_size",
    "replicated",
    "restrict",
    "spec_axes",
    "zero_spec",
]
