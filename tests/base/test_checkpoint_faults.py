"""fleetjax.checkpoint under faults: damaged files, foreign folders, bad step numbers, two
writers, kills during a deletion, a failing background save, resuming from damaged, unreadable
or no intact checkpoints, and (slow) a loop of kills at random moments of saving."""

import json
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_worker import value
from read_only import read_only, unreadable, unreadable_by

from fleetjax.checkpoint import (
    CheckpointManager,
    CorruptCheckpointError,
    UnreadableCheckpointError,
    load_persistables,
    save_persistables,
)

HERE = pathlib.Path(__file__).parents[1]  # the tests folder: its workers and data
WORKER = [sys.executable, str(HERE / "checkpoint_worker.py")]
ENV = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def state_of(step):
    """A state whose array `w` is 1 MB of random floats (stored apart from the small leaves)."""
    rng = np.random.default_rng(step)
    return {
        "w": jnp.asarray(rng.standard_normal((512, 512), dtype=np.float32)),
        "b": {"c": jnp.arange(10, dtype=jnp.int32) * step, "flag": jnp.array([True, False])},
    }


def assert_same(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


@pytest.fixture
def three_steps(tmp_path):
    """A directory with checkpoints 1, 2, 3 of `state_of(step)`."""
    with CheckpointManager(tmp_path, async_save=False) as manager:
        for step in (1, 2, 3):
            manager.save(step, state_of(step), {"data_position": 10 * step})
    return tmp_path


def flip_16_bytes(path: pathlib.Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    path.write_bytes(data)


def largest_file(folder: pathlib.Path) -> pathlib.Path:
    return max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def corrupt(directory, problem):
    """The message of a corrupt checkpoint 3 of `three_steps`, `problem` a regex."""
    return (
        f"^checkpoint 3 in {re.escape(str(directory))} is corrupt: {problem}; earlier "
        r"checkpoints: \[1, 2\]; restore_latest_intact\(target\) restores the newest one "
        "that is intact$"
    )


# -- corrupt files ---------------------------------------------------------------------------
# Flipped bytes are caught by zstd where they break its block structure (where they land
# depends on OCDBT's file layout, which varies from save to save), by the checksum otherwise.
FLIPPED = (
    r"(w does not match its checksum \(saved \w{16}, read \w{16}\)"
    r"|.*/3/state cannot be read \(ValueError: .*Data corruption detected.*\))"
)


def test_flipped_bytes_in_an_array_are_detected(three_steps):
    flip_16_bytes(largest_file(three_steps / "3" / "state"))
    manager = CheckpointManager(three_steps, read_only=True)
    with pytest.raises(CorruptCheckpointError, match=corrupt(three_steps, FLIPPED)):
        manager.restore(state_of(0))
    with pytest.warns(RuntimeWarning, match=r"^skipping checkpoint 3: checkpoint 3 in "):
        step, state, extra = manager.restore_latest_intact(state_of(0))
    assert (step, extra) == (2, {"data_position": 20})
    assert_same(state, state_of(2))


def test_a_corrupt_step_is_moved_aside_so_that_training_on_saves_it_again(three_steps):
    # The resume loop of docs/checkpoints.md: restore the newest intact step (2), train on and
    # save step 3 again, on every restart; the damaged folder is kept for a look.
    flip_16_bytes(largest_file(three_steps / "3" / "state"))
    damaged = sorted(p.relative_to(three_steps / "3") for p in (three_steps / "3").rglob("*"))
    with CheckpointManager(three_steps, async_save=False) as manager:
        with pytest.warns(RuntimeWarning) as caught:
            step, state, _ = manager.restore_latest_intact(state_of(0))
        assert step == 2
        assert_same(state, state_of(2))
        (aside,) = three_steps.glob("corrupt-3-*")
        assert re.fullmatch(r"corrupt-3-\d{8}T\d{6}-\w{6}", aside.name)
        assert str(caught[0].message).startswith("skipping checkpoint 3: checkpoint 3 in ")
        assert str(caught[0].message).endswith(
            f"; moved to {aside} (kept for a look; step 3 can be saved again)"
        )
        assert manager.all_steps() == [1, 2]
        manager.save(3, state_of(3))
        assert manager.restore(state_of(0))[0]["w"].sum() == state_of(3)["w"].sum()
    assert sorted(p.relative_to(aside) for p in aside.rglob("*")) == damaged


def test_a_step_without_its_manifest_is_not_skipped_silently(three_steps):
    shutil.rmtree(three_steps / "3" / "fleetjax")
    reader = CheckpointManager(three_steps, read_only=True)
    assert reader.all_steps() == [1, 2]
    lost = rf"skipping checkpoint 3: {re.escape(str(three_steps))}/3 holds orbax's files but no "
    lost += r"fleetjax/manifest.json \(deleted, or written by a fleetjax without manifests\)"
    with pytest.warns(RuntimeWarning, match=lost + ", so it cannot be verified$"):
        assert reader.restore_latest_intact(state_of(0))[0] == 2
    assert (three_steps / "3").is_dir()  # a reader moves nothing
    # A writer moves it aside when it opens the directory, so step 3 can be saved again.
    with pytest.warns(RuntimeWarning, match=lost + r".*; moved to .*/corrupt-3-"):
        writer = CheckpointManager(three_steps, async_save=False)
    with writer:
        writer.save(3, state_of(3))
        assert writer.all_steps() == [1, 2, 3]


def test_readable_arrays_that_are_not_the_saved_ones_fail_their_checksum(three_steps):
    """Step 2's arrays in step 3's folder: a store that reads without error, wrong values."""
    shutil.rmtree(three_steps / "3" / "state")
    shutil.copytree(three_steps / "2" / "state", three_steps / "3" / "state")
    manager = CheckpointManager(three_steps, read_only=True)
    mismatch = r"{} does not match its checksum \(saved \w{{16}}, read \w{{16}}\)"
    message = corrupt(three_steps, f"{mismatch.format('b/c')}; {mismatch.format('w')}")
    with pytest.raises(CorruptCheckpointError, match=message):  # flag: the same at every step
        manager.restore(state_of(0))


def _delete(path):
    path.unlink()


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _binary(path):
    path.write_bytes(b"\x00\xff\xfe" * 40)


@pytest.mark.parametrize(
    "damage, file, problem",
    [
        (_delete, "state/_METADATA", r"the array metadata .*/3/state/_METADATA is missing"),
        (_truncate, "state/_METADATA", r"the array metadata in .*/3/state cannot be read "
         r"\(JSONDecodeError: Expecting .*\)"),
        (_binary, "state/_METADATA", r"the array metadata in .*/3/state cannot be read "
         r"\(UnicodeDecodeError: 'utf-8' codec can't decode .*\)"),
        (_delete, "state/manifest.ocdbt", r"the array metadata in .*/3/state cannot be read "
         r"\(ValueError: NOT_FOUND: .* does not exist\)"),
        (_binary, "state/manifest.ocdbt", r"the array metadata in .*/3/state cannot be read "
         r"\(ValueError: DATA_LOSS: .*"),
        (_truncate, "largest", r".*/3/state cannot be read \(ValueError: OUT_OF_RANGE: Error "
         r"reading \"w/0.0\" .*"),
        (_truncate, "extra/metadata", r".*/3/extra cannot be read \(JSONDecodeError: .*\)"),
        (_delete, "fleetjax/manifest.json", r"its manifest .*/3/fleetjax/manifest.json cannot "
         r"be read \(\[Errno 2\] No such file or directory: .*\)"),
        (_binary, "fleetjax/manifest.json", r"its manifest .*/3/fleetjax/manifest.json cannot "
         r"be read \('utf-8' codec can't decode .*\)"),
    ],
    ids=lambda x: getattr(x, "__name__", x).strip("_") if callable(x) else x,
)  # fmt: skip
def test_damaged_files_name_the_step_the_folder_and_the_damage(three_steps, damage, file, problem):
    folder = three_steps / "3"
    damage(largest_file(folder / "state") if file == "largest" else folder / file)
    manager = CheckpointManager(three_steps, read_only=True)
    assert manager.all_steps() == [1, 2, 3]
    with pytest.raises(CorruptCheckpointError, match=corrupt(three_steps, problem)):
        manager.restore(state_of(0))
    with pytest.warns(RuntimeWarning, match="^skipping checkpoint 3: "):
        step, state, _ = manager.restore_latest_intact(state_of(0))
    assert step == 2
    assert_same(state, state_of(2))


def test_edited_extras_and_a_moved_checkpoint_are_detected(three_steps):
    (three_steps / "3" / "extra" / "metadata").write_text('{"data_position": 31}')
    manager = CheckpointManager(three_steps, read_only=True)
    message = r"the extras \(extra/\) do not match their checksum"
    with pytest.raises(CorruptCheckpointError, match=corrupt(three_steps, message)):
        manager.restore(state_of(0))
    shutil.move(three_steps / "2", three_steps / "7")  # a checkpoint copied under a new name
    with pytest.raises(CorruptCheckpointError, match=r"its manifest .*/7/fleetjax/manifest.json "):
        manager.restore(state_of(0), step=7)


def test_a_manifest_of_the_wrong_shape_is_corrupt(three_steps):
    manifest = three_steps / "3" / "fleetjax" / "manifest.json"
    manager = CheckpointManager(three_steps, read_only=True)
    manifest.write_text("[]")
    with pytest.raises(CorruptCheckpointError, match=r"its manifest .* lacks \['checksums', "):
        manager.restore(state_of(0))
    fields = {"format": 1, "writer": "CheckpointManager", "step": 3, "extra_sha256": ""}
    manifest.write_text(json.dumps({**fields, "checksums": []}))
    with pytest.raises(CorruptCheckpointError, match=r"its manifest .* has no table of checks"):
        manager.restore(state_of(0))


def test_no_intact_checkpoint(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(1, state_of(1))
    flip_16_bytes(largest_file(tmp_path / "1" / "state"))
    manager = CheckpointManager(tmp_path, read_only=True)
    with pytest.raises(CorruptCheckpointError, match=r"; there is no earlier checkpoint$"):
        manager.restore(state_of(0))
    with (
        pytest.warns(RuntimeWarning),
        pytest.raises(CorruptCheckpointError, match=r"^no intact checkpoint in .*: checkpoint 1 "),
    ):
        manager.restore_latest_intact(state_of(0))
    with pytest.raises(FileNotFoundError, match=r"complete checkpoints: none"):
        CheckpointManager(tmp_path / "empty", read_only=True).restore_latest_intact(state_of(0))


# -- resuming ----------------------------------------------------------------------------------
def test_resume_gives_the_newest_intact_step_or_none_for_a_fresh_start(three_steps, tmp_path):
    with CheckpointManager(tmp_path / "new") as manager:
        assert manager.resume(state_of(0)) is None
    flip_16_bytes(largest_file(three_steps / "3" / "state"))
    with (
        CheckpointManager(three_steps) as manager,
        pytest.warns(RuntimeWarning, match=r"^skipping checkpoint 3: .*; moved to "),
    ):
        step, state, extra = manager.resume(state_of(0))
    assert (step, extra) == (2, {"data_position": 20})
    assert_same(state, state_of(2))


def test_an_unreadable_step_is_an_error_and_nothing_is_moved(three_steps):
    # Files that cannot be read for a while (permissions here; a network file system's hiccup)
    # are no proof of damage (before: set aside as corrupt, every step of them).
    files = [p for step in ("2", "3") for p in (three_steps / step).rglob("*") if p.is_file()]
    listed = sorted(os.listdir(three_steps))
    with unreadable(files):
        command = unreadable_by([*WORKER, "resume", str(three_steps)])
        run = subprocess.run(command, env=ENV, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    resumed = json.loads(run.stdout.splitlines()[-1])
    manifest = three_steps / "3" / "fleetjax" / "manifest.json"
    assert resumed == {
        "error": "UnreadableCheckpointError",
        "message": f"checkpoint 3 in {three_steps} cannot be read: its manifest {manifest} cannot "
        f"be read ([Errno 13] Permission denied: '{manifest}'). That is no proof of damage, so "
        "nothing was set aside: make it readable and restore again (if it is damaged, move "
        f"{three_steps / '3'} out of the directory)",
        "warnings": [],
    }
    assert sorted(os.listdir(three_steps)) == listed
    with CheckpointManager(three_steps) as manager:  # readable again: nothing was lost
        assert manager.resume(state_of(0))[0] == 3


def test_a_directory_that_links_to_nothing_is_no_fresh_start(tmp_path):
    # A checkpoint directory on a mount that is not there: not a first run's empty directory.
    (tmp_path / "ckpt").symlink_to(tmp_path / "mnt" / "ckpt")
    message = rf"^checkpoint directory {tmp_path}/ckpt links to {tmp_path}/mnt/ckpt, which does "
    for read_only_ in (False, True):
        with pytest.raises(UnreadableCheckpointError, match=message + "not exist"):
            CheckpointManager(tmp_path / "ckpt", read_only=read_only_)


def test_no_intact_checkpoint_is_no_fresh_start_unless_asked(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(1, state_of(1))
        manager.save(2, state_of(2))
    for step in ("1", "2"):
        flip_16_bytes(largest_file(tmp_path / step / "state"))
    with CheckpointManager(tmp_path) as manager:
        nothing = (
            rf"^no intact checkpoint in {tmp_path}: checkpoint 2 .* \| checkpoint 1 .*; nothing "
            r"to resume from: to train from step 0 here, pass CheckpointManager\(\.\.\., "
            r"start_over=True\)$"
        )
        with pytest.warns(RuntimeWarning), pytest.raises(CorruptCheckpointError, match=nothing):
            manager.resume(state_of(0))
    aside = sorted(p.name for p in tmp_path.glob("corrupt-*"))
    assert [name.split("-")[1] for name in aside] == ["1", "2"]
    # The restart: nothing is listed, what was there is set aside (before: a fresh start).
    message = (
        f"no intact checkpoint in {tmp_path}: every one was set aside as damaged "
        f"({', '.join(aside)}), so there is nothing to resume from; to train from step 0 here, "
        "pass CheckpointManager(..., start_over=True) (or move those folders out)"
    )
    with pytest.raises(CorruptCheckpointError, match=f"^{re.escape(message)}$"):
        CheckpointManager(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=f"^{re.escape(message)}$"):
        CheckpointManager(tmp_path, read_only=True).resume(state_of(0))
    with CheckpointManager(tmp_path, start_over=True, async_save=False) as manager:
        with pytest.warns(UserWarning, match=re.escape(f"{message}; start_over=True: training")):
            assert manager.resume(state_of(0)) is None
        manager.save(1, state_of(1))
    with CheckpointManager(tmp_path) as manager:  # trained on: a checkpoint again
        assert manager.resume(state_of(0))[0] == 1


def test_a_target_that_does_not_fit_is_not_skipped_as_corrupt(three_steps):
    wrong = {**state_of(0), "w": jnp.zeros((512, 256))}
    with pytest.raises(ValueError, match=r"w has shape \(512, 512\) in the checkpoint but"):
        CheckpointManager(three_steps, read_only=True).restore_latest_intact(wrong)


def test_dtypes_are_verified_as_saved_then_cast(tmp_path):
    saved = {
        "bf16": jnp.linspace(-3, 3, 7, dtype=jnp.bfloat16),
        "c64": jnp.array([1 + 2j, -3j], jnp.complex64),
        "i8": jnp.array([-128, 5, 127], jnp.int8),
        "u16": jnp.array([65535, 1], jnp.uint16),
        "f8": jnp.array([0.5, -2.0], jnp.float8_e4m3fn),
        "i4": jnp.array([-8, 7, 1], jnp.int4),
        "scalar": jnp.float32(2.5),
    }
    with CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(0, saved)
    manager = CheckpointManager(tmp_path, read_only=True)
    assert_same(manager.restore(saved)[0], saved)
    as_f32 = jax.tree.map(lambda x: x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, saved)
    assert manager.restore(as_f32)[0]["bf16"].dtype == jnp.float32


# -- what the manager touches ----------------------------------------------------------------
def test_a_user_folder_is_neither_listed_nor_deleted_nor_overwritten(tmp_path):
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "notes.txt").write_text("mine")
    (tmp_path / "007").mkdir()
    with CheckpointManager(tmp_path, max_to_keep=1, async_save=False) as manager:
        for step in range(1, 5):
            manager.save(step, state_of(step))
        assert manager.all_steps() == [4]
        not_mine = r"/5 exists and is not a checkpoint \(it has no fleetjax/ folder\); move it"
        with pytest.raises(ValueError, match=not_mine):
            manager.save(5, state_of(5))
        manager.save(6, state_of(6))
        assert manager.all_steps() == [6]
        with pytest.raises(FileNotFoundError, match=r"; .*/5 has no fleetjax/ folder: it is not"):
            manager.restore(state_of(0), step=5)
    assert (tmp_path / "5" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fleetjax-lock", "007", "5", "6"]


def test_save_persistables_refuses_a_managers_folder(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(3, state_of(3))
        manager.save(4, state_of(4))
    message = (
        f"{tmp_path} holds checkpoints [3, 4] written by CheckpointManager, which a "
        "save_persistables would replace or delete; use another directory"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        save_persistables(tmp_path, state_of(9))
    assert CheckpointManager(tmp_path, read_only=True).all_steps() == [3, 4]
    assert_same(load_persistables(tmp_path, state_of(0)), state_of(4))

    save_persistables(tmp_path / "p", state_of(1))
    with pytest.raises(ValueError, match=r"holds checkpoints \[1\] written by save_persistables"):
        CheckpointManager(tmp_path / "p")


@pytest.mark.parametrize(
    "step, error, message",
    [
        (-5, ValueError, "step must be a non-negative int, got -5"),
        (2.7, TypeError, "step must be a non-negative int, got 2.7 (float)"),
        (True, TypeError, "step must be a non-negative int, got True (bool)"),
        ("3", TypeError, "step must be a non-negative int, got '3' (str)"),
        (np.float64(3.0), TypeError, "step must be a non-negative int, got np.float64(3.0) "),
    ],
)
def test_bad_step_numbers_are_refused_before_anything_is_written(tmp_path, step, error, message):
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            manager.save(step, state_of(1))
        with pytest.raises(error, match=f"^{re.escape(message)}"):
            manager.restore(state_of(1), step=step)
    assert [p.name for p in tmp_path.iterdir()] == [".fleetjax-lock"]


def test_numpy_and_array_step_numbers(tmp_path):
    with CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(np.int64(3), state_of(3))
        manager.save(jnp.int32(4), state_of(4))
        manager.save(0, state_of(0))
        assert manager.all_steps() == [0, 3, 4]
        assert_same(manager.restore(state_of(1), step=np.uint8(3))[0], state_of(3))


def test_bad_leaves_and_extras_are_refused(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        with pytest.raises(TypeError, match=r"^state\['b'\] is str; each leaf of a checkpoint"):
            manager.save(1, {"a": jnp.ones(2), "b": "text"})
        with pytest.raises(TypeError, match=r"^extra is not JSON-able: Object of type object"):
            manager.save(1, state_of(1), {"position": object()})
    assert [p.name for p in tmp_path.iterdir()] == [".fleetjax-lock"]


# -- two writers, kills, a failing save ------------------------------------------------------
def test_a_second_writer_is_refused(tmp_path):
    with CheckpointManager(tmp_path) as manager:
        holder = f"pid {os.getpid()} on {socket.gethostname()}"
        message = rf"^{tmp_path} is being written by another CheckpointManager \({holder}, lock "
        with pytest.raises(RuntimeError, match=rf"{message}{tmp_path}/.fleetjax-lock\); one "):
            CheckpointManager(tmp_path)
        CheckpointManager(tmp_path, read_only=True).all_steps()  # readers are welcome
        manager.save(1, state_of(1))
    with CheckpointManager(tmp_path) as manager:  # released by close
        assert manager.all_steps() == [1]


def test_the_lock_of_a_killed_writer_is_free(tmp_path):
    holder = subprocess.Popen([*WORKER, "hold", str(tmp_path)], env=ENV, stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"holding\n"
        with pytest.raises(RuntimeError, match=rf"\(pid {holder.pid} on "):
            CheckpointManager(tmp_path)
    finally:
        holder.kill()
        holder.communicate()
    assert (tmp_path / ".fleetjax-lock").exists()  # left behind, but no longer locked
    with CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(1, state_of(1))


def test_a_kill_during_a_deletion_leaves_the_old_step_unlisted(tmp_path):
    worker = subprocess.run(
        [*WORKER, "die-deleting", str(tmp_path)], env=ENV, capture_output=True, text=True
    )
    assert worker.returncode == -signal.SIGKILL, worker.stderr
    trash = [n for n in os.listdir(tmp_path) if n.startswith(".fleetjax-deleting-1-")]
    assert len(trash) == 1 and f"'{trash[0]}'" in worker.stdout  # renamed, half-deleted
    manager = CheckpointManager(tmp_path, read_only=True)
    assert manager.all_steps() == [2]
    np.testing.assert_array_equal(manager.restore({"w": jnp.zeros(8)})[0]["w"], 2.0)
    with CheckpointManager(tmp_path):  # the next writer finishes the deletion
        assert sorted(os.listdir(tmp_path)) == [".fleetjax-lock", "2"]


def test_a_failing_background_save_is_reported_and_not_listed(tmp_path):
    manager = CheckpointManager(tmp_path)
    big = {"w": jnp.ones((4096, 4096))}  # 64 MB: written long after `save` returns
    manager.save(1, big)
    failed = rf"^saving checkpoint 1 in {tmp_path} failed \(PermissionError: .*"
    # Its parts cannot be renamed into place.
    with read_only(tmp_path / "1.orbax-checkpoint-tmp"), pytest.raises(RuntimeError, match=failed):
        manager.wait_until_finished()
    assert manager.all_steps() == []
    manager.save(2, {"w": jnp.ones(3)})
    manager.close()
    assert manager.all_steps() == [2]
    failed = rf"^saving checkpoint 3 in {tmp_path} failed \(PermissionError: .*"
    with (
        CheckpointManager(tmp_path) as manager,
        read_only(tmp_path),
        pytest.raises(RuntimeError, match=failed),
    ):
        manager.save(3, {"w": jnp.ones(3)})
    assert manager.all_steps() == [2]


@pytest.mark.slow
def test_kills_at_random_moments_restore_the_newest_complete_step(tmp_path):
    """25 SIGKILLs of a process saving 4 MB checkpoints back to back (max_to_keep=2), each at a
    random moment; after each, the newest complete step restores bit-exact and intact."""
    rng, target = random.Random(0), {"w": jnp.zeros((1024, 1024))}
    latest, restored, leftovers = None, [], {"tmp": 0, "deleting": 0}
    start = time.perf_counter()
    for _ in range(25):
        with subprocess.Popen(
            [*WORKER, "save-forever", str(tmp_path)], env=ENV, stdout=subprocess.PIPE, text=True
        ) as worker:
            try:
                assert worker.stdout.readline() == "ready\n"
                time.sleep(rng.uniform(0.0, 1.5))
            finally:
                worker.kill()
                output = worker.communicate()[0]
        assert worker.returncode == -signal.SIGKILL
        saved = [int(step) for step in re.findall(r"^saved (\d+)$", output, re.M)]
        last_saved = saved[-1] if saved else latest
        names = os.listdir(tmp_path)
        leftovers["tmp"] += any(n.endswith(".orbax-checkpoint-tmp") for n in names)
        leftovers["deleting"] += any(n.startswith(".fleetjax-deleting-") for n in names)

        manager = CheckpointManager(tmp_path, read_only=True)
        latest = manager.latest_step()
        # Complete before the kill: the last step reported saved (None: none yet), or one more
        # (killed between its commit and its report).
        assert latest in (last_saved, (last_saved or 0) + 1), (saved, latest)
        if latest is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no checkpoint skipped as corrupt
            step, state, extra = manager.restore_latest_intact(target)
        assert (step, extra) == (latest, {"step": latest})
        np.testing.assert_array_equal(np.asarray(state["w"]), value(latest))
        restored.append(latest)
    seconds = time.perf_counter() - start
    print(
        f"\n25 kills in {seconds:.0f} s; restored steps {restored}; left a temporary save "
        f"{leftovers['tmp']} times, a half-deleted step {leftovers['deleting']} times"
    )
    assert len(set(restored)) > 10  # the kills fell at many different moments
