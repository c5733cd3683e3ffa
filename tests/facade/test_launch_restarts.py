"""fleetjax-run's restarts (`--max_restart`) and elastic nodes (`--nnodes min:max`): a job that
loses a worker or a node resumes from its latest intact checkpoint with docs/checkpoints.md's
training loop, and ends with the losses of a run that was never interrupted."""

import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
from launching import (
    ENV,
    WORKER,
    docs_training_script,
    free_port,
    listening,
    losses,
    wait_for,
    worker_pid,
)


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
    # The worker may train a few steps more between the poll that saw step `kill_at` and the
    # signal; its (unbuffered) log says where it was.
    killed_after = losses(log1.read_text().split("fleetjax-run: attempt 2 starts\n")[0])[-1][0]
    print(f"the restarted job resumed after step {resumed}; worker 1 died after {killed_after}")
    # From the latest complete checkpoint (saved every 5 steps, in the background; a save
    # first waits for the one before it, whose commit takes both workers): the one before the
    # kill, or the one before that if the kill came while it was being committed.
    assert resumed % 5 == 0 and killed_after - 10 <= resumed <= killed_after
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


@pytest.mark.slow  # 21 s; the killed worker's restart above runs by default
def test_a_lost_node_leaves_the_job_to_the_others(launcher, tmp_path):
    # --nnodes 1:2: two nodes of one worker x 2 devices; node 1's launcher is killed after
    # step 17; node 0 goes on alone: 2 devices, the checkpoint of 4 resharded onto them, the
    # global batch of 64 kept (32 rows a device instead of 16).
    reference = _reference(tmp_path / "reference", devices=4)
    script = docs_training_script(tmp_path)
    port = free_port()

    def node(rank: int) -> subprocess.Popen:
        return launcher(
            "--master", f"127.0.0.1:{port}", "--nnodes", "1:2", "--elastic_timeout", "8",
            "--rank", str(rank), "--nproc_per_node", "1", "--cpu_devices_per_proc", "2",
            "--start_port", str(free_port()), str(script),
            log_dir=tmp_path / f"node{rank}", cwd=tmp_path,
        )  # fmt: skip

    # Node 0 first: the node that serves --master (here: the first to listen) must stay. It
    # waits --elastic_timeout for node 1 to come (at the start, and again after node 1 is lost).
    nodes = [node(0)]
    wait_for(lambda: listening(port), 60, "node 0's rendezvous")
    nodes.append(node(1))
    log1 = tmp_path / "node1" / "workerlog.1"
    wait_for(lambda: log1.exists() and "step 17:" in log1.read_text(), 120, "step 17")
    nodes[1].kill()
    _, err = nodes[0].communicate(timeout=180)
    expected = dict(losses(reference.communicate(timeout=120)[0]))
    assert nodes[0].returncode == 0, err
    assert (
        "fleetjax-run: node 1 (127.0.0.1, workers 1..1) ended: its launcher's connection closed "
        "(killed, or stopped); stopping all workers\n"
        "fleetjax-run: restarting the job: restart 1 of 3 (--max_restart)\n"
        "fleetjax-run: starting workers 0..0 of 1; "
    ) in err, err
    log0 = (tmp_path / "node0" / "workerlog.0").read_text()
    assert "mesh {'dp': 4, " in log0.split("attempt 2 starts")[0]
    assert "mesh {'dp': 2, " in log0.split("attempt 2 starts")[1]
    resumed = _resumed_from(log0)
    lost_after = losses(log1.read_text())[-1][0]
    print(f"node 0 resumed alone after step {resumed}; node 1 was lost after {lost_after}")
    assert resumed % 5 == 0 and lost_after - 10 <= resumed <= lost_after
    trained = dict(losses(log0))
    assert list(trained) == list(range(1, 41))
    np.testing.assert_allclose(
        [float(v) for v in trained.values()], [float(v) for v in expected.values()], rtol=1e-5
    )


def test_paddles_elastic_level_restarts_3_times(launcher, tmp_path):
    # --elastic_level 1 without --max_restart: Paddle's --max_restart default, 3.
    proc = launcher(
        "--elastic_level", "1", "--nproc_per_node", "2", "--start_port", str(free_port()),
        str(WORKER), "fail",
    )  # fmt: skip
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3
    restarts = re.findall(r"restarting the job: restart (\d) of (\d)", err)
    assert restarts == [("1", "3"), ("2", "3"), ("3", "3")]
    assert err.count("fleetjax-run: worker 1 exited with code 3; stopping all workers") == 4
    assert err.endswith("fleetjax-run: worker 1 exited with code 3; stopping all workers\n")
    log = (tmp_path / "log" / "workerlog.1").read_text()
    assert [int(n) for n in re.findall(r"^fleetjax-run: attempt (\d) starts$", log, re.M)] == [
        2,
        3,
        4,
    ]


def test_a_strategy_that_no_longer_fits_the_nodes_left_says_so(tmp_path):
    # What fleet.init() sees after an elastic restart on 1 of 2 nodes: 2 devices for mp 4.
    script = tmp_path / "mp4.py"
    script.write_text(
        "import fleetjax\nfrom fleetjax import fleet\n"
        "s = fleetjax.DistributedStrategy()\n"
        "s.hybrid_configs = {'dp_degree': 1, 'mp_degree': 4}\n"
        "fleet.init(is_collective=True, strategy=s)\n"
    )
    elastic = {"PADDLE_NNODES": "1", "FLEETJAX_MAX_NODES": "2", "JAX_NUM_CPU_DEVICES": "2"}
    run = subprocess.run(
        [sys.executable, str(script)], env={**ENV, **elastic}, capture_output=True, text=True
    )
    assert run.returncode == 1
    assert (
        "ValueError: dp x sharding x pp x mp = 1 x 1 x 1 x 4 = 4, but there are 2 devices: "
        "fleetjax-run restarted this job on 1 of its up to 2 nodes (--nnodes min:max) after it "
        "lost some, and the strategy's degrees must fit the devices left (dp_degree -1 takes "
        "whatever the other degrees leave; the global batch stays, each device's share grows)"
    ) in run.stderr, run.stderr
