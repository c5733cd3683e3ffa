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


def test_one_traceback_and_nothing_after_the_stop_line(launcher, tmp_path):
    # Worker 0, whose log the console shows, raises: its traceback is on the console once (not
    # again as "the end of its log"); worker 1 prints when it gets SIGTERM, into its log only.
    proc = launcher("--nproc_per_node", "2", "--start_port", str(free_port()), str(WORKER), "fail0")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert (out + err).count("Traceback (most recent call last)") == 1, out + err
    assert "RuntimeError: worker 0 fails on purpose" in out
    assert err.endswith("fleetjax-run: worker 0 exited with code 1; stopping all workers\n"), err
    assert "worker 1 got SIGTERM" in (tmp_path / "log" / "workerlog.1").read_text()
    assert "SIGTERM" not in out + err
    # The traceback starts at the script: no frame of the launcher's entry (runpy).
    assert "runpy" not in out and "fleetjax/_worker.py" not in out
    _all_gone(tmp_path / "log", timeout=0)


def test_a_failed_workers_whole_traceback_is_shown_though_lines_follow_it(launcher):
    """The end of a failed worker's log goes back to its last traceback, when more than the
    usual 20 lines follow it (what JAX's threads log as its peers go)."""
    proc = launcher(
        "--nproc_per_node", "2", "--start_port", str(free_port()), str(WORKER), "noisy_raise"
    )  # fmt: skip
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    traceback = ["Traceback (most recent call last)", "in main\n", "raise RuntimeError("]
    assert _in_order(err, *traceback, "worker 1 fails on purpose\n", "after it 29\n"), err


def _in_order(text: str, *parts: str) -> bool:
    """Whether `parts` occur in `text` one after another (other text may come between)."""
    at = 0
    for part in parts:
        at = text.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


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
    # The traceback's lines in order; a log line of the worker's other threads (JAX's
    # distributed client, writing to the same file) may land between two of them.
    traceback = ["in main\n", 'raise RuntimeError("worker 1 fails on purpose")\n']
    assert _in_order(err, *traceback, "RuntimeError: worker 1 fails on purpose"), err
    assert err.count("Traceback (most recent call last)") == 1
    assert "worker 0" not in err
    log0 = (tmp_path / "log" / "workerlog.0").read_text()
    assert "Shutdown barrier" not in err + log0
    _all_gone(tmp_path / "log", timeout=0)


def _training(
    launcher, tmp_path, fault: str, *options: str, loop: str = "steps", devices: int = 2
) -> tuple[int, str, float]:
    """Two workers of `devices` CPU devices each training in `loop` (a TrainStep's steps, or
    plain `jit` all-reduces); worker 1's fault at step 5. The launcher's exit code, its stderr,
    and how long after the fault (as the worker that met it logged it) it exited."""
    proc = launcher(
        "--nproc_per_node", "2", "--cpu_devices_per_proc", str(devices),
        "--start_port", str(free_port()),
        *options, str(WORKER), loop, fault,
    )  # fmt: skip
    _, err = proc.communicate(timeout=180)
    ended = time.time()
    logs = "".join(log.read_text() for log in (tmp_path / "log").glob("workerlog.*"))
    fault_at = re.search(r"fault at ([\d.]+)", logs)
    _all_gone(tmp_path / "log", timeout=0)
    return proc.returncode, err, ended - float(fault_at[1]) if fault_at else float("nan")


def _stacks_logged(tmp_path, *ranks: int) -> None:
    """Assert that the launcher put the stacks of workers `ranks` (their main threads in
    launch_worker.py) into their logs."""
    for rank in ranks:
        log = (tmp_path / "log" / f"workerlog.{rank}").read_text()
        report = log.partition(f"fleetjax-run: the stacks of worker {rank} (")[2]
        assert re.search(r"^Current thread 0x|^Thread 0x", report, re.M), log[-3000:]
        assert 'launch_worker.py", line' in report, report


def test_a_worker_that_exits_while_the_others_are_in_a_collective_is_named_at_once(
    launcher, tmp_path
):
    # sys.exit(3) runs JAX's exit handler, which waits up to 5 minutes in the shutdown
    # barrier for worker 0, which waits in the step's all-reduce for worker 1.
    code, err, after = _training(launcher, tmp_path, "exit3")
    print(f"the launcher exited {after:.1f} s after worker 1's sys.exit(3)")
    assert after < 10
    assert code == 3
    assert err.endswith("fleetjax-run: worker 1 exited with code 3; stopping all workers\n"), err
    assert "worker 0" not in err


def test_a_worker_that_leaves_early_with_code_0_is_named_at_once(launcher, tmp_path):
    # os._exit(0) after joining: gone without JAX's shutdown barrier, while worker 0 needs it
    # in its all-reduce (which would fail only when JAX misses its heartbeats, 10 s later).
    code, err, after = _training(launcher, tmp_path, "os_exit0")
    print(f"the launcher exited {after:.1f} s after worker 1's os._exit(0)")
    assert after < 10
    assert code == 1
    assert err.endswith(
        "fleetjax-run: worker 1 exited with code 0 without ending its script (os._exit?) while "
        "the others ran, who need it in their collectives; stopping all workers\n"
    ), err


