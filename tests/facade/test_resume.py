"""Resuming a job of several processes (docs/checkpoints.md's loop under `fleetjax-run`): the
processes decide together which checkpoint they resume from and what is set aside, only proof
of damage sets a checkpoint aside, and a restart with no intact checkpoint stops rather than
train from step 0 unnoticed."""

import os
import pathlib
import re
import time

import pytest
from launching import docs_training_script, free_port, losses
from read_only import unreadable, unreadable_by


def _script(folder: pathlib.Path, steps: int, *, late: bool = False, start_over: bool = False):
    """docs/checkpoints.md's loop as `folder/train.py`, `steps` long; with `late`, process 1
    lists the directory 3 s after process 0 (a slower host); with `start_over`, its manager
    may start over."""
    script = docs_training_script(folder)
    text = script.read_text().replace("steps = 40", f"steps = {steps}")
    if late:
        resume = "resumed = manager.resume(state)"
        text = "import time\n" + text.replace(
            resume, f"time.sleep(3 * fleet.worker_index())\n{resume}"
        )
    if start_over:
        text = text.replace("save_interval_steps=5)", "save_interval_steps=5, start_over=True)")
    script.write_text(text)


def _train(launcher, folder: pathlib.Path, name: str, *options: str, prefix=()):
    """The script of `folder` on two processes of 2 CPU devices (logs in `folder/name`): the
    launcher's exit code, its stderr, each worker's log and the seconds it took."""
    began = time.monotonic()
    proc = launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", "2", "--start_port", str(free_port()),
        "--heartbeat_timeout", "30", *options, str(folder / "train.py"),
        log_dir=folder / name, cwd=folder, prefix=prefix,
    )  # fmt: skip
    _, err = proc.communicate(timeout=300)
    logs = [(folder / name / f"workerlog.{rank}").read_text() for rank in (0, 1)]
    return proc.returncode, err, logs, time.monotonic() - began


def _damage(step_folder: pathlib.Path) -> None:
    """16 flipped bytes in the middle of the step's largest file of array data."""
    data_files = (p for p in (step_folder / "state" / "d").iterdir() if p.is_file())
    largest = max(data_files, key=os.path.getsize)
    data = bytearray(largest.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    largest.write_bytes(data)


def _checkpoints(folder: pathlib.Path) -> list[str]:
    return sorted(re.sub(r"-\d{8}T\d{6}-\w{6}$", "", name) for name in os.listdir(folder / "ckpt"))


@pytest.mark.slow  # 60 s: two runs of two processes
def test_two_processes_resume_from_the_same_step_though_one_lists_late(launcher, tmp_path):
    # Before: process 0 set step 10 aside and waited in a barrier that process 1, which no
    # longer saw step 10, skipped: it restored step 5 and waited in step 6's all-reduce.
    _script(tmp_path, steps=10)
    code, err, first, _ = _train(launcher, tmp_path, "log1")
    assert code == 0, err
    _damage(tmp_path / "ckpt" / "10")
    _script(tmp_path, steps=10, late=True)
    code, err, logs, seconds = _train(launcher, tmp_path, "log2")
    print(f"the resumed run took {seconds:.0f} s")
    assert code == 0, err
    for log in logs:
        assert re.search(r"skipping checkpoint 10: checkpoint 10 in .* is corrupt: ", log), log
        assert losses(log) == losses(first[0])[5:]  # steps 6..10 again, as the first run
    assert _checkpoints(tmp_path) == [".fleetjax-lock", "10", "5", "corrupt-10"]


@pytest.mark.slow  # 80 s: three runs of two processes
def test_unreadable_checkpoints_stop_the_job_and_nothing_is_moved(launcher, tmp_path):
    # Files that cannot be read for a while (permissions; a network file system's hiccup). Before:
    # every step set aside as corrupt, and the restart trained from step 0, exit code 0.
    _script(tmp_path, steps=10)
    assert _train(launcher, tmp_path, "log1")[0] == 0
    ckpt = tmp_path / "ckpt"
    files = [p for step in ("5", "10") for p in (ckpt / step).rglob("*") if p.is_file()]
    listed = _checkpoints(tmp_path)
    with unreadable(files):
        code, err, logs, seconds = _train(
            launcher, tmp_path, "log2", "--max_restart", "1", prefix=unreadable_by([])
        )
    print(f"the two attempts took {seconds:.0f} s")
    assert code == 1, err
    manifest = ckpt / "10" / "fleetjax" / "manifest.json"
    error = (
        f"UnreadableCheckpointError: checkpoint 10 in {ckpt} cannot be read: its manifest "
        f"{manifest} cannot be read ([Errno 13] Permission denied: '{manifest}'). That is no "
        "proof of damage, so nothing was set aside"
    )
    # In both attempts. Process 0 raises it; so does process 1 if it is quick enough, before
    # JAX's coordination service, which process 0 serves, ends with process 0.
    assert logs[0].count(error) == 2, logs[0]
    assert not any(losses(log) for log in logs)  # nothing trained from scratch
    assert _checkpoints(tmp_path) == listed
    _script(tmp_path, steps=12)  # readable again: it resumes where it was
    code, err, logs, _ = _train(launcher, tmp_path, "log3")
    assert code == 0, err
    assert [step for step, _ in losses(logs[0])] == [11, 12]


@pytest.mark.slow  # 70 s: two runs of two processes, the first restarted once
def test_a_restart_with_no_intact_checkpoint_stops_unless_told_to_start_over(launcher, tmp_path):
    # Before: the first attempt raised, the restart found an empty directory, trained from step
    # 0 and ended with code 0.
    _script(tmp_path, steps=10)
    assert _train(launcher, tmp_path, "log1")[0] == 0
    for step in ("5", "10"):
        _damage(tmp_path / "ckpt" / step)
    code, err, logs, seconds = _train(launcher, tmp_path, "log2", "--max_restart", "1")
    print(f"the two attempts took {seconds:.0f} s")
    assert code == 1, err
    ckpt = tmp_path / "ckpt"
    attempts = logs[0].split("fleetjax-run: attempt 2 starts\n")
    assert re.search(
        rf"CorruptCheckpointError: no intact checkpoint in {ckpt}: checkpoint 10 .* \| "
        r"checkpoint 5 .*; nothing to resume from: to train from step 0 here, pass "
        r"CheckpointManager\(\.\.\., start_over=True\)\n",
        attempts[0],
    ), attempts[0]
    assert re.search(
        rf"CorruptCheckpointError: no intact checkpoint in {ckpt}: every one was set aside as "
        r"damaged \(corrupt-10-\S+, corrupt-5-\S+\), so there is nothing to resume from; to "
        r"train from step 0 here, pass CheckpointManager\(\.\.\., start_over=True\) \(or move "
        r"those folders out\)\n",
        attempts[1],
    ), attempts[1]
    assert not any(losses(log) for log in logs)
    _script(tmp_path, steps=10, start_over=True)  # the user says so: from step 0
    code, err, logs, _ = _train(launcher, tmp_path, "log3")
    assert code == 0, err
    assert "start_over=True: training starts over" in logs[0]
    assert [step for step, _ in losses(logs[0])] == list(range(1, 11))
