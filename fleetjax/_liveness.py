"""How a worker of `fleetjax-run` shows that it makes progress, and how far it got.

The launcher takes a worker as hung when neither its log (`FLEETJAX_HEARTBEAT_FILE`) nor its
steps file (`FLEETJAX_STEPS_FILE`) changed for `--heartbeat_timeout` seconds. Output counts;
`beat()` touches the log; each `TrainStep` call writes the number of calls so far to the steps
file (one `pwrite`), and a first call also beats every second while it compiles (not while it
then runs: a first step that waits for another worker is a hang like any other). Of several
silent workers, the one with the fewest steps is the one the others wait for. Outside
`fleetjax-run` nothing is written.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import threading
import weakref
from collections.abc import Hashable, Iterator
from typing import Any

from fleetjax._worker import HEARTBEAT_FILE, STEPS_FILE

_BUSY_INTERVAL_SECONDS = 1.0
_RAN: weakref.WeakKeyDictionary[object, set[Hashable]] = weakref.WeakKeyDictionary()
# JAX's events at the end of a compile: XLA's, or a hit in the persistent compilation cache.
_COMPILED_EVENTS = (
    "/jax/core/compile/backend_compile_duration",
    "/jax/compilation_cache/cache_retrieval_time_sec",
)
_compiles: collections.Counter[int] = collections.Counter()  # ended, by the compiling thread


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


def _count_compile(event: str, duration: float, **kwargs: Any) -> None:
    if event in _COMPILED_EVENTS:
        _compiles[threading.get_ident()] += 1


@functools.cache
def _listen_to_compiles() -> None:
    import jax.monitoring  # only here: the launcher imports this module too

    jax.monitoring.register_event_duration_secs_listener(_count_compile)


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Beat every second until the block's first compile ends (the whole block if it compiles
    nothing): compiling is progress without output; running what it compiled, which may wait
    on other processes, is not."""
    if not os.environ.get(HEARTBEAT_FILE):
        yield
        return
    _listen_to_compiles()
    done, caller = threading.Event(), threading.get_ident()
    compiled_before = _compiles[caller]

    def keep_beating() -> None:
        while not done.wait(_BUSY_INTERVAL_SECONDS) and _compiles[caller] == compiled_before:
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
    first call compiles it."""
    first = key not in _RAN.setdefault(owner, set())
    _count_step()
    with busy() if first else contextlib.nullcontext():
        yield
    _RAN[owner].add(key)
