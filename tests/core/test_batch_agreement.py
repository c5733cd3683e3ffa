"""The processes of a job agree on the global batch: at the first step, and whenever a
process's batch shapes change, each checks the others' (through JAX's coordination service);
batches of different shapes are an error naming each process's, in seconds, never a gradient
that weighs the processes' rows differently."""

import re
import time

import pytest
from launching import WORKER, free_port

SHAPES = "batch['x'] float32[{0}, 4], batch['y'] float32[{0}, 1]"


def _run(launcher, tmp_path, how: str) -> tuple[int, str, str]:
    """Two workers of 2 CPU devices training with `launch_worker.py batches HOW`: the
    launcher's exit code, its stderr and both workers' logs."""
    proc = launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", "2", "--start_port", str(free_port()),
        str(WORKER), "batches", how,
    )  # fmt: skip
    _, err = proc.communicate(timeout=180)
    logs = [(tmp_path / "log" / f"workerlog.{rank}").read_text() for rank in (0, 1)]
    return proc.returncode, err, "\n".join(logs)


def _mismatch(call: int, rows: tuple[int, int]) -> str:
    return (
        f"ValueError: the processes passed batches of different shapes to call {call} of the "
        f"train step (process 0: {SHAPES.format(rows[0])}; process 1: {SHAPES.format(rows[1])}): "
        "each process passes its own rows of the global batch, with the same shapes and dtypes "
        "on every process; otherwise each compiles the step for another global batch and weighs "
        "the rows of the others wrongly"
    )


def test_processes_that_pass_batches_of_different_shapes_are_stopped(launcher, tmp_path):
    # Worker 0 passes 4 rows a step, worker 1 8 (before: 40 silent steps, each process's step
    # compiled for another global batch, the rows weighed 1/8 and 1/16, losses 2x apart).
    code, err, logs = _run(launcher, tmp_path, "first")
    began = min(float(t) for t in re.findall(r"^step 1: \d+ rows at ([\d.]+)$", logs, re.M))
    print(f"the launcher exited {time.time() - began:.1f} s after the first step began")
    assert code == 1, err
    assert re.search(r"fleetjax-run: worker [01] exited with code 1; stopping all workers\n$", err)
    assert _mismatch(1, (4, 8)) in logs
    assert "loss" not in logs  # no step ran
    assert time.time() - began < 30


@pytest.mark.slow  # 20 s; the first step's check runs by default
def test_a_process_whose_batches_change_alone_is_stopped(launcher, tmp_path):
    # From step 3 on worker 1 passes 16 rows; worker 0's stay 8: worker 1 reads worker 0's
    # shapes of its third call, as worker 0 posted them before waiting in that step.
    code, err, logs = _run(launcher, tmp_path, "later")
    assert code == 1, err
    assert err.endswith("fleetjax-run: worker 1 exited with code 1; stopping all workers\n"), err
    assert _mismatch(3, (8, 16)) in logs
    assert re.findall(r"^step (\d): loss", logs, re.M) == ["1", "2", "1", "2"]