@pytest.mark.parametrize(
    "loop, steps", [("steps", " after 5 steps, the fewest"), ("jit", "")], ids=["steps", "jit"]
)
def test_a_spinning_worker_is_named_not_those_waiting_for_it(launcher, tmp_path, loop, steps):
    # Worker 1 spins in Python after 5 steps; worker 0 waits in step 6's all-reduce, a
    # TrainStep's or a plain jax.jit one's. Neither prints. Worker 0's stack shows it waiting
    # (in JAX, or in a call into XLA), worker 1's runs Python code; with TrainSteps worker 0
    # also made one more call (before this change, with plain jit: worker 0, in 3 of 3 runs).
    code, err, after = _training(launcher, tmp_path, "spin", "--heartbeat_timeout", "8", loop=loop)
    print(f"the launcher exited {after:.1f} s after worker 1 began to spin")
    assert 8 < after < 8 + 15
    assert code == 124
    assert re.search(
        r"fleetjax-run: worker 1 made no progress for \d+ s \(no output, no step, no heartbeat; "
        rf"--heartbeat_timeout 8\){steps}, at launch_worker.py:\d+ \(in _faults\) while the "
        r"others wait; stopping all workers\n$",
        err,
    ), err
    _stacks_logged(tmp_path, 0, 1)


@pytest.mark.slow  # 25 s; the hang timeout runs by default with a spinning worker
def test_a_hang_in_the_first_step_is_named(launcher, tmp_path):
    # The first step's host callback sleeps on one process: every worker is in its first
    # TrainStep call, which compiled and now waits. Compiling is progress, waiting is not
    # (before this change: the first call beat for as long as it lasted, named never). One
    # device a process: JAX's CPU client runs a small one-device program on the calling
    # thread, so the wait is inside the call (with two, the call returns and the step waits
    # for its result after it).
    code, err, after = _training(
        launcher, tmp_path, "first_call", "--heartbeat_timeout", "8", devices=1
    )
    print(f"the launcher exited {after:.1f} s after the first step began to wait")
    assert 8 < after < 8 + 15
    assert code == 124
    assert re.search(r"fleetjax-run: worker \d made no progress for \d+ s ", err), err


@pytest.mark.slow  # 17 s; by default a hung worker is named by the launcher's timeout
def test_a_frozen_worker_is_named_when_jax_misses_its_heartbeats(launcher, tmp_path):
    # SIGSTOP: worker 1 sends JAX no heartbeat; after twice --peer_timeout (8 s) JAX's
    # coordination service ends worker 0 (SIGABRT), whose log names the silent task.
    code, err, after = _training(launcher, tmp_path, "freeze")
    print(f"the launcher exited {after:.1f} s after worker 1 froze")
    assert after < 8 + 10
    assert code == 124
    assert err.endswith(
        "fleetjax-run: worker 1 stopped sending heartbeats to JAX's coordination service (so JAX "
        "ended worker 0 with SIGABRT); stopping all workers\n"
    ), err


@pytest.mark.slow  # 15 s of silent training; the hang tests run by default
def test_train_steps_are_progress(launcher, tmp_path):
    # 10 s of silent training under an 8 s timeout (longer than importing JAX and joining on a
    # busy machine): each TrainStep call is progress, and so are init's and the first call's
    # compiles.
    code, err, _ = _training(launcher, tmp_path, "none", "--heartbeat_timeout", "8")
    assert code == 0, err


@pytest.mark.slow  # 20 s; by default a worker that leaves by os._exit(0) is named at once
def test_a_worker_that_ends_with_0_while_the_others_wait_is_named_in_seconds(launcher, tmp_path):
    # raise SystemExit(0) after 5 steps: worker 1 waits in JAX's shutdown barrier, worker 0 in
    # step 6's all-reduce (before this change: named by the hang timeout, or JAX's 301 s).
    code, err, after = _training(launcher, tmp_path, "raise_exit0")
    print(f"the launcher exited {after:.1f} s after worker 1's SystemExit(0)")
    assert after < 5 + 15
    assert code == 1
    assert re.search(
        r"fleetjax-run: worker 1 ended its script with code 0 after 5 steps while the others "
        r"ran; they made no progress for \d+ s since, waiting in JAX after 6 steps \(their "
        r"stacks are in their logs\); stopping all workers\n$",
        err,
    ), err
    _stacks_logged(tmp_path, 0)


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
        r"fleetjax-run: worker 1 made no progress for \d+ s \(no output, no step, no heartbeat; "
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


# -- several nodes (on this machine, meeting at --master) ---------------------------------------
def _node(launcher, tmp_path, master: str, rank: int, *args: str) -> subprocess.Popen:
    """Node `rank` of a job of 2 meeting at `master`, its log in `tmp_path/node<rank>`."""
    options = ["--master", master, "--nnodes", "2", "--rank", str(rank)]
    return launcher(*options, *args, log_dir=tmp_path / f"node{rank}")


