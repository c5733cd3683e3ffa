"""fleetjax.launch (fleetjax-run): the processes it plans and starts, their logs, and that no
worker outlives a failure, a kill or Ctrl-C."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from fleetjax import launch

HERE = pathlib.Path(__file__).parent
WORKER = HERE / "launch_worker.py"
EXAMPLE = HERE.parent / "examples" / "train_digits.py"
ENV = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def worker_pids(log_dir: pathlib.Path) -> dict[int, int]:
    """{rank: pid} of the workers that have started, from their logs."""
    pids = {}
    for log in log_dir.glob("workerlog.*"):
        if m := re.search(r"^pid=(\d+)$", log.read_text(), re.M):
            pids[int(log.suffix[1:])] = int(m.group(1))
    return pids


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(0.1)


@pytest.fixture
def launcher(tmp_path):
    """Start `python -m fleetjax.launch`; whatever happens, kill it and its workers after."""
    started = []

    def start(*args: str, log_dir: pathlib.Path | None = None) -> subprocess.Popen:
        log_dir = log_dir or tmp_path / "log"
        command = [sys.executable, "-m", "fleetjax.launch", "--log_dir", str(log_dir), *args]
        proc = subprocess.Popen(
            command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append((proc, log_dir))
        return proc

    yield start
    for proc, log_dir in started:
        proc.kill()
        proc.communicate()
        for pid in worker_pids(log_dir).values() if log_dir.exists() else ():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def plan(*argv: str, environ=None):
    """The workers for `argv`; the CPU unless `environ` says otherwise (GPUs here or not)."""
    environ = {"JAX_PLATFORMS": "cpu"} if environ is None else environ
    return launch.plan_workers(launch.parse_args([*argv, "train.py"]), environ)


# -- what is started -----------------------------------------------------------------------
def test_plan_on_cpu():
    workers = plan("--nproc_per_node", "2", "--cpu_devices_per_proc", "4", "--start_port", "7000")
    endpoints = "127.0.0.1:7000,127.0.0.1:7001"
    assert [w.env for w in workers] == [
        {
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_TRAINERS_NUM": "2",
            "PADDLE_TRAINER_ENDPOINTS": endpoints,
            "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{7000 + rank}",
            "PADDLE_RANK_IN_NODE": str(rank),
            "PADDLE_NNODES": "1",
            "JAX_COORDINATOR_ADDRESS": "127.0.0.1:7000",
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": "4",
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        }
        for rank in range(2)
    ]


def test_plan_on_gpus_of_the_second_node():
    workers = plan(
        "--ips", "10.0.0.1,10.0.0.2", "--host", "10.0.0.2", "--gpus", "0,1,2,3",
        "--nproc_per_node", "2",
    )  # fmt: skip
    assert [(w.rank, w.local_rank) for w in workers] == [(2, 0), (3, 1)]
    assert [w.env["CUDA_VISIBLE_DEVICES"] for w in workers] == ["0,1", "2,3"]
    assert [w.env["FLAGS_selected_gpus"] for w in workers] == ["0,1", "2,3"]
    assert workers[1].env["PADDLE_TRAINER_ENDPOINTS"] == (
        "10.0.0.1:6070,10.0.0.1:6071,10.0.0.2:6070,10.0.0.2:6071"
    )
    assert workers[1].env["PADDLE_CURRENT_ENDPOINT"] == "10.0.0.2:6071"
    assert workers[1].env["JAX_COORDINATOR_ADDRESS"] == "10.0.0.1:6070"
    assert "JAX_NUM_CPU_DEVICES" not in workers[0].env


def test_plan_finds_gpus_and_this_node():
    # One process per visible GPU by default; this node is the --ips entry it can bind.
    workers = plan("--ips", "198.51.100.1,127.0.0.1", environ={"CUDA_VISIBLE_DEVICES": "5,7"})
    assert [(w.rank, w.env["CUDA_VISIBLE_DEVICES"]) for w in workers] == [(2, "5"), (3, "7")]
    assert (
        plan(environ={"JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0"})[0].env["JAX_PLATFORMS"]
        == "cpu"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--gpus", "0,1,2", "--nproc_per_node", "2"],
            "3 GPUs (0,1,2) do not split evenly over --nproc_per_node 2 processes",
        ),
        (
            ["--gpus", "0,1", "--cpu_devices_per_proc", "4"],
            "--cpu_devices_per_proc applies without GPUs, but this node uses GPUs ['0', '1']; "
            "set JAX_PLATFORMS=cpu to train on the CPU",
        ),
        (["--ips", "10.0.0.1,10.0.0.2", "--host", "10.0.0.3"], "--host 10.0.0.3 is not one of"),
        (
            ["--ips", "198.51.100.1,198.51.100.2"],
            "cannot tell which of --ips 198.51.100.1,198.51.100.2 is this node (local addresses "
            "among them: none); pass --host",
        ),
        (["--ips", "10.0.0.1,,10.0.0.2"], "--ips='10.0.0.1,,10.0.0.2' has an empty entry"),
        (["--nproc_per_node", "0"], "--nproc_per_node must be at least 1, got 0"),
        (["--start_port", "70000"], "--start_port must be a port number 1..65535, got 70000"),
    ],
)
def test_plan_errors(argv, message):
    with pytest.raises(launch.LaunchError, match=re.escape(message)):
        plan(*argv)


def test_workers_get_their_variables_and_logs(launcher, tmp_path):
    port = free_port()
    proc = launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", "3", "--start_port", str(port),
        str(WORKER), "env", "--flag", "value",
    )  # fmt: skip
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    logs = [
        json.loads((tmp_path / "log" / f"workerlog.{r}").read_text().split("\n")[1]) for r in (0, 1)
    ]
    for rank, record in enumerate(logs):
        assert record["rank"] == rank
        assert record["args"] == ["--flag", "value"]
        assert record["env"]["PADDLE_CURRENT_ENDPOINT"] == f"127.0.0.1:{port + rank}"
        assert record["env"]["JAX_NUM_CPU_DEVICES"] == "3"
    # Worker 0 is also on the console, worker 1 only in its log.
    assert '"rank": 0' in out and '"rank": 1' not in out
    assert "fleetjax-run: starting workers 0..1 of 2" in err


def test_a_busy_port_is_reported(launcher):
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = launcher("--nproc_per_node", "2", "--start_port", str(port), str(WORKER), "env")
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip() == (
        f"fleetjax-run: error: the coordinator port {port} is already in use on this machine "
        "(another job?); choose a free one with --start_port"
    )


# -- nothing outlives a failure --------------------------------------------------------------
def test_a_failing_worker_stops_the_others(launcher, tmp_path):
    begin = time.monotonic()
    proc = launcher("--nproc_per_node", "3", "--start_port", str(free_port()), str(WORKER), "fail")
    _, err = proc.communicate(timeout=60)
    print(f"the launcher exited {time.monotonic() - begin:.1f} s after the failure")
    assert time.monotonic() - begin < 30
    assert proc.returncode == 3
    assert "fleetjax-run: worker 1 exited with code 3; stopping all workers" in err
    assert "worker 1 fails" in err  # the end of its log
    pids = worker_pids(tmp_path / "log")
    assert sorted(pids) == [0, 1, 2]
    assert not any(alive(pid) for pid in pids.values())


def _start_training(launcher, tmp_path) -> tuple[subprocess.Popen, dict[int, int]]:
    """Two joined JAX workers that synchronise forever; returns the launcher and {rank: pid}."""
    proc = launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", "2", "--start_port", str(free_port()),
        str(WORKER), "train",
    )  # fmt: skip
    logs = [tmp_path / "log" / f"workerlog.{rank}" for rank in (0, 1)]
    wait_for(lambda: all(log.exists() and "ready" in log.read_text() for log in logs), 120, "ready")
    return proc, worker_pids(tmp_path / "log")


def test_a_killed_worker_stops_the_others(launcher, tmp_path):
    proc, pids = _start_training(launcher, tmp_path)
    os.kill(pids[1], signal.SIGKILL)
    begin = time.monotonic()
    _, err = proc.communicate(timeout=60)
    print(f"the launcher exited {time.monotonic() - begin:.1f} s after the failure")
    assert time.monotonic() - begin < 30
    assert proc.returncode == 128 + signal.SIGKILL
    assert "fleetjax-run: worker 1 was killed by SIGKILL; stopping all workers" in err
    assert not alive(pids[0])


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stopping_the_launcher_stops_all(launcher, tmp_path, sig):
    proc = launcher("--nproc_per_node", "2", "--start_port", str(free_port()), str(WORKER), "fail")
    wait_for(lambda: len(worker_pids(tmp_path / "log")) == 2, 60, "workers")
    pids = worker_pids(tmp_path / "log")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    assert f"fleetjax-run: got {sig.name}; stopping all workers" in err
    assert not any(alive(pid) for pid in pids.values())


def test_workers_die_with_a_killed_launcher(launcher, tmp_path):
    proc = launcher("--nproc_per_node", "2", "--start_port", str(free_port()), str(WORKER), "fail")
    wait_for(lambda: len(worker_pids(tmp_path / "log")) == 2, 60, "workers")
    pids = worker_pids(tmp_path / "log")
    proc.kill()
    proc.communicate()
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), 10, "end of the workers")


# -- the same training on 2 processes as on 1 ------------------------------------------------
def _losses(output: str) -> dict[int, float]:
    return {int(s): float(v) for s, v in re.findall(r"^step (\d+): loss ([\d.]+)$", output, re.M)}


def test_two_processes_train_like_one(launcher, tmp_path):
    args = ["--steps", "12", "--log-every", "3", "--hidden", "64"]
    proc = launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", "4", "--start_port", str(free_port()),
        str(EXAMPLE), *args,
    )  # fmt: skip
    single = subprocess.run(
        [sys.executable, str(EXAMPLE), *args, "--cpu-devices", "8"],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert single.returncode == 0, single.stderr
    assert "8 cpu devices, mesh {'dp': 8" in out
    two, one = _losses(out), _losses(single.stdout)
    assert list(two) == list(one) == [3, 6, 9, 12]
    np.testing.assert_allclose(list(two.values()), list(one.values()), rtol=1e-5)
    # Worker 1 trained the same steps; its log has the same losses.
    assert _losses((tmp_path / "log" / "workerlog.1").read_text()) == two
