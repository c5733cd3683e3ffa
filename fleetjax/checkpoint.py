"""Checkpoints that survive crashes, on orbax: Paddle's `fleet.save_persistables` and a
`CheckpointManager` that keeps the last N, saves every k steps in the background and records
extra metadata (such as the data position) with the state.

Every save is atomic: orbax writes `<step>.orbax-checkpoint-tmp` and renames it to `<step>`
once complete, so a process killed during a save leaves the previous checkpoint as the latest.
A restore places each leaf as the target says (`jax.Array`s, or `jax.ShapeDtypeStruct`s with
a sharding), so a checkpoint saved on one mesh restores onto another (dp=8 onto dp=2 x mp=4,
replicated onto ZeRO-sharded, 8 devices onto 4). Saving and restoring are collective: with
several processes, all of them make the same calls with the same directory.

    manager = CheckpointManager("ckpt", max_to_keep=3, save_interval_steps=100)
    if manager.latest_step() is not None:
        state, extra = manager.restore(state)  # `state`: a fresh TrainState, the target
    ...
    manager.save(step, state, extra={"data_position": position})  # every 100 steps
    manager.close()
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

STATE, EXTRA = "state", "extra"  # the two items of every checkpoint


def _abstract(target: Any) -> Any:
    """`target` as `jax.ShapeDtypeStruct`s with shardings: where each leaf is restored to."""

    def leaf(path: Any, x: Any) -> jax.ShapeDtypeStruct:
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
            return x
        raise TypeError(
            f"target{jax.tree_util.keystr(path)} is {type(x).__name__}; each target leaf must "
            "be a jax.Array or a jax.ShapeDtypeStruct with a sharding, which says where the "
            "checkpoint's value is placed"
        )

    return jax.tree_util.tree_map_with_path(leaf, target)


def _check_fits(saved: Any, abstract: Any, where: str) -> None:
    """Raise `ValueError` naming every leaf where `abstract` and the saved tree differ."""
    saved = ocp.tree.to_flat_dict(saved)
    wanted = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract, keep_empty_nodes=False))
    problems = []
    for key in sorted(wanted.keys() | saved.keys()):
        name = "/".join(key)
        if key not in saved:
            problems.append(f"{name} is not in the checkpoint")
        elif key not in wanted:
            problems.append(f"{name} is in the checkpoint but not in the target")
        elif tuple(saved[key].shape) != tuple(wanted[key].shape):
            problems.append(
                f"{name} has shape {tuple(saved[key].shape)} in the checkpoint but "
                f"{tuple(wanted[key].shape)} in the target"
            )
    if problems:
        raise ValueError(f"the checkpoint {where} does not fit the target: " + "; ".join(problems))


class CheckpointManager:
    """Numbered checkpoints of a state pytree (and a JSON dict of extras) in `directory`.

    Args:
      directory: where the checkpoints go, one subdirectory per step; created if missing.
      max_to_keep: how many of the newest checkpoints to keep (None: all). An old one is
        deleted only after a newer one is complete.
      save_interval_steps: `save` writes only at steps that are multiples of this (unless
        `force=True`).
      async_save: write in a background thread; `save` returns once the arrays are copied off
        the devices, so training goes on while the files are written.
      read_only: only restore: nothing in `directory` is created, changed or cleaned up.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        read_only: bool = False,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"max_to_keep must be a positive int or None, got {max_to_keep!r}")
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ValueError(
                f"save_interval_steps must be a positive int, got {save_interval_steps!r}"
            )
        self.directory = os.path.abspath(directory)
        self.save_interval_steps = save_interval_steps
        self.read_only = read_only
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
            enable_async_checkpointing=async_save,
            create=not read_only,
            # Left by a killed save, never loaded; only a writer may delete them (a reader
            # could delete the files of a save in progress).
            cleanup_tmp_directories=not read_only,
        )
        handlers = {STATE: ocp.StandardCheckpointHandler(), EXTRA: ocp.JsonCheckpointHandler()}
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )

    def save(
        self, step: int, state: Any, extra: dict[str, Any] | None = None, *, force: bool = False
    ) -> bool:
        """Save `state` (a pytree of arrays) and `extra` (JSON-able, e.g. the data position)
        as checkpoint `step`, if `step` is a multiple of `save_interval_steps` or `force`.

        Returns whether a save was started. With `async_save`, it completes in the background;
        `wait_until_finished` or `close` waits for it.

        Raises:
          ValueError: if checkpoint `step` already exists (orbax's `StepAlreadyExistsError`).
        """
        if self.read_only:
            raise ValueError(f"the CheckpointManager of {self.directory} is read-only")
        step = int(step)
        if step % self.save_interval_steps and not force:
            return False  # decided here: asking orbax costs as much as a small training step
        args = ocp.args.Composite(
            **{STATE: ocp.args.StandardSave(state), EXTRA: ocp.args.JsonSave(extra or {})}
        )
        return self._manager.save(step, args=args, force=True)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """`(state, extra)` of checkpoint `step` (default the latest complete one).

        `target` gives the tree, shapes and placement: a pytree like the saved state whose
        leaves are `jax.Array`s (e.g. a freshly initialised state) or `jax.ShapeDtypeStruct`s
        with shardings. Values are placed with the target's shardings and cast to its dtypes.

        Raises:
          FileNotFoundError: if there is no such checkpoint.
          ValueError: if the target's tree or shapes differ from the checkpoint's.
        """
        steps = self._manager.all_steps()
        if step is None:
            step = self._manager.latest_step()
        if step is None or step not in steps:
            raise FileNotFoundError(
                f"no checkpoint {'' if step is None else f'{step} '}in {self.directory} "
                f"(complete checkpoints: {sorted(steps) or 'none'})"
            )
        abstract = _abstract(target)
        where = os.path.join(self.directory, str(step))
        _check_fits(self._manager.item_metadata(step)[STATE].tree, abstract, where)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{STATE: ocp.args.StandardRestore(abstract), EXTRA: ocp.args.JsonRestore()}
            ),
        )
        return restored[STATE], restored[EXTRA]

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of all complete checkpoints, oldest first."""
        return sorted(self._manager.all_steps())

    def wait_until_finished(self) -> None:
        """Block until a background save is complete (and old checkpoints are deleted)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish outstanding saves and release the manager's threads."""
        self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def save_persistables(dirname: str | os.PathLike[str], state: Any) -> None:
    """Save `state` (a pytree of arrays, e.g. a `TrainState`) to `dirname`, replacing what a
    previous call saved there; Paddle's `fleet.save_persistables`.

    The replacement is atomic: `dirname` holds numbered versions, and the older one is
    deleted only once the new one is complete. Returns when the files are written.
    """
    with CheckpointManager(dirname, max_to_keep=1, async_save=False) as manager:
        version = (manager.latest_step() or 0) + 1
        manager.save(version, state, force=True)


def load_persistables(dirname: str | os.PathLike[str], target: Any) -> Any:
    """The state last saved in `dirname` (by `save_persistables`, or the newest checkpoint of
    a `CheckpointManager`), placed like `target` (see `CheckpointManager.restore`)."""
    with CheckpointManager(dirname, read_only=True) as manager:
        return manager.restore(target)[0]
