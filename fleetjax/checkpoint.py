"""Checkpoints that survive crashes and refuse corruption, on orbax: Paddle's
`fleet.save_persistables` and a `CheckpointManager` that keeps the last N, saves every k steps in
the background and records extra metadata (such as the data position) with the state.

Every save is atomic: orbax writes `<step>.orbax-checkpoint-tmp` and renames it to `<step>`
once complete, so a process killed during a save leaves the previous checkpoint as the latest.
Each checkpoint holds a manifest, `<step>/fleetjax/manifest.json`, with a checksum of every
array (and of the extras); a restore recomputes them and raises `CorruptCheckpointError`, naming
the step, the directory and what is wrong, rather than return damaged values. The manifest is
also the marker of a checkpoint this module wrote: other folders in the directory are never
listed, overwritten or deleted. Old checkpoints are deleted by renaming them out of the listing
first, so a kill during a deletion never leaves a half-deleted checkpoint listed. One writer at a
time: a writer holds an exclusive lock on `<directory>/.fleetjax-lock`.

A restore places each leaf as the target says (`jax.Array`s, or `jax.ShapeDtypeStruct`s with
a sharding), so a checkpoint saved on one mesh restores onto another (dp=8 onto dp=2 x mp=4,
replicated onto ZeRO-sharded, 8 devices onto 4). Saving and restoring are collective: with
several processes, all of them make the same calls with the same directory.

    manager = CheckpointManager("ckpt", max_to_keep=3, save_interval_steps=100)
    resumed = manager.resume(state)  # `state`: a fresh TrainState; None: nothing to resume
    if resumed is not None:
        step, state, extra = resumed
    ...
    manager.save(step, state, extra={"data_position": position})  # every 100 steps
    manager.close()
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import operator
import os
import shutil
import socket
import stat
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax import lax

from fleetjax import _coordinator
from fleetjax._warnings import user_stacklevel

STATE, EXTRA, MANIFEST = "state", "extra", "fleetjax"  # the items of every checkpoint
MANIFEST_FILE = "manifest.json"  # in the MANIFEST item: the marker and the checksums
LOCK_FILE = ".fleetjax-lock"
_ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax writes it in every step folder
_TRASH_PREFIX = ".fleetjax-deleting-"  # an old checkpoint on its way out: never listed
_ASIDE_PREFIX = "corrupt-"  # a damaged checkpoint moved out of the listing: kept, never deleted
_FORMAT = 1


class CorruptCheckpointError(RuntimeError):
    """A checkpoint that is proven damaged (a checksum that does not match, contents that do
    not decode, a missing file or manifest), or none intact; the message names the step, the
    directory, what is wrong and the earlier steps."""


class UnreadableCheckpointError(OSError):
    """A checkpoint whose files cannot be read now (no permission, an I/O error, a lost
    mount): not proof of damage, so nothing is set aside; the message names the file and the
    cause."""


# Tensorstore's codes (and its and zstd's words) for files that are missing or do not decode:
# proof of damage. Others (PERMISSION_DENIED, UNAVAILABLE, an OS error of the access) are not.
_DAMAGE_CODES = ("NOT_FOUND", "DATA_LOSS", "OUT_OF_RANGE")
_DAMAGE_WORDS = ("Data corruption detected", "Invalid JSON", "Error decoding")


def _proves_damage(error: BaseException) -> bool:
    """Whether a read error proves the files damaged: a missing file, contents that do not
    decode. A refused or failed access (a permission, an I/O error, a lost mount) does not."""
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    for e in seen:
        if isinstance(e, FileNotFoundError | json.JSONDecodeError | UnicodeDecodeError):
            return True
        if isinstance(e, OSError):
            return False
    text = str(seen[-1]) if seen else ""
    return text.startswith(_DAMAGE_CODES) or any(word in text for word in _DAMAGE_WORDS)


def _step_number(step: Any) -> int:
    """`step` as an int: an int, a numpy int or an integer 0-d array, never negative."""
    is_bool = isinstance(step, bool) or np.asarray(step).dtype == bool
    try:
        number = None if is_bool else operator.index(step)
    except TypeError:
        number = None
    if number is None:
        raise TypeError(f"step must be a non-negative int, got {step!r} ({type(step).__name__})")
    if number < 0:
        raise ValueError(f"step must be a non-negative int, got {number}")
    return number


def _count(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Raise `ValueError` unless `value` is a positive int (or None where allowed)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a positive int or None" if allow_none else "a positive int"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


# -- checksums -------------------------------------------------------------------------------
# A checksum per array, computed by XLA on the arrays where they are, so it is the same for
# any sharding (each device sums its part; integer sums are exact in any order) and costs one
# pass over device memory. Each 32-bit word w at flat position i adds mix(w ^ mix(i * K + lane))
# modulo 2**32, in two lanes (64 bits): mix (murmur3's finaliser) is a bijection, so any change
# to one word changes the sum, and moved or several changed words go unnoticed with odds 2**-64.
def _mix(h: jax.Array) -> jax.Array:
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The bits of `x` as uint32 words (64-bit values as two)."""
    if jnp.iscomplexobj(x):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    bits = jax.dtypes.itemsize_bits(x.dtype)
    if bits > 32:
        return lax.bitcast_convert_type(x, jnp.uint32)
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}")).astype(jnp.uint32)


