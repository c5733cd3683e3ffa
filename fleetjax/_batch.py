"""The global batch: checked against the mesh, and placed split over the data axes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from fleetjax.mesh import data_axes, data_parallel_size


def global_shape(x: Any) -> tuple[int, ...]:
    """The global shape of a batch leaf: a JAX array's or an abstract one's own; a host array
    is this process's rows, one of `jax.process_count()` equal parts."""
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        return x.shape
    return (x.shape[0] * jax.process_count(), *x.shape[1:])


def check_batch(batch: Any, mesh: Mesh, micro_batches: int = 1) -> Any:
    """`batch` with host values as numpy arrays, after checking that every leaf has a leading
    batch dimension that splits over the data axes of `mesh` into `micro_batches` on each
    device.

    Raises:
      ValueError: naming the leaf (e.g. ``batch['x']``), its rows and the split.
    """
    ways = data_parallel_size(mesh)
    split = " x ".join(f"{a}={mesh.shape[a]}" for a in data_axes(mesh))

    def check(path: Any, x: Any) -> Any:
        if not isinstance(x, jax.Array | np.ndarray | jax.ShapeDtypeStruct):
            x = np.asarray(x)
        name = "batch" + jax.tree_util.keystr(path)
        if not x.shape:
            raise ValueError(f"{name} is a scalar; every batch leaf needs a batch dimension")
        rows = global_shape(x)[0]
        if rows % ways:
            raise ValueError(
                f"{name} has {rows} rows, which do not split evenly over the "
                f"{ways} data-parallel devices ({split})"
            )
        if rows % (ways * micro_batches):
            raise ValueError(
                f"{name} has {rows} rows, which do not split into k_steps={micro_batches} "
                f"micro-batches on each of the {ways} data-parallel devices ({split})"
            )
        return x

    return jax.tree_util.tree_map_with_path(check, batch)


def place_batch(batch: Any, sharding: NamedSharding) -> Any:
    """`batch` (checked) as global arrays placed with `sharding`.

    Host (numpy) arrays are this process's part of the global batch: with one process, the
    whole batch; with several, each passes its own rows and the global batch is their
    concatenation in process order. JAX arrays are global already; they are resharded if they
    are not split that way.
    """

    def place(x: Any) -> jax.Array:
        if not isinstance(x, jax.Array):
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.device_put(x, sharding)

    return jax.tree.map(place, batch)


def abstract_batch(batch: Any, sharding: NamedSharding) -> Any:
    """`batch` (checked) as `jax.ShapeDtypeStruct`s of the global batch placed with
    `sharding`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(global_shape(x), x.dtype, sharding=sharding), batch
    )
