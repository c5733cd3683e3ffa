"""The global batch: checked against the mesh, and placed split over the data axes."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from fleetjax._warnings import warn_once
from fleetjax.mesh import data_axes, data_parallel_size

# Distinct batch shapes and dtypes a step compiles for before it says that each costs a compile.
SHAPES_BEFORE_WARNING = 3

# A batch's signature: each leaf's shape and dtype name, as the step compiles for them.
Signature = tuple[tuple[tuple[int, ...], str], ...]


class BatchShapes:
    """The batch shapes and dtypes a step was called with; warns once when there are
    `SHAPES_BEFORE_WARNING` of them, since each new one compiles the step again."""

    def __init__(self) -> None:
        self.seen: set[Signature] = set()

    def note(self, batch: Any) -> None:
        leaves = jax.tree.leaves(batch)
        signature = tuple((tuple(x.shape), np.dtype(x.dtype).name) for x in leaves)
        if signature in self.seen:
            return
        self.seen.add(signature)
        if len(self.seen) == SHAPES_BEFORE_WARNING:
            warn_once(_recompiles(self.seen))


def _recompiles(seen: set[Signature]) -> str:
    """What changed between the batches a step compiled for, and what keeps it to one."""
    listed = sorted(
        "(" + ", ".join(f"{dtype}[{','.join(map(str, shape))}]" for shape, dtype in s) + ")"
        for s in seen
    )
    changed, advice = [], []
    if len({tuple(shape for shape, _ in s) for s in seen}) > 1:
        changed.append("shape")
        advice.append("pad batches to one shape (or drop the last partial batch)")
    if len({tuple(dtype for _, dtype in s) for s in seen}) > 1:
        changed.append("dtype")
        advice.append("give each input one dtype (np.asarray(x, dtype=...))")
    return (
        f"the train step compiled for {len(seen)} batch shapes and dtypes ({', '.join(listed)}): "
        f"each new {' or '.join(changed)} compiles it again; {', and '.join(advice)}"
    )


@functools.cache
def process_share(mesh: Mesh) -> int:
    """How many times this process's rows make the global batch: the data-parallel blocks of
    the batch over the blocks this process's devices hold (with one process, 1; with the data
    axes spread evenly over the processes, `jax.process_count()`; with a batch replicated over
    the processes, as for tensor parallelism across hosts, 1)."""
    axes = [mesh.axis_names.index(a) for a in data_axes(mesh)]
    local = {
        tuple(int(i) for i in np.take(index, axes))
        for index in np.ndindex(mesh.devices.shape)
        if mesh.devices[index].process_index == jax.process_index()
    }
    return data_parallel_size(mesh) // max(1, len(local))


def global_shape(x: Any, mesh: Mesh) -> tuple[int, ...]:
    """The global shape of a batch leaf: a JAX array's or an abstract one's own; a host array
    holds this process's rows (`process_share`)."""
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct):
        return x.shape
    return (x.shape[0] * process_share(mesh), *x.shape[1:])


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
        if not (jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)):
            raise TypeError(
                f"{name} has dtype {x.dtype}; batch leaves must be numeric or boolean arrays "
                "(encode text as token ids before the step)"
            )
        if not x.shape:
            raise ValueError(f"{name} is a scalar; every batch leaf needs a batch dimension")
        rows = global_shape(x, mesh)[0]
        if rows == 0:
            raise ValueError(f"{name} has 0 rows; a step needs at least one example")
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
        lambda x: jax.ShapeDtypeStruct(global_shape(x, sharding.mesh), x.dtype, sharding=sharding),
        batch,
    )
