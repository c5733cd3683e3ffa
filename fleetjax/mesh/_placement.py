"""Where arrays live on the mesh: the batch over the data axes, everything else replicated."""

from __future__ import annotations

import math

from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXES = ("dp", "sharding")  # the batch is split over both; ZeRO shards state over sharding


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The data-parallel axes that `mesh` has."""
    return tuple(a for a in DATA_AXES if a in mesh.axis_names)


def data_parallel_size(mesh: Mesh) -> int:
    """How many ways the batch is split: the product of the data axes' sizes."""
    return math.prod(mesh.shape[a] for a in data_axes(mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The batch's leading dimension split over the data axes."""
    return NamedSharding(mesh, PartitionSpec(data_axes(mesh)))


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device."""
    return NamedSharding(mesh, PartitionSpec())
