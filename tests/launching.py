"""Helpers for the tests that start `python -m fleetjax.launch`: the `launcher` fixture, which
kills whatever a test left running, and ways to find the processes a run started."""

import ipaddress
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = pathlib.Path(__file__).parent
WORKER = HERE / "launch_worker.py"
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


def logged_pids(log_dir: pathlib.Path) -> dict[str, int]:
    """{name: pid} of every `name=<pid>` the workers printed: `pid.<rank>` for worker `rank`
    itself, `child.<rank>` and `detached.<rank>` for what it started."""
    pids = {}
    for log in log_dir.glob("workerlog.*"):
        rank = log.suffix[1:]
        for name, pid in re.findall(r"\b(pid|child|detached)=(\d+)", log.read_text()):
            pids[f"{name}.{rank}"] = int(pid)
    return pids


def worker_pids(log_dir: pathlib.Path) -> dict[int, int]:
    """{rank: pid} of the workers that have started, from their logs."""
    return {
        int(name.partition(".")[2]): pid
        for name, pid in logged_pids(log_dir).items()
        if name.startswith("pid.")
    }


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(0.1)


def _kill_left_over(procs: list[tuple[subprocess.Popen, pathlib.Path]]) -> None:
    """Kill the launchers and every process their workers logged."""
    for proc, log_dir in procs:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
        for pid in logged_pids(log_dir).values() if log_dir.exists() else ():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def launcher(tmp_path):
    """Start `python -m fleetjax.launch ARGS` (after `prefix`, a command that runs it; its
    stdout and stderr piped, text); whatever happens, kill it and every process its workers
    logged afterwards."""
    started = []

    def start(
        *args: str, log_dir: pathlib.Path | None = None, prefix: tuple[str, ...] = (), **popen
    ) -> subprocess.Popen:
        log_dir = log_dir or tmp_path / "log"
        command = [*prefix, sys.executable, "-m", "fleetjax.launch", "--log_dir", str(log_dir)]
        command += args
        popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen}
        proc = subprocess.Popen(command, env=ENV, **popen)
        started.append((proc, log_dir))
        return proc

    yield start
    _kill_left_over(started)


def worker_pid(log: pathlib.Path) -> int | None:
    """The pid of the running worker whose log is `log` (fleetjax-run gives each worker its
    log's path in FLEETJAX_HEARTBEAT_FILE), if any."""
    needle = f"FLEETJAX_HEARTBEAT_FILE={log.absolute()}".encode()
    for entry in pathlib.Path("/proc").iterdir():
        try:
            environ = entry.joinpath("environ").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        if needle in environ.split(b"\0") and alive(int(entry.name)):
            return int(entry.name)
    return None


def docs_training_script(folder: pathlib.Path) -> pathlib.Path:
    """docs/checkpoints.md's resumable training loop, as `folder/train.py`."""
    text = (HERE.parent / "docs" / "checkpoints.md").read_text()
    script = folder / "train.py"
    script.write_text(re.search(r"```python\n(.*?)```", text, re.S)[1])
    return script


def losses(text: str) -> list[tuple[int, str]]:
    """Every `step N: loss X` line of `text`, in order."""
    return [(int(s), v) for s, v in re.findall(r"^step (\d+): loss (\S+)$", text, re.M)]


def listening(port: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local addresses of the TCP sockets listening on `port` (from /proc/net)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in pathlib.Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            hex_address, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:  # 0A: LISTEN
                continue
            # 32-bit words in the host's byte order (little-endian here).
            words = bytes.fromhex(hex_address)
            raw = b"".join(words[i : i + 4][::-1] for i in range(0, len(words), 4))
            address = ipaddress.ip_address(raw)
            found.add(getattr(address, "ipv4_mapped", None) or address)
    return found
