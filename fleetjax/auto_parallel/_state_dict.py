"""Paddle's `save_state_dict` / `load_state_dict`: a dict of distributed tensors saved under one
mesh and placements and loaded under any other, on `fleetjax.checkpoint`'s manager (orbax
underneath, every array's checksum verified on load, atomic saves).

`path` holds Paddle's checkpoint versions, `unique_id` 0, 1, ...: each is a checkpoint step of
a `CheckpointManager` in `path`.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import jax

from fleetjax._warnings import warn_once
from fleetjax.auto_parallel._placements import Replicate
from fleetjax.auto_parallel._tensor import placements_of, process_mesh_of, reshard
from fleetjax.checkpoint import CheckpointManager

# Saves still being written (async_save=True), by directory: finished before the directory is
# read or written again, or when the process exits.
_WRITING: dict[str, CheckpointManager] = {}


def _finish(path: str) -> None:
    manager = _WRITING.pop(path, None)
    if manager is not None:
        manager.close()


@atexit.register
def _finish_all() -> None:
    for path in list(_WRITING):
        _finish(path)


def _no_effect(function: str, settings: dict[str, tuple[Any, Any, str]]) -> None:
    """Warn once for each Paddle argument given a value other than its default."""
    for name, (value, default, why) in settings.items():
        if value != default:
            warn_once(f"{function}'s {name}={value!r} has no JAX meaning ({why}); ignored")


def _summed(tree: Any) -> Any:
    """`tree` with each pending sum (`Partial`) done: a checkpoint holds whole values."""

    def whole(x: Any) -> Any:
        placements = placements_of(x)
        if placements is None or not any(p.is_partial() for p in placements):
            return x
        summed = [Replicate() if p.is_partial() else p for p in placements]
        return reshard(x, process_mesh_of(x), summed)

    return jax.tree.map(whole, tree)


def save_state_dict(
    state_dict: dict[str, Any],
    path: str,
    process_group: Any = None,
    coordinator_rank: int = 0,
    unique_id: int | None = None,
    async_save: bool = False,
    safetensors: bool = False,
    save_replicas: bool = False,
) -> None:
    """Paddle's `paddle.distributed.save_state_dict`: save a dict (nested dicts too) of
    distributed tensors to `path`, as version `unique_id` (default: one more than the newest,
    0 at first).

    Each device writes its own part (orbax); a `Partial` tensor is saved summed. With
    `async_save` the call returns once the values are copied off the devices, and the files are
    written in the background (finished before `path` is next saved to or loaded from, or at
    exit). `process_group`, `coordinator_rank`, `safetensors` and `save_replicas` have no JAX
    meaning and warn.

    Raises:
      ValueError: if version `unique_id` exists in `path` (Paddle overwrites it; fleetjax
        never replaces a complete checkpoint: pick another id).
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"save_state_dict takes a dict of tensors, got {type(state_dict).__name__}")
    _no_effect(
        "save_state_dict",
        {
            "process_group": (process_group, None, "every process of the job saves its part"),
            "coordinator_rank": (coordinator_rank, 0, "orbax's process 0 writes the metadata"),
            "safetensors": (safetensors, False, "fleetjax writes orbax's format, with checksums"),
            "save_replicas": (save_replicas, False, "orbax writes one copy of each part"),
        },
    )
    path = os.path.abspath(path)
    _finish(path)
    manager = CheckpointManager(path, max_to_keep=None, async_save=async_save)
    try:
        latest = manager.latest_step()
        step = unique_id if unique_id is not None else 0 if latest is None else latest + 1
        manager.save(step, _summed(state_dict), force=True)
    except BaseException:
        manager.close()
        raise
    if async_save:
        _WRITING[path] = manager
    else:
        manager.close()


def load_state_dict(
    state_dict: dict[str, Any],
    path: str,
    process_group: Any = None,
    coordinator_rank: int = 0,
    unique_id: int | None = None,
    offload: bool = False,
    mw_name_compatibility: bool = True,
    aoa_config: dict[str, list[str]] | None = None,
    safetensors: bool = False,
    worker_groups: Any = None,
    comm_method: str = "broadcast",
) -> None:
    """Paddle's `paddle.distributed.load_state_dict`: fill `state_dict` (in place, nested dicts
    too) with version `unique_id` (default: the newest) of the checkpoint in `path`, each value
    placed as the tensor it replaces is (its mesh and placements, whatever they were when
    saved), bitwise, every array checked against the checksum saved with it.

    `process_group`, `coordinator_rank`, `offload`, `mw_name_compatibility`, `safetensors`,
    `worker_groups` and `comm_method` have no JAX meaning and warn.

    Raises:
      FileNotFoundError: if `path` holds no such version.
      ValueError: if the names or shapes in `state_dict` differ from the checkpoint's.
      fleetjax.checkpoint.CorruptCheckpointError: if the files are damaged.
      NotImplementedError: for `aoa_config` (Paddle's renaming of parameters on load).
    """
    if not isinstance(state_dict, dict):
        raise TypeError(f"load_state_dict takes a dict of tensors, got {type(state_dict).__name__}")
    if aoa_config is not None:
        raise NotImplementedError(
            "load_state_dict's aoa_config (renaming and reshaping parameters on load) is not "
            "supported: load into the saved names, then rename"
        )
    moves = "XLA moves each part to the devices that hold it"
    _no_effect(
        "load_state_dict",
        {
            "process_group": (process_group, None, "every process of the job loads its part"),
            "coordinator_rank": (coordinator_rank, 0, "every process reads its own part"),
            "offload": (offload, False, "each part is read straight to its device"),
            "mw_name_compatibility": (mw_name_compatibility, True, "one naming of parameters"),
            "safetensors": (safetensors, False, "fleetjax reads orbax's format"),
            "worker_groups": (worker_groups, None, moves),
            "comm_method": (comm_method, "broadcast", moves),
        },
    )
    path = os.path.abspath(path)
    _finish(path)
    target = _summed(state_dict)
    with CheckpointManager(path, read_only=True) as manager:
        loaded, _ = manager.restore(target, unique_id)
    _fill(state_dict, loaded)


def _fill(state_dict: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Put each loaded value in `state_dict`, placed as the value it replaces."""
    for key, old in state_dict.items():
        if isinstance(old, dict):
            _fill(old, loaded[key])
            continue
        mesh, placements = process_mesh_of(old), placements_of(old)
        state_dict[key] = loaded[key] if mesh is None else reshard(loaded[key], mesh, placements)
