"""Feeding the step: a grain input pipeline per process, prefetched to the devices, resumable.

`Loader(source, step, global_batch_size, seed=...)` reads a grain `MapDataset` (or a data
source, numpy arrays, or a list of ArrayRecord files), shuffles it with `seed` (a new order each
epoch), and yields the step's global batches as `jax.Array`s placed by `step.shard_batch`:

    source --map(transform)--> records --shuffle(seed)--> --batch(this process's rows)-->
      this process's part of each global batch --shard_batch--> global jax.Array (prefetched)

Each process reads only its own rows of each global batch, and the global batches are the same
whatever the number of processes: batch `b` of epoch `e` is records `[b G, (b + 1) G)` of that
epoch's order (a list of files is split per process instead, as Paddle's
`fleet.util.get_file_shard` splits it). A background thread (grain's `ThreadPrefetchIterDataset`)
reads, transforms and transfers the next `prefetch` batches while the step runs;
`last_wait_s` is how long the loop waited for the last one. `get_state()` is JSON: saved in a
checkpoint's extras, `set_state` resumes at the next unseen batch.

    loader = fleetjax.data.Loader(train, step, global_batch_size=256, seed=0)
    if (resumed := manager.resume(state)) is not None:
        _, state, extra = resumed
        loader.set_state(extra["data"])
    for batch in loader:
        state, metrics = step(state, batch)
        manager.save(int(state.step), state, extra={"data": loader.get_state()})
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import grain
import jax
import numpy as np

from fleetjax._file_shard import file_shard
from fleetjax.mesh import data_axes, data_parallel_size
from fleetjax.step import TrainStep

__all__ = ["Loader"]

_STATE_KEYS = ("grain", "batches", "pipeline")
Transform = Callable[[Any], Any]  # a record to a record
BatchFn = Callable[[Sequence[Any]], Any]  # records to a batch


class _Arrays:
    """A grain data source over numpy arrays (a pytree of them): record `i` is row `i` of
    every leaf."""

    def __init__(self, arrays: Any) -> None:
        named = jax.tree_util.tree_flatten_with_path(arrays)[0]
        lengths = {jax.tree_util.keystr(path): len(np.asarray(x)) for path, x in named}
        if not lengths or 0 in {np.ndim(x) for _, x in named}:
            raise ValueError("the arrays need a leading (records) dimension on every leaf")
        if len(set(lengths.values())) != 1:
            raise ValueError(f"the arrays' leaves have different numbers of records: {lengths}")
        self._arrays = jax.tree.map(np.asarray, arrays)
        self._length = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        return jax.tree.map(lambda x: x[index], self._arrays)

    def rows(self, indices: Sequence[int]) -> Any:
        """The records at `indices`, batched: one numpy gather per leaf."""
        at = np.asarray(indices)
        return jax.tree.map(lambda x: x[at], self._arrays)


def _is_file_list(source: Any) -> bool:
    return (
        isinstance(source, list | tuple)
        and bool(source)
        and all(isinstance(f, str | os.PathLike) for f in source)
    )


def _records(source: Any, transform: Transform | None) -> tuple[grain.MapDataset, BatchFn | None]:
    """`source` as a finite grain `MapDataset` of its records after `transform` (files
    excepted: see `Loader`), and what makes a list of its elements a batch (None: grain stacks
    them). Numpy arrays without a transform are their record indices, each batch's rows gathered
    at once: grain's cost per record (tens of microseconds) would outweigh a small step."""
    if isinstance(source, grain.IterDataset):
        raise TypeError(
            "source is a grain IterDataset, which can only be read in order; the loader needs "
            "random access: a grain MapDataset or a data source (len and getitem)"
        )
    if isinstance(source, grain.MapDataset):
        records = source
    elif isinstance(source, np.ndarray | dict | list | tuple):
        arrays = _Arrays(source)
        if transform is None:
            return grain.MapDataset.range(len(arrays)), arrays.rows
        records = grain.MapDataset.source(arrays)
    elif hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        records = grain.MapDataset.source(source)
    else:
        raise TypeError(
            f"source is {type(source).__name__}; give a grain MapDataset, a data source (len "
            "and getitem), numpy arrays (or a pytree of them) or a list of ArrayRecord files"
        )
    if len(records) >= 2**62:
        raise ValueError("source is infinite (repeated); give one epoch of records")
    return (records if transform is None else _transformed(records, transform)), None


