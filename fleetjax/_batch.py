"""The global batch: checked against the mesh, agreed between the processes, and placed split
over the data axes."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from fleetjax import _coordinator
from fleetjax._warnings import warn_once
from fleetjax.mesh import data_axes, data_parallel_size

# Distinct batch shapes and dtypes a step compiles for before it says that each costs a compile.
SHAPES_BEFORE_WARNING = 3

# A batch's signature: each leaf's shape and dtype name, as the step compiles for them.
Signature = tuple[tuple[tuple[int, ...], str], ...]


_steps = itertools.count()  # TrainSteps, numbered alike on every process: their boards' names


class BatchShapes:
    """The batch shapes and dtypes a step was called with; warns once when there are
    `SHAPES_BEFORE_WARNING` of them, since each new one compiles the step again. With several
    processes, `agree` checks that they all pass batches of the same shapes."""

    def __init__(self) -> None:
        self.seen: set[Signature] = set()
        self._agreement = _Agreement(next(_steps))

    def agree(self, batch: Any) -> None:
        """Raise `ValueError`, on the processes that see it, if this call's batch (checked,
        each process's own rows) has other shapes or dtypes than another process's call of
        the same number: each process would compile the step for another global batch, and
        its rows would weigh differently in the summed gradient. Checked at the first call and
        at each call whose shapes differ from the call before (in seconds: as soon as the
        other processes reach that call); every call posts this process's shapes."""
        self._agreement.check(batch)

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


def _signature(batch: Any) -> list[str]:
    """Each leaf as `batch['x'] float32[4, 8]` (a JAX array's global shape: `... global`)."""
    return [
        f"batch{jax.tree_util.keystr(path)} {np.result_type(x)}{list(np.shape(x))}"
        + (" global" if isinstance(x, jax.Array) else "")
        for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
    ]


class _Agreement:
    """One step's check that the processes pass batches alike (`BatchShapes.agree`).

    Each process keeps posted on a `Board`: its number of calls, its shapes and the call they
    began at, and the shapes before those. At a call whose shapes differ from the call before
    (the first one included), a process reads every other's post once that one reached the
    call too, and compares its shapes there. A process cannot change shapes twice while
    another is behind it (it waits for that one at the first change), so the shapes before the
    last change cover any call a slower process asks about.
    """

    def __init__(self, number: int) -> None:
        self._number = number
        self._board: _coordinator.Board | None = None
        self._calls = 0
        self._shapes: list[str] | None = None
        self._since = 0
        self._before: list[str] | None = None

    def check(self, batch: Any) -> None:
        leaves = jax.tree.leaves(batch)
        if jax.process_count() == 1 or all(isinstance(x, jax.Array) for x in leaves):
            return  # global arrays: their shapes are the global batch's
        if self._board is None:
            self._board = _coordinator.Board(f"batch-shapes/{self._number}")
        self._calls += 1
        shapes = _signature(batch)
        changed = shapes != self._shapes
        if changed:
            self._before, self._since, self._shapes = self._shapes, self._calls, shapes
        post = {"call": self._calls, "since": self._since, "shapes": shapes, "before": self._before}
        self._board.post(post, now=changed)
        if changed:
            self._compare(self._board, self._calls, shapes)

    @staticmethod
    def _compare(board: _coordinator.Board, call: int, shapes: list[str]) -> None:
        """Raise if another process's batch at call `call` has other shapes than `shapes`."""

        def reached(post: Any) -> bool:
            return post is not None and post["call"] >= call

        theirs = {}
        for process in range(jax.process_count()):
            if process == jax.process_index():
                theirs[process] = shapes
                continue
            post = board.wait_for(process, reached)
            theirs[process] = post["shapes"] if post["since"] <= call else post["before"]
        if any(other != shapes for other in theirs.values()):
            each = "; ".join(f"process {p}: {', '.join(s)}" for p, s in theirs.items())
            raise ValueError(
                f"the processes passed batches of different shapes to call {call} of the train "
                f"step ({each}): each process passes its own rows of the global batch, with "
                "the same shapes and dtypes on every process; otherwise each compiles the step "
                "for another global batch and weighs the rows of the others wrongly"
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


def check_run_batches(batches: Sequence[Any], expected: int | None) -> None:
    """Raise `ValueError` unless `batches` are what `TrainStep.run` stacks into one scan: as
    many as `expected` (`num_iteration_per_run`; None: any number), at least one, and each with
    the leaves, shapes and dtypes of the first (the error names the first that differs)."""
    if expected is not None and len(batches) != expected:
        raise ValueError(
            f"run() got {len(batches)} batches, but DistributedStrategy.execution_strategy"
            f".num_iteration_per_run={expected}: pass that many, or change it"
        )
    if not batches:
        raise ValueError("run() got no batches")
    first = _signature(batches[0])
    for i, batch in enumerate(batches[1:], 1):
        if (leaves := _signature(batch)) != first:
            raise ValueError(
                f"run() stacks its batches into one scan, so they must have the same leaves, "
                f"shapes and dtypes, but batch {i} has {', '.join(leaves)} where batch 0 has "
                f"{', '.join(first)}: pad them to one shape, or call the step once per batch"
            )


def abstract_batch(batch: Any, sharding: NamedSharding) -> Any:
    """`batch` (checked) as `jax.ShapeDtypeStruct`s of the global batch placed with
    `sharding`."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(global_shape(x, sharding.mesh), x.dtype, sharding=sharding),
        batch,
    )
