"""The device mesh with Paddle's hybrid-parallel axes `dp`, `sharding`, `pp` and `mp`, and the
sequence axes `sep` and `cp` (their names and order: `fleetjax.vocabulary`), and the placement
rules on it."""

from fleetjax.mesh._mesh import (
    build_mesh,
    check_order,
    simulation_hint,
)
from fleetjax.mesh._rules import (
    ZERO_MIN_ELEMENTS,
    batch_sharding,
    constrain,
    data_axes,
    data_parallel_size,
    manual_axes,
    replicated,
    restrict,
    spec_axes,
    zero_spec,
)

__all__ = [
    "ZERO_MIN_ELEMENTS",
    "batch_sharding",
    "build_mesh",
    "check_order",
    "simulation_hint",
    "constrain",
    "data_axes",
    "data_parallel_size",
    "manual_axes",
    "replicated",
    "restrict",
    "spec_axes",
    "zero_spec",
]
