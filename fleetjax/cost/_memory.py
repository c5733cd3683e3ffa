"""Bytes on a device: of a tree placed with its shardings (from shapes alone), and of a compiled
step (XLA's memory analysis)."""

from __future__ import annotations

import math
from typing import Any

import jax


def device_bytes(abstract: Any, shardings: Any) -> int:
    """Bytes one device holds of `abstract` (ShapeDtypeStructs) placed with `shardings` (a
    prefix tree: one sharding may place a whole subtree, as the loss-scale state's)."""

    def placed(sharding: jax.sharding.Sharding, subtree: Any) -> int:
        return sum(
            math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(subtree)
        )

    return sum(jax.tree.leaves(jax.tree.map(placed, shardings, abstract)))


def compiled_bytes(memory: Any) -> int:
    """A compiled step's per-device bytes: arguments + outputs - aliased outputs + temporaries
    (`compiled.memory_analysis()`), an upper bound of XLA's peak."""
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
