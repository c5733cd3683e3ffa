"""fleetjax-run under faults: a worker that fails, raises, hangs or is killed; a launcher that is
stopped or killed; a worker's detached child; a console that closes early. Each test tracks the
processes by the pids the workers log, and checks that none is left running."""

import os
import re
import signal
import subprocess
import time

import pytest
from launching import WORKER, alive, free_port, logged_pids, wait_for, worker_pids


def _all_gone(log_dir, timeout: float = 15) -> None:
    pids = logged_pids(log_dir)
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), timeout, f"end of {pids}")


def _joined(launcher, tmp_path, mode: str, devices: str = "2") -> subprocess.Popen:
    """Two workers that joined with fleet.init() and run `mode`; the launcher."""
    proc = launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", devices, "--start_port",
        str(free_port()), str(WORKER), mode,
    )  # fmt: skip
    logs = [tmp_path / "log" / f"workerlog.{rank}" for rank in (0, 1)]
    wait_for(lambda: all(log.exists() and "ready" in log.read_text() for log in logs), 120, "ready")
    return proc


def test_a_failing_worker_stops_the_others(launcher, tmp_path):
    proc = launcher("--nproc_per_node", "3", "--start_port", str(free_port()), str(WORKER), "fail")
    _, err = proc.communicate(timeout=60)
    after = time.time() - (tmp_path / "log" / "workerlog.1").stat().st_mtime
    print(f"the launcher exited {after:.1f} s after worker 1's last output (its exit)")
    assert after < 10
    assert proc.returncode == 3, err
    assert "fleetjax-run: worker 1 exited with code 3; stopping all workers" in err, err
    assert "worker 1 fails" in err  # the end of its log
    assert sorted(worker_pids(tmp_path / "log")) == [0, 1, 2]
    _all_gone(tmp_path / "log", timeout=0)


def test_a_raising_worker_is_named_within_10_s(launcher, tmp_path):
    # Worker 1 raises right after joining, worker 0 computes: the job must not wait in JAX's
    # shutdown barrier, nor blame worker 0.
    proc = _joined(launcher, tmp_path, "raise", devices="4")
    _, err = proc.communicate(timeout=60)
    ended = time.time()
    raised = float(re.search(r"raising at ([\d.]+)", err)[1])
    print(f"the launcher exited {ended - raised:.1f} s after worker 1 raised")
    assert ended - raised < 10
    assert proc.returncode == 1
    assert "fleetjax-run: worker 1 exited with code 1; stopping all workers" in err
    assert "RuntimeError: worker 1 fails on purpose" in err
    assert 'in main\n    raise RuntimeError("worker 1 fails on purpose")' in err
    assert "worker 0" not in err
    log0 = (tmp_path / "log" / "workerlog.0").read_text()
    assert "Shutdown barrier" not in err + log0
    _all_gone(tmp_path / "log", timeout=0)


def test_a_killed_worker_stops_the_others(launcher, tmp_path):
    proc = _joined(launcher, tmp_path, "train")
    pids = worker_pids(tmp_path / "log")
    os.kill(pids[1], signal.SIGKILL)
    begin = time.monotonic()
    _, err = proc.communicate(timeout=60)
    print(f"the launcher exited {time.monotonic() - begin:.1f} s after the kill")
    assert time.monotonic() - begin < 10
    assert proc.returncode == 128 + signal.SIGKILL
    assert "fleetjax-run: worker 1 was killed by SIGKILL; stopping all workers" in err
    _all_gone(tmp_path / "log", timeout=0)


def test_a_hung_worker_is_stopped_by_the_heartbeat_timeout(launcher, tmp_path):
    # Longer than the workers' start (importing JAX): a timeout must cover silent phases.
    proc = launcher(
        "--nproc_per_node", "2", "--heartbeat_timeout", "6", "--start_port", str(free_port()),
        str(WORKER), "hang",
    )  # fmt: skip
    _, err = proc.communicate(timeout=60)
    silent = time.time() - (tmp_path / "log" / "workerlog.1").stat().st_mtime
    print(f"the launcher exited {silent:.1f} s after worker 1's last output")
    assert proc.returncode == 124
    assert 6 < silent < 6 + 10
    # Worker 0 printed nothing either after its first lines, but called heartbeat().
    assert "worker 1 works" in err  # the end of its log
    assert re.search(
        r"fleetjax-run: worker 1 made no progress for \d+ s \(no output, no heartbeat; "
        r"--heartbeat_timeout 6\); stopping all workers",
        err,
    ), err
    assert "worker 0 made no progress" not in err
    _all_gone(tmp_path / "log", timeout=0)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_stopping_the_launcher_stops_all_even_detached(launcher, tmp_path, sig):
    # Each worker started a child and a detached process (a session of its own, holding the
    # log open): the launcher ends them all and waits for none of them.
    proc = launcher("--nproc_per_node", "2", "--start_port", str(free_port()), str(WORKER), "spawn")
    wait_for(lambda: len(logged_pids(tmp_path / "log")) == 6, 60, "workers and their children")
    proc.send_signal(sig)
    begin = time.monotonic()
    _, err = proc.communicate(timeout=30)
    print(f"the launcher exited {time.monotonic() - begin:.1f} s after {sig.name}")
    assert time.monotonic() - begin < 10
    assert proc.returncode == 128 + sig
    assert f"fleetjax-run: got {sig.name}; stopping all workers" in err
    _all_gone(tmp_path / "log", timeout=0)


def test_a_killed_launcher_leaves_nothing_running(launcher, tmp_path):
    proc = launcher("--nproc_per_node", "2", "--start_port", str(free_port()), str(WORKER), "spawn")
    wait_for(lambda: len(logged_pids(tmp_path / "log")) == 6, 60, "workers and their children")
    proc.kill()
    begin = time.monotonic()
    _all_gone(tmp_path / "log", timeout=15)
    print(f"everything ended {time.monotonic() - begin:.1f} s after the launcher's SIGKILL")


def test_a_closed_console_blocks_no_worker(launcher, tmp_path):
    # As `fleetjax-run ... | head -1`: the console closes after a line; worker 0 goes on
    # printing into its log, and the run ends normally.
    lines = 2000
    proc = launcher(
        "--nproc_per_node", "2", "--start_port", str(free_port()), str(WORKER), "chatty",
        str(lines), stderr=subprocess.DEVNULL,
    )  # fmt: skip
    proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=60) == 0
    log = (tmp_path / "log" / "workerlog.0").read_text()
    assert f"line {lines - 1}\n" in log
    _all_gone(tmp_path / "log", timeout=0)