def _layout(record: Any) -> dict[str, str]:
    """{leaf path: dtype[shape]} of a record."""
    leaves = jax.tree_util.tree_flatten_with_path(record)[0]
    return {
        jax.tree_util.keystr(path) or "the record": f"{np.asarray(x).dtype}{list(np.shape(x))}"
        for path, x in leaves
    }


def _transformed(records: grain.MapDataset, transform: Transform) -> grain.MapDataset:
    """`records` after `transform`, each checked against record 0's: grain stacks the records
    of a batch leaf by leaf, and says only that they differ."""
    expected = _layout(transform(records[0]))

    def checked(index: int, record: Any) -> Any:
        out = transform(record)
        if (got := _layout(out)) != expected:
            differ = [
                f"{leaf}: {got.get(leaf, 'missing')} (record 0: {expected.get(leaf, 'missing')})"
                for leaf in {**expected, **got}
                if got.get(leaf) != expected.get(leaf)
            ]
            raise ValueError(
                f"the loader's transform returned for record {index} another tree, shape or "
                f"dtype than for record 0, so they cannot be stacked into a batch: "
                f"{'; '.join(differ)}"
            )
        return out

    return records.map_with_index(checked)


def _process_rows(step: TrainStep, global_batch_size: int) -> range:
    """The rows of each global batch that this process's devices hold (`step.batch_sharding`)."""
    held = step.batch_sharding.addressable_devices_indices_map((global_batch_size,))
    spans = sorted({s.indices(global_batch_size)[:2] for (s,) in held.values()})
    rows = range(spans[0][0], spans[-1][1])
    covered = sum(stop - start for start, stop in spans)
    aligned = global_batch_size % len(rows) == 0 and rows.start % len(rows) == 0
    if covered != len(rows) or not aligned:
        raise NotImplementedError(
            f"this process's devices hold rows {spans} of each global batch of "
            f"{global_batch_size}; the loader reads one aligned block of rows per process: use "
            "a mesh whose data axes keep each process's devices together (build_mesh does)"
        )
    return rows


def _check_batch_size(step: TrainStep, global_batch_size: int) -> None:
    """Raise `ValueError` unless the global batch splits as the step splits it: over the data
    axes, into in-step gradient-merge micro-batches, or into the pipeline's micro-batches."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
        raise TypeError(f"global_batch_size must be an int, got {global_batch_size!r}")
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    mesh, plan = step.mesh, step.plan
    ways = data_parallel_size(mesh)
    split = " x ".join(f"{a}={mesh.shape[a]}" for a in data_axes(mesh)) or "no data axis"
    if plan.pipeline is not None:
        pipe = plan.pipeline
        rows = ways * pipe.micro_batch_size * pipe.accumulate_steps
        if global_batch_size != rows:
            raise ValueError(
                f"global_batch_size={global_batch_size}, but the pipeline takes {ways} "
                f"data-parallel replicas ({split}) x micro_batch_size={pipe.micro_batch_size} "
                f"x accumulate_steps={pipe.accumulate_steps} = {rows} rows per step"
            )
    if global_batch_size % ways:
        raise ValueError(
            f"global_batch_size={global_batch_size} does not split evenly over the {ways} "
            f"data-parallel devices ({split})"
        )
    merge = plan.in_step_merge
    if merge is not None and global_batch_size % (ways * merge.k_steps):
        raise ValueError(
            f"global_batch_size={global_batch_size} does not split into gradient_merge "
            f"k_steps={merge.k_steps} micro-batches on each of the {ways} data-parallel "
            f"devices ({split}): give a multiple of {ways * merge.k_steps}"
        )


def _check_size(records: int, needed: int, global_batch_size: int, what: str) -> None:
    if records < needed:
        share = "" if needed == global_batch_size else f"{needed} rows of "
        raise ValueError(
            f"{what} has {records} records, fewer than one global batch needs "
            f"({share}global_batch_size={global_batch_size})"
        )


def _place(step: TrainStep, rows: Any) -> Any:
    """This process's rows as global arrays on the devices (run ahead with `prefetch`)."""
    return jax.block_until_ready(step.shard_batch(rows))


def _close(open_iterators: list[Any]) -> None:
    while open_iterators:
        open_iterators.pop().close()