def _two_nodes(launcher, tmp_path, mode: str) -> list[subprocess.Popen]:
    """Nodes 0 and 1 of a job (one worker each, 2 CPU devices) running `mode`; their
    launchers, once both workers are ready."""
    master = f"127.0.0.1:{free_port()}"
    worker = ["--nproc_per_node", "1", "--cpu_devices_per_proc", "2", str(WORKER), mode]
    nodes = [
        _node(launcher, tmp_path, master, rank, "--start_port", str(free_port()), *worker)
        for rank in (0, 1)
    ]
    logs = [tmp_path / f"node{rank}" / f"workerlog.{rank}" for rank in (0, 1)]
    wait_for(lambda: all(log.exists() and "ready" in log.read_text() for log in logs), 120, "ready")
    return nodes


def _ended(nodes, tmp_path, begin: float) -> list[tuple[int, str, float]]:
    """Each node's exit code, stderr and seconds from `begin` to its exit."""
    ended = []
    for node in nodes:
        _, err = node.communicate(timeout=60)
        ended.append((node.returncode, err, time.monotonic() - begin))
    for rank in (0, 1):
        _all_gone(tmp_path / f"node{rank}", timeout=5)
    return ended


def test_a_worker_killed_on_another_node_is_named_on_both(launcher, tmp_path):
    nodes = _two_nodes(launcher, tmp_path, "train")
    os.kill(worker_pids(tmp_path / "node1")[1], signal.SIGKILL)
    ended = _ended(nodes, tmp_path, time.monotonic())
    print(f"nodes ended {ended[0][2]:.1f} s and {ended[1][2]:.1f} s after the kill")
    for code, err, after in ended:
        assert after < 10
        assert code == 128 + signal.SIGKILL
        assert err.endswith(
            "fleetjax-run: worker 1 on node 1 (127.0.0.1, workers 1..1) was killed by SIGKILL; "
            "stopping all workers\n"
        ), err


def test_a_killed_launcher_of_another_node_stops_the_job(launcher, tmp_path):
    nodes = _two_nodes(launcher, tmp_path, "train")
    nodes[1].kill()  # its worker dies with it (PR_SET_PDEATHSIG)
    (code, err, after), _ = _ended(nodes, tmp_path, time.monotonic())
    print(f"node 0 ended {after:.1f} s after node 1's launcher was killed")
    assert after < 10
    assert code == 124
    assert err.endswith(
        "fleetjax-run: node 1 (127.0.0.1, workers 1..1) ended: its launcher's connection closed "
        "(killed, or stopped); stopping all workers\n"
    ), err


@pytest.mark.slow  # 13 s; by default a killed launcher of another node stops the job
def test_a_stopped_launcher_stops_every_node(launcher, tmp_path):
    nodes = _two_nodes(launcher, tmp_path, "train")
    nodes[1].send_signal(signal.SIGTERM)
    ended = _ended(nodes, tmp_path, time.monotonic())
    print(f"nodes ended {ended[0][2]:.1f} s and {ended[1][2]:.1f} s after SIGTERM")
    assert [code for code, _, _ in ended] == [128 + signal.SIGTERM] * 2
    assert ended[1][1].endswith("fleetjax-run: got SIGTERM; stopping all workers\n")
    assert ended[0][1].endswith(
        "fleetjax-run: the launcher of node 1 (127.0.0.1, workers 1..1) got SIGTERM; stopping "
        "all workers\n"
    ), ended[0][1]


def test_nodes_with_different_process_counts_are_refused(launcher, tmp_path):
    master = f"127.0.0.1:{free_port()}"
    nodes = [
        _node(launcher, tmp_path, master, rank, "--nproc_per_node", str(rank + 1),
              "--start_port", str(7000 + 100 * rank), str(WORKER), "env")
        for rank in (0, 1)
    ]  # fmt: skip
    errors = [node.communicate(timeout=60)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [2, 2]
    problem = (
        "the nodes run different numbers of processes (--nproc_per_node): 1 at 127.0.0.1:7000, "
        "2 at 127.0.0.1:7100; give every node the same"
    )
    assert sorted(errors) == [  # either node may serve the rendezvous
        f"fleetjax-run: error: {problem}\n",
        f"fleetjax-run: error: the rendezvous at {master} refused: {problem}\n",
    ]
    assert not (tmp_path / "node0" / "workerlog.0").exists()  # nothing started


def test_a_node_that_never_comes_is_an_error_within_the_join_timeout(launcher, tmp_path):
    master = f"127.0.0.1:{free_port()}"
    begin = time.monotonic()
    proc = launcher("--master", master, "--nnodes", "2", "--join_timeout", "2", str(WORKER), "env")
    _, err = proc.communicate(timeout=60)
    print(f"the launcher gave up {time.monotonic() - begin:.1f} s after it started")
    assert proc.returncode == 2
    assert err == (
        "fleetjax-run: error: 1 of --nnodes 2 nodes came to the rendezvous within 2 s "
        "(--join_timeout)\n"
    )
