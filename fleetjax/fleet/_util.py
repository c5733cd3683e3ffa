"""`fleet.util`: small cross-process helpers over JAX's multi-process runtime."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.experimental import multihost_utils

if TYPE_CHECKING:
    from fleetjax.fleet._fleet import Fleet

_REDUCE: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.sum,
    "mean": np.mean,
    "max": np.max,
    "min": np.min,
}


def _check_world(comm_world: str) -> None:
    if comm_world != "worker":
        raise NotImplementedError(
            f"comm_world={comm_world!r}: only 'worker' exists in collective mode "
            "('server' and 'all' are parameter-server groups)"
        )


def _like_input(value: np.ndarray, template: Any) -> Any:
    """`value` in the kind of container `template` was: scalar, list or numpy array."""
    if isinstance(template, np.ndarray):
        return value
    if isinstance(template, (list, tuple)):
        return value.tolist()
    return value.item()


class UtilBase:
    """Paddle's `fleet.util`, over all worker processes (one per `jax.process_index()`)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def all_reduce(self, input: Any, mode: str = "sum", comm_world: str = "worker") -> Any:
        """Reduce `input` (a number, list or numpy array) element-wise over all processes.

        `mode` is "sum", "mean", "max" or "min". Returns the same kind of value as `input`.
        """
        _check_world(comm_world)
        if mode not in _REDUCE:
            raise ValueError(f"mode must be one of {', '.join(_REDUCE)}, got {mode!r}")
        gathered = self._gather(input)
        return _like_input(_REDUCE[mode](gathered, axis=0), input)

    def all_gather(self, input: Any, comm_world: str = "worker") -> list[Any]:
        """Every process's `input`, as a list in process order."""
        _check_world(comm_world)
        return [_like_input(row, input) for row in self._gather(input)]

    def barrier(self, comm_world: str = "worker") -> None:
        """Wait until every process reaches this call."""
        _check_world(comm_world)
        self._fleet.barrier_worker()

    def get_file_shard(self, files: Sequence[str]) -> list[str]:
        """This worker's contiguous block of `files`; the first `len % n` workers get one more.

        Example: five files over two workers: worker 0 reads files 0-2, worker 1 files 3-4.
        """
        if not isinstance(files, list):
            raise TypeError("files should be a list of file need to be read.")
        index, count = self._fleet.worker_index(), self._fleet.worker_num()
        size, extra = divmod(len(files), count)
        start = index * size + min(index, extra)
        return files[start : start + size + (index < extra)]

    def print_on_rank(self, message: Any, rank_id: int) -> None:
        """Print `message` on worker `rank_id` only."""
        if self._fleet.worker_index() == rank_id:
            print(message, flush=True)

    def _gather(self, input: Any) -> np.ndarray:
        value = np.asarray(input)
        if jax.process_count() == 1:
            return value[None]
        return np.asarray(multihost_utils.process_allgather(value))