def _count(name: str, value: Any, *, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


class Loader:
    """The step's global batches from a grain pipeline: sharded per process, shuffled,
    prefetched onto the devices, resumable.

    Args:
      source: the records: a grain `MapDataset` or data source (`len` and `[i]`), numpy
        arrays or a pytree of them (record `i` is row `i` of every leaf), or a list of
        ArrayRecord files, each process reading its block as `fleet.util.get_file_shard` gives
        it (records are bytes then: decode them with `transform`).
      step: the `TrainStep` the batches are for: its mesh and plan say how the global batch
        splits, `shard_batch` places it, and once it has a state (`step.init`) a batch like
        the first is checked against its loss (`step.lower`, nothing runs).
      global_batch_size: rows per step over all processes. It must split over the data-parallel
        devices, into in-step `gradient_merge` `k_steps` on each, and under a pipeline equal
        replicas x `micro_batch_size` x `accumulate_steps`.
      seed: the shuffle seed (epoch `e` is shuffled with `seed + e`), in [0, 2**32).
      shuffle: whether to shuffle; False reads the records in order, each epoch alike.
      num_epochs: how many epochs to yield (None: forever). Each epoch is
        `records // global_batch_size` batches; the remaining records are left out of it.
      transform: applied to each record (in the background with `prefetch`), e.g. decoding or
        augmentation; it must be deterministic for a resumed run to see the same batches.
      prefetch: batches read, transformed and transferred to the devices ahead of the step, by
        one background thread (grain's `ThreadPrefetchIterDataset`); 0 reads each batch when
        it is asked for.
      read_threads: threads reading (and transforming) batches in parallel, grain's
        `ReadOptions.num_threads`: for sources that wait on storage. 0 (grain's advice for data
        in memory) reads in the prefetch thread.

    Attributes:
      batches: global batches yielded so far (restored by `set_state`).
      batches_per_epoch: global batches in an epoch.
      process_rows: the rows of each global batch this process reads, e.g. `range(128, 256)`.
      last_wait_s: seconds the last `next()` waited for its batch: with prefetch keeping up,
        the hand-over only; without, the reading, transforming and transfer.

    Raises:
      TypeError: for a source of another kind, or a batch size that is not an int.
      ValueError: for a batch size that does not split as the step splits it, a dataset
        smaller than one global batch, or records that do not fit the step's loss (naming
        the records' shapes and the loss's error).
    """

    def __init__(
        self,
        source: Any,
        step: TrainStep,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
        transform: Transform | None = None,
        prefetch: int = 2,
        read_threads: int = 0,
    ) -> None:
        _check_batch_size(step, global_batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        if num_epochs is not None:
            _count("num_epochs", num_epochs, least=1)
        _count("prefetch", prefetch, least=0)
        _count("read_threads", read_threads, least=0)
        self.step, self.global_batch_size = step, global_batch_size
        self.process_rows = _process_rows(step, global_batch_size)
        rows = len(self.process_rows)
        self._pipeline = {"global_batch_size": global_batch_size, "seed": seed, "shuffle": shuffle}
        if _is_file_list(source):
            records, self.batches_per_epoch = self._own_files(list(source))
            records = records if transform is None else _transformed(records, transform)
            batch_fn = None
            first, parts = 0, 1  # each process batches its own records
        else:
            records, batch_fn = _records(source, transform)
            self._pipeline["records"] = len(records)
            _check_size(len(records), global_batch_size, global_batch_size, "the dataset")
            self.batches_per_epoch = len(records) // global_batch_size
            # Of each global batch, this process reads block `first` of `parts`.
            first, parts = self.process_rows.start // rows, global_batch_size // rows
        if shuffle:
            records = records.shuffle(seed=seed)
        self._blocks = records.batch(rows, drop_remainder=True, batch_fn=batch_fn)
        mine = self._blocks[first : self.batches_per_epoch * parts : parts].repeat(num_epochs)
        read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=read_threads)
        placed = mine.to_iter_dataset(read).map(functools.partial(_place, step))
        if prefetch:
            placed = grain.experimental.ThreadPrefetchIterDataset(
                placed, prefetch_buffer_size=prefetch
            )
        self._checked = False
        if step.abstract_state is not None:
            self._check_records()
        self.batches = 0
        self.last_wait_s = 0.0
        # The open iterator, emptied by `close` (or at exit): grain's iterators must be closed
        # before the interpreter tears their modules down.
        self._open = [iter(placed)]
        weakref.finalize(self, _close, self._open)

    def _own_files(self, files: list[Any]) -> tuple[grain.MapDataset, int]:
        """This process's files (Paddle's `get_file_shard`) as records, and the batches per
        epoch: as many as the process with the fewest records has (all must agree)."""
        index, count = jax.process_index(), jax.process_count()
        rows = len(self.process_rows)
        if rows * count != self.global_batch_size:
            raise ValueError(
                f"a file list needs each of the {count} processes to hold its own rows of the "
                f"global batch, but this one's devices hold rows {self.process_rows} of "
                f"{self.global_batch_size}: give a MapDataset or arrays instead"
            )
        mine = file_shard(files, index, count)  # none where there are fewer files than processes
        records = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(mine or files))
        self._pipeline["files"] = [len(files), count]
        held = [len(records) if mine else 0]  # without files of its own, refused below
        if count > 1:  # all processes gather before any of them can raise
            from jax.experimental import multihost_utils

            held = multihost_utils.process_allgather(np.int64(held[0])).tolist()
        fewest = int(np.argmin(held))
        what = f"process {fewest}'s files {file_shard(files, fewest, count)}"
        _check_size(held[fewest], rows, self.global_batch_size, what)
        return records, held[fewest] // rows

    def _check_records(self) -> None:
        """Raise `ValueError` if batches like the first do not fit the step's loss: the step is
        lowered for one (from shapes alone; nothing runs)."""
        rows = jax.tree.map(np.asarray, self._blocks[0])
        record = jax.tree.map(lambda x: x[0], rows)
        shapes = jax.tree.map(lambda x: f"{x.dtype}{[self.global_batch_size, *x.shape]}", record)
        try:
            batch = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((self.global_batch_size, *x.shape), x.dtype), record
            )
            self.step.lower(self.step.abstract_state, batch)
        except Exception as e:  # whatever the user's loss raises on a batch it cannot take
            raise ValueError(
                f"the loader's batches {shapes} do not fit the step's loss: {type(e).__name__}: {e}"
            ) from e
        self._checked = True

    # -- iteration ---------------------------------------------------------------------------
    @property
    def _iterator(self) -> Any:
        if not self._open:
            raise ValueError("the loader is closed")
        return self._open[0]

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Any:
        """The next global batch: a pytree of `jax.Array`s placed with `step.batch_sharding`."""
        if not self._checked:
            if self.step.abstract_state is None:
                raise ValueError(
                    "the loader checks its records against the step's loss, which needs the "
                    "step's state: call step.init(params) before reading batches"
                )
            self._check_records()
        start = time.perf_counter()
        batch = next(self._iterator)
        self.last_wait_s = time.perf_counter() - start
        self.batches += 1
        return batch

    @property
    def epoch(self) -> float:
        """Epochs read so far, e.g. 2.5 halfway through the third."""
        return self.batches / self.batches_per_epoch

    @property
    def samples(self) -> int:
        """Records read so far by all processes together."""
        return self.batches * self.global_batch_size

    # -- resuming ----------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        """Where the loader is, as JSON: grain's iterator state (of the batches yielded, not
        those prefetched), the batches yielded and what the order depends on. Save it with the
        training state, e.g. `manager.save(step, state, extra={"data": loader.get_state()})`."""
        return {
            "grain": self._iterator.get_state(),
            "batches": self.batches,
            "pipeline": dict(self._pipeline),
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue after the batches `state` (from `get_state`) had yielded.

        Raises:
          ValueError: if `state` is not a loader's state, or was saved by a loader whose batches
            differ (another global batch size, seed, shuffle, dataset size or file split).
        """
        if not isinstance(state, dict) or set(state) != set(_STATE_KEYS):
            keys = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a Loader state (keys {list(_STATE_KEYS)}): {keys}")
        saved, now = state["pipeline"], self._pipeline
        if saved != now:
            changes = ", ".join(
                f"{k}: saved {saved.get(k)}, now {now.get(k)}"
                for k in {**now, **saved}
                if saved.get(k) != now.get(k)
            )
            raise ValueError(
                f"the data state was saved by a loader with other batches ({changes}); resume "
                "with the same source, global_batch_size, seed and shuffle"
            )
        self._iterator.set_state(state["grain"])
        self.batches = state["batches"]

    def close(self) -> None:
        """Stop the prefetch thread (also done when the loader is garbage-collected)."""
        _close(self._open)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
