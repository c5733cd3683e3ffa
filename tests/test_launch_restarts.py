"""fleetjax-run's restarts (`--max_restart`) and elastic nodes (`--nnodes min:max`): a job that
loses a worker or a node resumes from its latest intact checkpoint with docs/checkpoints.md's
training loop, and ends with the losses of a run that was never interrupted."""

import os
import random
import signal
import subprocess
import sys

import numpy as np
from launching import ENV, docs_training_script, free_port, losses, wait_for, worker_pid


def _reference(folder, devices: int) -> subprocess.Popen:
    """The docs' loop uninterrupted, in one process over `devices` CPU devices."""
    folder.mkdir()
    return subprocess.Popen(
        [sys.executable, str(docs_training_script(folder))],
        cwd=folder,
        env={**ENV, "JAX_NUM_CPU_DEVICES": str(devices)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def _resumed_from(log_text: str) -> int:
    """The first step of the second attempt (after the line that starts it), minus one."""
    second = log_text.split("fleetjax-run: attempt 2 starts\n")[1]
    return losses(second)[0][0] - 1


def test_a_killed_worker_restarts_the_job_from_its_checkpoint(launcher, tmp_path):
    kill_at = random.randint(6, 34)
    print(f"worker 1 is killed after step {kill_at}")
    reference = _reference(tmp_path / "reference", devices=4)
    script = docs_training_script(tmp_path)
    proc = launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", "2", "--max_restart", "1",
        "--start_port", str(free_port()), str(script), cwd=tmp_path,
    )  # fmt: skip
    log1 = tmp_path / "log" / "workerlog.1"
    wait_for(lambda: log1.exists() and f"step {kill_at}:" in log1.read_text(), 120, "the step")
    os.kill(worker_pid(log1), signal.SIGKILL)
    _, err = proc.communicate(timeout=180)
    expected = dict(losses(reference.communicate(timeout=120)[0]))
    assert proc.returncode == 0, err
    assert "fleetjax-run: worker 1 was killed by SIGKILL; stopping all workers\n" in err
    assert "fleetjax-run: restarting the job: restart 1 of 1 (--max_restart)\n" in err
    log0 = (tmp_path / "log" / "workerlog.0").read_text()
    resumed = _resumed_from(log0)
    print(f"the restarted job resumed after step {resumed}")
    # From the latest complete checkpoint (saved every 5 steps, in the background).
    assert resumed % 5 == 0 and resumed <= kill_at
    trained = losses(log0)  # both attempts: steps resumed+1.. are trained twice
    assert [s for s, _ in trained][-(40 - resumed) :] == list(range(resumed + 1, 41))
    assert len({(s, v) for s, v in trained}) == len({s for s, _ in trained}) == 40, trained
    # The losses of an uninterrupted run (one process of 4 devices: the sums' order
    # differs in the last digit).
    assert list(expected) == list(range(1, 41))
    np.testing.assert_allclose(
        [float(v) for _, v in sorted(set(trained))],
        [float(v) for v in expected.values()],
        rtol=1e-5,
    )