@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
    words = _words(jnp.asarray(x))
    position = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(words.ndim)):
        position += lax.broadcasted_iota(jnp.uint32, words.shape, axis) * jnp.uint32(stride)
        stride = stride * words.shape[axis] % 2**32
    lanes = [_mix(words ^ _mix(position * jnp.uint32(0x9E3779B9) + lane)) for lane in (1, 2)]
    return jnp.stack([jnp.sum(lane, dtype=jnp.uint32) for lane in lanes])


def _leaf_name(path: tuple[Any, ...]) -> str:
    """A leaf's name as orbax writes it: keys, attribute names and indices joined by '/'."""
    keys = (getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
    return "/".join(str(k) for k in keys)


def _checksums(tree: Any) -> dict[str, str]:
    """{leaf name: 16 hex digits} for every array of `tree`."""
    named = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, x in named:
        if not isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex)):
            raise TypeError(
                f"state{jax.tree_util.keystr(path)} is {type(x).__name__}; each leaf of a "
                "checkpointed state must be an array or a number"
            )
    sums = jax.device_get([_checksum(x) for _, x in named])
    return {
        _leaf_name(path): f"{int(low):08x}{int(high):08x}"
        for (path, _), (low, high) in zip(named, sums, strict=True)
    }


def _json_checksum(extra: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(extra, sort_keys=True).encode()).hexdigest()


