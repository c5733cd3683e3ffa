"""How a worker of `fleetjax-run` shows that it makes progress, and how far it got.

The launcher takes a worker as hung when neither its log (`FLEETJAX_HEARTBEAT_FILE`) nor its
steps file (`FLEETJAX_STEPS_FILE`) changed for `--heartbeat_timeout` seconds. Output counts;
`beat()` touches the log; each `TrainStep` call writes the number of calls so far to the steps
file (one `pwrite`), and a first call, which compiles, also beats every second while it lasts.
Of several silent workers, the one with the fewest steps is the one the others wait for.
Outside `fleetjax-run` nothing is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import weakref
from collections.abc import Hashable, Iterator

from fleetjax._worker import HEARTBEAT_FILE, STEPS_FILE

_BUSY_INTERVAL_SECONDS = 1.0
_RAN: weakref.WeakKeyDictionary[object, set[Hashable]] = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class _Steps:
    """This process's step calls, and the steps file it writes them to."""

    count: int = 0
    path: str = ""
    fd: int = -1


_STEPS = _Steps()


def beat() -> None:
    """Mark progress: touch the worker's log (nothing outside `fleetjax-run`)."""
    path = os.environ.get(HEARTBEAT_FILE)
    if path:
        with contextlib.suppress(OSError):  # the log removed: nothing to tell
            os.utime(path)


def _count_step() -> None:
    path = os.environ.get(STEPS_FILE)
    if not path:
        return
    _STEPS.count += 1
    with contextlib.suppress(OSError):  # the run's folder removed: nothing to tell
        if _STEPS.path != path:
            _STEPS.fd, _STEPS.path = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), path
        # The count only grows, so its text never gets shorter: nothing stale is left after it.
        os.pwrite(_STEPS.fd, f"{_STEPS.count}\n".encode(), 0)


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Beat every second until the block ends: for work that is progress without output
    (compiling a step), never for waiting on other processes."""
    if not os.environ.get(HEARTBEAT_FILE):
        yield
        return
    done = threading.Event()

    def keep_beating() -> None:
        while not done.wait(_BUSY_INTERVAL_SECONDS):
            beat()

    thread = threading.Thread(target=keep_beating, name="fleetjax-liveness", daemon=True)
    beat()
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        beat()


@contextlib.contextmanager
def progress(owner: object, key: Hashable) -> Iterator[None]:
    """A step of `owner`'s computation `key`: counted, with beats every second while its
    first run (which compiles it) lasts."""
    first = key not in _RAN.setdefault(owner, set())
    _count_step()
    with busy() if first else contextlib.nullcontext():
        yield
    _RAN[owner].add(key)
