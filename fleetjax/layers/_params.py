"""Creating a layer's parameters: logical axis names as partitioning metadata, Paddle's defaults."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax.layers.partitioning import LogicalNames

# Paddle's default weight initializer (LayerHelper's XavierUniform); biases start at zero.
DEFAULT_WEIGHT_INIT: nnx.Initializer = nnx.initializers.xavier_uniform()


def logical_param(
    init: nnx.Initializer,
    names: LogicalNames,
    key: jax.Array,
    shape: tuple[int, ...],
    dtype: jnp.dtype,
) -> nnx.Param:
    """A parameter with logical axis `names` as its partitioning metadata.

    It is created whole whatever flax's eager-sharding setting (``eager_sharding=False``): which
    mesh axes the names map to is decided when it is placed (`partition_specs`), not when the
    model is built, and a model builds with no mesh at all.
    """
    return nnx.Param(init(key, shape, dtype), out_sharding=names, eager_sharding=False)


def check_sizes(layer: str, **sizes: int) -> None:
    """Each of `sizes` is a positive int, else a ValueError naming the layer and argument."""
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{layer}: {name} must be a positive int, got {size!r}")
