"""Two hosts for tests: network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2.

`two_hosts` (a fixture) makes them for one test and removes them afterwards; it needs root and
the `ip` command, and skips the test (saying why) otherwise. Each `Hosts.launch` starts
`python -m fleetjax.launch` in a namespace, with a thread that timestamps its stderr lines.
Everything the test started runs in its namespaces: `Hosts.left` lists what is still running
there (`ip netns pids`), and the fixture kills those processes, by pid, before deleting the
namespaces (which deletes the veth pair).
"""

import dataclasses
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
from launching import ENV

ADDRESSES = ("10.77.0.1", "10.77.0.2")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclasses.dataclass
class Launched:
    """A launcher in one of the namespaces: its process and its stderr lines, timestamped."""

    proc: subprocess.Popen
    lines: list[tuple[float, str]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.time(), line))

    def wait(self, timeout: float) -> tuple[int, str, float]:
        """Its exit code, its stderr and when it exited (time.time())."""
        self.proc.wait(timeout=timeout)
        ended = time.time()
        self._reader.join(timeout=10)
        return self.proc.returncode, "".join(line for _, line in self.lines), ended

    def said(self, text: str) -> float:
        """When it first wrote a line holding `text` (time.time())."""
        return next(t for t, line in self.lines if text in line)


class Hosts:
    """Namespaces `<prefix>0` and `<prefix>1`, at `ADDRESSES`."""

    def __init__(self) -> None:
        prefix = f"fj{os.getpid()}h"
        self.names = [f"{prefix}{i}" for i in (0, 1)]
        self.links = [f"{prefix}v{i}" for i in (0, 1)]  # at most 15 characters
        self.launched: list[Launched] = []
        _ip("netns", "add", self.names[0])
        try:
            _ip("netns", "add", self.names[1])
            _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for name, link, address in zip(self.names, self.links, ADDRESSES, strict=True):
                _ip("link", "set", link, "netns", name)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                _ip("-n", name, "link", "set", link, "up")
                _ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def launch(self, host: int, *args: str, cwd: pathlib.Path) -> Launched:
        """`fleetjax-run ARGS` on host `host` (its stdout to DEVNULL)."""
        command = ["ip", "netns", "exec", self.names[host], sys.executable, "-m", "fleetjax.launch"]
        proc = subprocess.Popen(
            [*command, *args],
            cwd=cwd,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.launched.append(Launched(proc))
        return self.launched[-1]

    def link_down(self, host: int) -> None:
        _ip("-n", self.names[host], "link", "set", self.links[host], "down")

    def left(self) -> list[int]:
        """The processes still running in the namespaces."""
        pids = []
        for name in self.names:
            out = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            pids += [int(pid) for pid in out.stdout.split()]
        return pids

    def listening(self, host: int) -> set[str]:
        """`address:port` of every TCP socket listening on host `host`."""
        out = subprocess.run(
            ["ip", "netns", "exec", self.names[host], "ss", "-Hltn"],
            capture_output=True,
            text=True,
            check=True,
        )
        return {
            line.split()[3].replace("[::ffff:", "").replace("]", "")
            for line in out.stdout.splitlines()
        }

    def close(self) -> None:
        for launched in self.launched:
            launched.proc.kill()
            launched.proc.wait()
        for pid in self.left():
            os.kill(pid, signal.SIGKILL)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0:
        pytest.skip("two hosts from network namespaces need root")
    if shutil.which("ip") is None or shutil.which("ss") is None:
        pytest.skip("two hosts from network namespaces need the ip and ss commands (iproute2)")
    try:
        hosts = Hosts()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    yield hosts
    hosts.close()
    assert hosts.left() == []
