"""Ending every process of a `fleetjax-run` job, whoever started it and however detached.

Each worker gets `FLEETJAX_RUN_ID=<the run's id>` in its environment (`fleetjax._worker.RUN_ID`),
which its children inherit, also those that leave its process group or session (a daemon,
`setsid`). A process of the run is one whose initial environment (`/proc/PID/environ`) holds
that entry, the run's marker, or one in a worker's process group; `stop` signals all of
them. The launcher stops its job this way, and a
guard process (this file run as a script, in a session of its own) does it when the launcher
ends without doing so: killed by SIGKILL, say. The guard reads worker process-group ids from
stdin, one a line; end of file means the launcher is gone. It runs in isolated mode (`-I`),
where fleetjax may not be importable: it imports nothing of it, and takes the marker whole.

Linux only (`/proc`). A child that clears its environment and leaves its worker's process group
is not found.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Collection

_POLL_SECONDS = 0.05


def members(marker: str, groups: Collection[int] = ()) -> list[int]:
    """The live processes of the run: those whose environment holds `marker`
    (`FLEETJAX_RUN_ID=<id>`) or whose process group is one of `groups` (zombies, dead but not
    yet reaped, are not)."""
    needle = marker.encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        # Gone meanwhile, or another user's (unreadable): not ours.
        with contextlib.suppress(OSError):
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                # "pid (command) state ppid pgid ...": the command may hold spaces.
                state, _, pgid = f.read().rpartition(b")")[2].split()[:3]
            if state == b"Z":
                continue
            if int(pgid) not in groups:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if needle not in f.read().split(b"\0"):
                        continue
            found.append(int(entry.name))
    return found


def _signal(marker: str, groups: Collection[int], sig: int) -> bool:
    """Send `sig` to the run's processes; whether there were any."""
    pids = members(marker, groups)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    return bool(pids)


def stop(marker: str, groups: Collection[int], grace: float) -> None:
    """SIGTERM the run's processes (those with `marker` in their environment and those in
    process groups `groups`), and SIGKILL what is left after `grace` seconds, until none is
    left."""
    if not _signal(marker, groups, signal.SIGTERM):
        return
    deadline = time.monotonic() + grace
    while members(marker, groups) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    # Again and again: a process may fork while it is being killed.
    deadline = time.monotonic() + grace
    while _signal(marker, groups, signal.SIGKILL) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)


def _guard(marker: str, grace: float) -> None:
    """Wait for the launcher to end (stdin closes), then stop what is left of its run."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # whatever ends the launcher must not end this
    groups = {int(line) for line in sys.stdin}
    stop(marker, groups, grace)


if __name__ == "__main__":
    _guard(sys.argv[1], float(sys.argv[2]))