# -- the directory ---------------------------------------------------------------------------
class _Lock:
    """An exclusive `flock` on `<directory>/.fleetjax-lock`, which names its holder.

    The kernel releases it when the holder exits in any way (SIGKILL included), so a lock file
    left behind is never stale: the next writer takes it.
    """

    def __init__(self, directory: str) -> None:
        path = os.path.join(directory, LOCK_FILE)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 1024, 0).decode(errors="replace") or "unknown"
            self.release()
            raise RuntimeError(
                f"{directory} is being written by another CheckpointManager ({holder}, lock "
                f"{path}); one writer at a time: close it first, or open this one with "
                "read_only=True"
            ) from None
        holder = f"pid {os.getpid()} on {socket.gethostname()}"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, holder.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the lock; the file stays (deleting it would race)
            self._fd = None


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
      read_only: only restore: nothing in `directory` is created, changed, locked or cleaned up.
      start_over: where no intact checkpoint is left (every one damaged, or set aside by an
        earlier run), `resume` trains from step 0 (None, with a warning) instead of raising,
        and a writer opens such a directory instead of refusing it.

    Raises:
      RuntimeError: if another writer (in this process or another) holds the directory.
      CorruptCheckpointError: for a writer, if every checkpoint of the directory was set aside
        as damaged (and not `start_over`): a restart must not train from step 0 unnoticed.
      UnreadableCheckpointError: if the directory cannot be listed, or links to nothing.
      ValueError: if the directory holds the checkpoints of `save_persistables` (or, for
        `save_persistables`, those of a `CheckpointManager`).
    """

    _WRITER = "CheckpointManager"  # recorded in each manifest; one kind of writer per directory

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
        read_only: bool = False,
        start_over: bool = False,
    ) -> None:
        _count("max_to_keep", max_to_keep, allow_none=True)
        _count("save_interval_steps", save_interval_steps)
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        self.read_only = read_only
        self.start_over = start_over
        self._lock: _Lock | None = None
        self._check_reachable()
        # A writer's processes open the directory together (a reader may be alone).
        refused = "" if read_only else _coordinator.share("checkpoint-open", self._open)
        if refused:
            raise CorruptCheckpointError(refused)
        handler = self._handler = ocp.CompositeCheckpointHandler(
            **{
                STATE: ocp.StandardCheckpointHandler(),
                EXTRA: ocp.JsonCheckpointHandler(),
                MANIFEST: ocp.JsonCheckpointHandler(filename=MANIFEST_FILE),
            }
        )
        if async_save:
            # Directories made in `save` itself: a failure there is raised at once, and none
            # is left for the background threads, whose failure would stall orbax's signals.
            options = ocp.options.AsyncOptions(create_directories_asynchronously=False)
            self._checkpointer = ocp.AsyncCheckpointer(handler, async_options=options)
        else:
            self._checkpointer = ocp.Checkpointer(handler)
        self._finishing: threading.Thread | None = None  # completes a background save
        self._failure: tuple[int, BaseException] | None = None  # of the last background save
        self._closed = False

    def _open(self) -> str:
        """On process 0: take the directory for writing; why it is refused ("" if it is not)."""
        self._lock = self._take_directory()
        listing = self._listing()
        if listing["aside"] and not listing["steps"] and not self.start_over:
            self._lock.release()
            return self._nothing_intact(listing["aside"])
        return ""

    def _check_reachable(self) -> None:
        """Raise `UnreadableCheckpointError` if the directory is a link to nothing (a mount
        that is not there): not the empty directory of a first run."""
        if os.path.islink(self.directory) and not os.path.exists(self.directory):
            raise UnreadableCheckpointError(
                f"checkpoint directory {self.directory} links to "
                f"{os.path.realpath(self.directory)}, which does not exist (a mount that is not "
                "there?); nothing was read or written"
            )

    def _nothing_intact(self, aside: list[str]) -> str:
        return (
            f"no intact checkpoint in {self.directory}: every one was set aside as damaged "
            f"({', '.join(aside)}), so there is nothing to resume from; to train from step 0 "
            "here, pass CheckpointManager(..., start_over=True) (or move those folders out)"
        )

    def _take_directory(self) -> _Lock:
        """Create, lock and check the directory for writing; clean up after killed writers."""
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise NotADirectoryError(f"checkpoint directory {self.directory} is a file")
        os.makedirs(self.directory, exist_ok=True)
        lock = _Lock(self.directory)
        try:
            self._check_writer()
        except ValueError:
            lock.release()
            raise
        self._clean_up()
        orphans = self._listing()["orphans"]
        for step, where in self._move_aside(orphans).items():
            self._warn_skipped(int(step), self._orphan_problem(int(step)), where)
        return lock

    # -- listing -----------------------------------------------------------------------------
    def _path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _manifest_path(self, step: int) -> str:
        return os.path.join(self._path(step), MANIFEST, MANIFEST_FILE)

    def all_steps(self) -> list[int]:
        """The steps of all complete checkpoints, oldest first: the folders `<step>/` that hold
        a `fleetjax/` manifest folder (others, such as a user's `5/`, are not checkpoints), as
        this process lists them (`resume` and `restore` use process 0's listing)."""
        return self._listing()["steps"]

    def _listing(self) -> dict[str, list[Any]]:
        """This process's view of the directory: the checkpoints' steps, the orphans' (step
        folders that orbax wrote but that have no manifest: deleted, or written by a fleetjax
        without manifests; damaged checkpoints, never a user's folder), and the folders of
        checkpoints set aside, each sorted.

        A step whose manifest folder cannot be checked (no permission, an I/O error) is listed
        as a checkpoint: reading it says why, rather than skipping it for an older one.
        """
        try:
            names = os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            names = []
        except OSError as e:
            raise UnreadableCheckpointError(
                f"checkpoint directory {self.directory} cannot be listed ({e})"
            ) from e
        kinds: dict[str, list[int]] = {"checkpoint": [], "orphan": [], "": []}
        for name in names:
            if name.isascii() and name.isdigit() and name == str(int(name)):
                kinds[self._kind(int(name))].append(int(name))
        aside = [n for n in names if n.startswith(_ASIDE_PREFIX)]
        return {
            "steps": sorted(kinds["checkpoint"]),
            "orphans": sorted(kinds["orphan"]),
            "aside": sorted(aside),
        }

    def _kind(self, step: int) -> str:
        """'checkpoint', 'orphan' or '' (not a checkpoint) for the folder of `step`."""
        try:
            mode = os.stat(os.path.join(self._path(step), MANIFEST)).st_mode
        except (FileNotFoundError, NotADirectoryError):
            metadata = os.path.join(self._path(step), _ORBAX_STEP_METADATA)
            return "orphan" if os.path.exists(metadata) else ""
        except OSError:
            return "checkpoint"
        return "checkpoint" if stat.S_ISDIR(mode) else ""

    def _orphan_problem(self, step: int) -> str:
        return (
            f"{self._path(step)} holds orbax's files but no {MANIFEST}/{MANIFEST_FILE} (deleted, "
            "or written by a fleetjax without manifests), so it cannot be verified"
        )

    def _move_aside(self, steps: list[int]) -> dict[str, str]:
        """Move checkpoints `steps` out of the listing (kept, never deleted), so that each
        step can be saved again: process 0 of a writer does; {step: where it went}."""
        if self.read_only or jax.process_index():
            return {}
        moved = {}
        for step in steps:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            aside = f"{_ASIDE_PREFIX}{step}-{stamp}-{uuid.uuid4().hex[:6]}"
            os.rename(self._path(step), os.path.join(self.directory, aside))
            moved[str(step)] = os.path.join(self.directory, aside)
        return moved

    def _warn_skipped(self, step: int, problem: str, where: str | None) -> None:
        moved = f"; moved to {where} (kept for a look; step {step} can be saved again)"
        warnings.warn(
            f"skipping checkpoint {step}: {problem}{moved if where else ''}",
            RuntimeWarning,
            stacklevel=user_stacklevel(),
        )

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _check_writer(self) -> None:
        """Refuse a directory that holds another kind of writer's checkpoints."""
        others: dict[str, list[int]] = {}
        for step in self.all_steps():
            try:
                writer = self._manifest(step)["writer"]
            except (CorruptCheckpointError, UnreadableCheckpointError, KeyError, TypeError):
                continue  # reported when restored
            if writer != self._WRITER:
                others.setdefault(str(writer), []).append(step)
        if others:
            writer, steps = next(iter(others.items()))
            raise ValueError(
                f"{self.directory} holds checkpoints {steps} written by {writer}, which a "
                f"{self._WRITER} would replace or delete; use another directory"
            )

    def _clean_up(self) -> None:
        """Delete what killed saves and deletions left (this writer's own names only)."""
        for name in os.listdir(self.directory):
            base = name.partition(ocp.path.step.TMP_DIR_SUFFIX)[0]
            if name.startswith(_TRASH_PREFIX) or (base.isdigit() and base != name):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def _prune(self) -> None:
        """Delete all but the newest `max_to_keep` checkpoints: each is renamed out of the
        listing (atomic) before its files are deleted."""
        if self.max_to_keep is None or jax.process_index() != 0:
            return
        for step in self.all_steps()[: -self.max_to_keep]:
            trash = os.path.join(self.directory, f"{_TRASH_PREFIX}{step}-{uuid.uuid4().hex}")
            os.rename(self._path(step), trash)
            shutil.rmtree(trash)

    # -- saving ------------------------------------------------------------------------------
    def save(
        self, step: int, state: Any, extra: dict[str, Any] | None = None, *, force: bool = False
    ) -> bool:
        """Save `state` (a pytree of arrays) and `extra` (JSON-able, e.g. the data position)
        as checkpoint `step`, if `step` is a multiple of `save_interval_steps` or `force`.

        Returns whether a save was started. With `async_save`, it completes in the background;
        `wait_until_finished` or `close` waits for it.

        Raises:
          TypeError, ValueError: if `step` is not a non-negative int.
          ValueError: if checkpoint `step` already exists, a folder that is not a checkpoint
            has its name, or `max_to_keep` newer checkpoints exist (it would be deleted at once).
          RuntimeError: if the previous background save failed.
        """
        if self.read_only or self._closed:
            state_name = "read-only" if self.read_only else "closed"
            raise ValueError(f"the CheckpointManager of {self.directory} is {state_name}")
        step = _step_number(step)
        if step % self.save_interval_steps and not force:
            return False  # decided here: asking orbax costs as much as a small training step
        self.wait_until_finished()
        steps = self.all_steps()
        if step in steps:
            raise ValueError(f"checkpoint {step} already exists in {self.directory}")
        newer = [s for s in steps if s > step]
        if self.max_to_keep is not None and len(newer) >= self.max_to_keep:
            # It would be the oldest of more than max_to_keep, deleted as soon as it is written.
            raise ValueError(
                f"checkpoint {step} would be deleted at once: {self.directory} keeps the newest "
                f"max_to_keep={self.max_to_keep} and holds {len(newer)} newer ({newer}); save "
                "under a step after them, or raise max_to_keep"
            )
        if os.path.lexists(self._path(step)):
            raise ValueError(
                f"{self._path(step)} exists and is not a checkpoint (it has no {MANIFEST}/ "
                "folder); move it away or save under another step"
            )
        extra = extra or {}
        try:
            extra_sha256 = _json_checksum(extra)
        except (TypeError, ValueError) as e:
            raise TypeError(f"extra is not JSON-able: {e}") from None
        manifest = {
            "format": _FORMAT,
            "writer": self._WRITER,
            "step": step,
            "checksums": _checksums(state),
            "extra_sha256": extra_sha256,
        }
        args = {
            STATE: ocp.args.StandardSave(state),
            EXTRA: ocp.args.JsonSave(extra),
            MANIFEST: ocp.args.JsonSave(manifest),
        }
        try:
            self._checkpointer.save(self._path(step), args=ocp.args.Composite(**args))
        except Exception as e:  # orbax and tensorstore raise many kinds
            raise RuntimeError(
                f"saving checkpoint {step} in {self.directory} failed ({_reason(e)})"
            ) from e
        if isinstance(self._checkpointer, ocp.AsyncCheckpointer):
            self._finishing = threading.Thread(
                target=self._finish, args=(step,), name=f"fleetjax-checkpoint-{step}"
            )
            self._finishing.start()
        else:
            self._prune()
        return True

    def _finish(self, step: int) -> None:
        """In the background: wait for the save of `step` to be complete, then prune."""
        try:
            self._checkpointer.wait_until_finished()
            self._prune()
        except BaseException as e:  # re-raised by wait_until_finished
            self._failure = (step, e)

    def wait_until_finished(self) -> None:
        """Block until a background save is complete (and old checkpoints are deleted).

        Raises:
          RuntimeError: if it failed (the checkpoint is then not listed).
        """
        if self._finishing is not None:
            self._finishing.join()
            self._finishing = None
        if self._failure is not None:
            (step, error), self._failure = self._failure, None
            raise RuntimeError(
                f"saving checkpoint {step} in {self.directory} failed ({_reason(error)})"
            ) from error

    def close(self) -> None:
        """Finish outstanding saves, release the directory and the manager's threads."""
        try:
            self.wait_until_finished()
        finally:
            self._checkpointer.close()
            if self._lock is not None:
                self._lock.release()
            self._closed = True

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- restoring ---------------------------------------------------------------------------
    def _corrupt(self, step: int, problem: str) -> CorruptCheckpointError:
        earlier = [s for s in self.all_steps() if s < step]
        hint = (
            f"earlier checkpoints: {earlier}; restore_latest_intact(target) restores the "
            "newest one that is intact"
            if earlier
            else "there is no earlier checkpoint"
        )
        return CorruptCheckpointError(
            f"checkpoint {step} in {self.directory} is corrupt: {problem}; {hint}"
        )

    def _read_error(self, step: int, problem: str, error: BaseException) -> Exception:
        """The error for a read of checkpoint `step` that failed with `error`: corrupt where
        that proves damage (and the step's folder is still there), else unreadable."""
        if _proves_damage(error) and os.path.isdir(self._path(step)):
            return self._corrupt(step, problem)
        return UnreadableCheckpointError(
            f"checkpoint {step} in {self.directory} cannot be read: {problem}. That is no proof "
            "of damage, so nothing was set aside: make it readable and restore again (if it is "
            f"damaged, move {self._path(step)} out of the directory)"
        )

    def _manifest(self, step: int) -> dict[str, Any]:
        path = self._manifest_path(step)
        try:
            with open(path, encoding="utf-8") as f:
                manifest = json.load(f)
        except (OSError, ValueError) as e:
            raise self._read_error(step, f"its manifest {path} cannot be read ({e})", e) from None
        keys = {"format", "writer", "step", "checksums", "extra_sha256"}
        if not isinstance(manifest, dict) or not keys <= manifest.keys():
            raise self._corrupt(step, f"its manifest {path} lacks {sorted(keys)}")
        if not isinstance(manifest["checksums"], dict):
            raise self._corrupt(step, f"its manifest {path} has no table of checksums")
        if manifest["step"] != step:
            raise self._corrupt(step, f"its manifest {path} is that of step {manifest['step']}")
        return manifest

    def _saved_arrays(self, step: int) -> dict[str, Any]:
        """{leaf name: orbax's ArrayMetadata (shape, dtype)} of checkpoint `step`."""
        where = os.path.join(self._path(step), STATE)
        try:
            metadata = self._checkpointer.metadata(self._path(step)).item_metadata[STATE]
        except Exception as e:  # orbax and tensorstore raise many kinds
            problem = f"the array metadata in {where} cannot be read ({_reason(e)})"
            raise self._read_error(step, problem, e) from e
        if metadata is None:  # orbax's answer when it cannot find state/_METADATA
            path = os.path.join(where, "_METADATA")
            try:
                os.stat(path)
            except FileNotFoundError as e:  # proof
                raise self._read_error(step, f"the array metadata {path} is missing", e) from None
            except OSError as e:  # not to be seen now: no proof
                problem = f"the array metadata {path} cannot be read ({e.strerror})"
                raise self._read_error(step, problem, e) from None
            raise self._corrupt(step, f"orbax finds no array metadata in {where}")
        return {"/".join(k): v for k, v in ocp.tree.to_flat_dict(metadata.tree).items()}

    def _agreed_listing(self) -> dict[str, list[Any]]:
        """Process 0's listing of the directory (`_listing`), on every process."""
        return _coordinator.share("checkpoint-listing", self._listing)

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """`(state, extra)` of checkpoint `step` (default the latest complete one), verified
        against the checksums saved with it.

        `target` gives the tree, shapes and placement: a pytree like the saved state whose
        leaves are `jax.Array`s (e.g. a freshly initialised state) or `jax.ShapeDtypeStruct`s
        with shardings. Values are placed with the target's shardings and cast to its dtypes.
        With several processes, the latest step is process 0's, and every process raises if
        any one's read fails.

        Raises:
          FileNotFoundError: if there is no such checkpoint.
          ValueError: if the target's tree or shapes differ from the checkpoint's.
          CorruptCheckpointError: if the checkpoint is proven damaged: a file is missing or
            does not decode, or an array or the extras do not match their checksums.
          UnreadableCheckpointError: if a file cannot be read (no permission, an I/O error).
        """
        step = None if step is None else _step_number(step)
        steps = self._agreed_listing()["steps"]
        step = (steps[-1] if steps else None) if step is None else step
        if step is None or step not in steps:
            raise FileNotFoundError(self._missing(step, steps))
        return self._restore_together(target, step)

    def _restore_together(self, target: Any, step: int) -> tuple[Any, dict[str, Any]]:
        """`restore` of `step` on every process: each reads its part, and none verifies (a
        collective) or returns until all have read, so that a failure anywhere is raised
        everywhere."""
        abstract = _abstract(target)
        state, extra, manifest = _settled("read", lambda: self._read_step(step, abstract))
        _settled("verify", lambda: self._verify(step, manifest, state, extra))
        state = jax.tree.map(
            lambda x, want: x if x.dtype == want.dtype else x.astype(want.dtype), state, abstract
        )
        return state, extra

    def _read_step(self, step: int, abstract: Any) -> tuple[Any, Any, dict[str, Any]]:
        """(state, extras, manifest) of checkpoint `step` as this process reads them."""
        manifest = self._manifest(step)
        saved = self._saved_arrays(step)
        _check_fits(saved, abstract, self._path(step))
        as_saved = jax.tree_util.tree_map_with_path(
            lambda path, x: jax.ShapeDtypeStruct(
                x.shape,
                jax.dtypes.canonicalize_dtype(saved[_leaf_name(path)].dtype),
                sharding=x.sharding,
            ),
            abstract,
        )
        state = self._read(step, STATE, ocp.args.StandardRestore(as_saved))
        extra = self._read(step, EXTRA, ocp.args.JsonRestore())
        return state, extra, manifest

    def _read(self, step: int, item: str, args: ocp.args.CheckpointArgs) -> Any:
        """Item `item` of checkpoint `step`, read by orbax's handler (its checkpointer's
        restore ends in a barrier that a process whose read failed would never reach)."""
        try:
            composite = ocp.args.Composite(**{item: args})
            return self._handler.restore(epath.Path(self._path(step)), args=composite)[item]
        except Exception as e:  # orbax and tensorstore raise many kinds
            where = os.path.join(self._path(step), item)
            raise self._read_error(step, f"{where} cannot be read ({_reason(e)})", e) from e

    def _missing(self, step: int | None, steps: list[int]) -> str:
        message = (
            f"no checkpoint {'' if step is None else f'{step} '}in {self.directory} "
            f"(complete checkpoints: {steps or 'none'})"
        )
        if step is not None and os.path.lexists(self._path(step)):
            message += f"; {self._path(step)} has no {MANIFEST}/ folder: it is not a checkpoint"
        return message

    def _verify(self, step: int, manifest: dict[str, Any], state: Any, extra: Any) -> None:
        saved, read = manifest["checksums"], _checksums(state)
        problems = [
            f"{name} does not match its checksum (saved {saved.get(name)}, read {value})"
            for name, value in read.items()
            if saved.get(name) != value
        ]
        problems += [f"{name} has a checksum but was not read" for name in saved.keys() - read]
        if _json_checksum(extra) != manifest["extra_sha256"]:
            problems.append(f"the extras ({EXTRA}/) do not match their checksum")
        if problems:
            raise self._corrupt(step, "; ".join(problems))

    def _newest_intact(
        self, target: Any, listing: dict[str, list[Any]]
    ) -> tuple[tuple[int, Any, dict[str, Any]] | None, list[str]]:
        """(step, state, extra) of the newest checkpoint of `listing` that restores intact
        (None if none does), and what is wrong with each newer one; those are skipped with a
        warning, and a writer moves them aside. An unreadable one stops the search (raised,
        nothing moved): it may be the newest intact one."""
        orphans = listing["orphans"]
        damaged = {step: self._orphan_problem(step) for step in orphans}
        found = None
        for step in sorted({*listing["steps"], *orphans}, reverse=True):
            if step in damaged:
                continue
            try:
                found = (step, *self._restore_together(target, step))
                break
            except CorruptCheckpointError as e:
                damaged[step] = str(e)
        skipped = sorted((s for s in damaged if found is None or s > found[0]), reverse=True)
        # Agreed, so every process asks; process 0 moves them before any process goes on.
        moved = _coordinator.share("checkpoint-set-aside", lambda: self._move_aside(skipped))
        for step in skipped:
            self._warn_skipped(step, damaged[step], moved.get(str(step)))
        return found, [damaged[step] for step in skipped]

    def restore_latest_intact(self, target: Any) -> tuple[int, Any, dict[str, Any]]:
        """`(step, state, extra)` of the newest checkpoint that restores intact: each newer
        one that is proven damaged (`CorruptCheckpointError`), or that lost its manifest, is
        skipped with a warning saying why, and a writer moves it aside (to
        `corrupt-<step>-<time>-<id>` in the directory: kept, never listed), so that training
        on can save that step again. With several processes, process 0 lists the directory
        and all agree on each step's verdict before anything is moved.

        Raises:
          FileNotFoundError: if there is no checkpoint.
          CorruptCheckpointError: if none is intact (naming what is wrong with each).
          UnreadableCheckpointError: if a checkpoint newer than the intact ones cannot be read
            (nothing is moved).
          ValueError: if the target's tree or shapes differ from a checkpoint's.
        """
        listing = self._agreed_listing()
        if not listing["steps"] and not listing["orphans"]:
            raise FileNotFoundError(self._missing(None, listing["steps"]))
        found, problems = self._newest_intact(target, listing)
        if found is None:
            raise CorruptCheckpointError(
                f"no intact checkpoint in {self.directory}: " + " | ".join(problems)
            )
        return found

    def resume(self, target: Any) -> tuple[int, Any, dict[str, Any]] | None:
        """`(step, state, extra)` to resume training from: the newest intact checkpoint, as
        `restore_latest_intact` finds it (newer damaged ones set aside); None where there is
        nothing to resume from (no checkpoint, and none set aside as damaged). The resume of a
        training loop, decided once for all processes (process 0 lists the directory, all
        agree on each step's verdict through JAX's coordination service).

        When no intact checkpoint is left (all damaged now, or set aside by an earlier run),
        it raises rather than let training start over from step 0 unnoticed; with
        `start_over=True` it warns and returns None.

        Raises:
          CorruptCheckpointError: if checkpoints were saved but none is intact (naming what is
            wrong with each), unless `start_over`.
          UnreadableCheckpointError: if a checkpoint newer than the intact ones cannot be read
            (nothing is moved).
          ValueError: if the target's tree or shapes differ from a checkpoint's.
        """
        listing = self._agreed_listing()
        if not listing["steps"] and not listing["orphans"]:
            problem = self._nothing_intact(listing["aside"]) if listing["aside"] else ""
        else:
            found, problems = self._newest_intact(target, listing)
            if found is not None:
                return found
            problem = (
                f"no intact checkpoint in {self.directory}: {' | '.join(problems)}; nothing to "
                "resume from: to train from step 0 here, pass "
                "CheckpointManager(..., start_over=True)"
            )
        if problem and not self.start_over:
            raise CorruptCheckpointError(problem)
        if problem:
            warnings.warn(
                f"{problem}; start_over=True: training starts over", stacklevel=user_stacklevel()
            )
        return None


def _settled(what: str, read: Callable[[], Any]) -> Any:
    """`read()`'s value once every process's `read()` returned; else the error of the first
    process that raised, on every process (its own error where it raised)."""
    try:
        value, failure = read(), None
    except (CorruptCheckpointError, UnreadableCheckpointError, ValueError, TypeError) as e:
        value, failure = None, e
    own = None if failure is None else [type(failure).__name__, str(failure)]
    outcomes = _coordinator.gather(f"checkpoint-{what}", own)
    if failure is not None:
        try:
            raise failure
        finally:  # no cycle through this frame: orbax's futures in its traceback go at once
            failure = None
    for process, outcome in enumerate(outcomes):
        if outcome is not None:
            kind, message = outcome
            error = _ERRORS.get(kind, RuntimeError)
            raise error(f"{message} (on process {process})")
    return value


_ERRORS: dict[str, type[Exception]] = {
    error.__name__: error
    for error in (CorruptCheckpointError, UnreadableCheckpointError, ValueError, TypeError)
}


def _reason(error: BaseException) -> str:
    """The innermost cause of an orbax or tensorstore error, in one line (without the spec
    that tensorstore appends)."""
    while (cause := error.__cause__) is not None:
        error = cause
    text = str(error).strip().partition("\n")[0].partition(" [tensorstore_spec=")[0]
    return f"{type(error).__name__}: {text}"


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


def _check_fits(saved: dict[str, Any], abstract: Any, where: str) -> None:
    """Raise `ValueError` naming every leaf where `abstract` and the saved arrays differ."""
    wanted = {_leaf_name(p): x for p, x in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    problems = []
    for name in sorted(wanted.keys() | saved.keys()):
        if name not in saved:
            problems.append(f"{name} is not in the checkpoint")
        elif name not in wanted:
            problems.append(f"{name} is in the checkpoint but not in the target")
        elif tuple(saved[name].shape) != tuple(wanted[name].shape):
            problems.append(
                f"{name} has shape {tuple(saved[name].shape)} in the checkpoint but "
                f"{tuple(wanted[name].shape)} in the target"
            )
    if problems:
        raise ValueError(f"the checkpoint {where} does not fit the target: " + "; ".join(problems))


class _Persistables(CheckpointManager):
    """The one-slot manager of `save_persistables`: its own kind of writer."""

    _WRITER = "save_persistables"


def save_persistables(dirname: str | os.PathLike[str], state: Any) -> None:
    """Save `state` (a pytree of arrays, e.g. a `TrainState`) to `dirname`, replacing what a
    previous call saved there; Paddle's `fleet.save_persistables`.

    The replacement is atomic: `dirname` holds numbered versions, and the older one is
    deleted only once the new one is complete. Returns when the files are written.

    Raises:
      ValueError: if `dirname` holds a `CheckpointManager`'s checkpoints (which this would
        delete).
    """
    with _Persistables(dirname, max_to_keep=1, async_save=False) as manager:
        manager.save((manager.latest_step() or 0) + 1, state, force=True)


def load_persistables(dirname: str | os.PathLike[str], target: Any) -> Any:
    """The state last saved in `dirname` (by `save_persistables`, or the newest checkpoint of
    a `CheckpointManager`), placed like `target` (see `CheckpointManager.restore`)."""
    with CheckpointManager(dirname, read_only=True) as manager:
        return manager.restore(target)[0]
