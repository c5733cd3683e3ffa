"""One attempt of a job on this node: its workers started, watched until the first failure,
stopped (`fleetjax-run`'s supervision; fleetjax/launch/_job.py decides what follows).

The first failure is the first worker that ends with a code other than 0 (its exit, or the code
its `fleetjax._worker` entry recorded before JAX's shutdown barrier), that is killed, or that
makes no progress for `--heartbeat_timeout` seconds. Of the silent workers, the one named is
the one the others wait for: the launcher looks at what each does (`Snapshot`: its Python
stacks, which go into its log, and whether its main thread runs Python code or waits in a call
into C), then counts steps and silence. A worker that ended its script with code 0 after fewer
steps than the others, who then wait for it, is named `EARLY_END_SECONDS` later; a worker that
exited with 0 while others ran is named first if one of them then fails (its peers lost it). A
worker that JAX's coordination service ended (SIGABRT) because another stopped sending
heartbeats names that other one.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence

from fleetjax import _worker
from fleetjax.launch import _guard

GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL when stopping workers (Paddle's)
LOG_TAIL_LINES = 20  # of a failed worker's log, shown on the console
TRACEBACK_LINES = 200  # at most, to show a failed worker's whole last traceback
_TRACEBACK = "Traceback (most recent call last)"
HANG_EXIT_CODE = 124  # a worker or node that stopped answering (as timeout(1))
# A worker's peers may see it killed (its connections closed) and fail before the launcher's
# thread that waits for it wakes up: its death is dated this much earlier. JAX and Gloo end a
# worker whose peer failed with SIGABRT, which is not dated back.
KILL_SEEN_LATE_SECONDS = 0.25
_POLL_SECONDS = 0.1
# After a worker ended its script early, how long the others must have made no progress (and
# wait in JAX) before it is named as the one they wait for.
EARLY_END_SECONDS = 5.0
STACKS_WAIT_SECONDS = 3.0  # for the workers' stack dumps (a loaded machine schedules late)
LOOK_SECONDS = 1.0  # when the launcher looks at what the workers do: the probes' span
PROBES = 5  # of whether a worker's main thread runs Python code
# Where a main thread's innermost Python frame shows that it waits for the other processes: in
# JAX (a collective, a transfer, XLA running) or in fleetjax's agreements.
_WAITING_IN = (
    f"{os.sep}jax{os.sep}",
    f"{os.sep}jaxlib{os.sep}",
    os.path.join("fleetjax", "_coordinator.py"),
)
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$', re.M)
# Loaded here, not in the forked child, where only the call itself should run.
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None
# What JAX's coordination service logs before it ends a process for another's silence.
_JAX_LOST = re.compile(r"unhealthy \(stopped sending heartbeats\):\s*\n((?:\d+\s*\n)+)")
_JAX_EARLY = re.compile(r"Shutdown barrier has failed.*?The first task at the barrier: (\d+)", re.S)


@dataclasses.dataclass(frozen=True)
class Worker:
    """One process to start on this node.

    Attributes:
      rank: the global worker index (`PADDLE_TRAINER_ID`; a parameter server's index).
      local_rank: the index on this node (`PADDLE_RANK_IN_NODE`).
      env: the variables this launcher sets for it (on top of its own environment).
      role: "worker", or "server" (a parameter server).
    """

    rank: int
    local_rank: int
    env: dict[str, str]
    role: str = "worker"

    @property
    def log_name(self) -> str:
        """Its log's file name: Paddle's `workerlog.N` or `serverlog.N`."""
        return f"{self.role}log.{self.rank}"


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first failure of an attempt, as every node names it.

    Attributes:
      who: "worker 1", "node 1 (10.0.0.2, workers 2..3)", ...
      what: "exited with code 3", "was killed by SIGKILL", "made no progress for 600 s ..."
      code: the job's exit code.
      time: when it happened (time.time() of the node that saw it): the earliest is first.
      log: the log to show the end of (on the node that ran the worker), or "".
    """

    who: str
    what: str
    code: int
    time: float
    log: str = ""

    @property
    def line(self) -> str:
        return f"{self.who} {self.what}"


# The launcher's own lines: `--log_level` (Paddle's, default INFO) sets which are shown.
LOG = logging.getLogger("fleetjax.launch")
LOG.setLevel(logging.INFO)


def say(message: str, level: int = logging.ERROR) -> None:
    """One line (or a block) on the launcher's stderr, prefixed `fleetjax-run: `, unless
    `level` is below `LOG`'s (what goes wrong is an ERROR, the job's progress INFO)."""
    if not LOG.isEnabledFor(level):
        return
    with contextlib.suppress(OSError):  # a closed stderr must not stop the stopping
        print(f"fleetjax-run: {message}", file=sys.stderr, flush=True)


def describe(code: int) -> str:
    """'exited with code 3' or 'was killed by SIGKILL' for a Popen return code."""
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def exit_code(code: int) -> int:
    """The launcher's exit code for a worker's Popen return code (128 + signal if killed)."""
    return code if code >= 0 else 128 - code


def tail(path: pathlib.Path | str, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of the log at `path`, or more, back to the start of its last
    Python traceback if that is within `TRACEBACK_LINES`: what a runtime's threads log after
    the traceback (JAX's distributed client losing its peers) must not push its head out."""
    with contextlib.suppress(OSError):
        end = pathlib.Path(path).read_text(errors="replace").splitlines()[-TRACEBACK_LINES:]
        starts = [i for i, line in enumerate(end) if line.startswith(_TRACEBACK)]
        first = min(starts[-1], len(end) - lines) if starts else len(end) - lines
        return "\n".join(end[max(first, 0) :])
    return ""


def _last_progress(*paths: pathlib.Path) -> float:
    """When the worker last wrote to its log, beat or ran a step (time.time())."""
    times = []
    for path in paths:
        with contextlib.suppress(OSError):
            times.append(path.stat().st_mtime)
    return max(times, default=time.time())  # no file: no sign of a hang


def _steps(path: pathlib.Path) -> int:
    """The TrainStep calls a worker made (0 without a steps file)."""
    with contextlib.suppress(OSError, ValueError):
        return int(path.read_text() or 0)
    return 0


def thread_frames(stacks: str, ident: str) -> list[tuple[str, str, str]]:
    """The (file, line, function) frames of thread `ident` ("0x00007f..." as the dump names
    it) in a faulthandler dump, innermost first."""
    for thread in re.split(r"\n(?=(?:Current thread|Thread) 0x)", stacks):
        if thread.partition("(")[0].split()[-1:] == [ident]:
            return _FRAME.findall(thread)
    return []


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What a worker was doing when the launcher looked (`_worker.STACKS_SIGNAL`,
    `_worker.PROBE_SIGNAL`): its threads' Python stacks ("" if none came: frozen, ended, not
    started), its main thread's frames, and whether that thread ran Python code (rather than
    wait in a C call, such as XLA's) at a probe."""

    stacks: str
    frames: list[tuple[str, str, str]]  # innermost first
    runs_python: bool

    @property
    def in_jax(self) -> bool:
        """Whether its innermost Python frame is in JAX or in fleetjax's agreements."""
        return bool(self.frames) and any(part in self.frames[0][0] for part in _WAITING_IN)

    @property
    def importing(self) -> bool:
        """Whether it imports a module: progress without output (JAX takes seconds)."""
        return any(path.startswith("<frozen importlib") for path, _, _ in self.frames)

    @property
    def rank(self) -> int:
        """0: runs its own Python code (or sent no stack: frozen); 1: waits in a C call made
        from its own code (JAX's C++ `block_until_ready`, a jitted call, a sleep); 2: waits in
        JAX's Python (for a transfer, a collective) or in fleetjax's agreements. A worker the
        others wait for ranks before those that wait."""
        if self.in_jax:
            return 2
        return 0 if self.runs_python or not self.frames else 1

    @property
    def where(self) -> str:
        """'train.py:31 (in spin)': where its main thread is."""
        if not self.frames:
            return "no stack came"
        path, line, function = self.frames[0]
        return f"{os.path.basename(path)}:{line} (in {function})"


def _die_with_launcher() -> None:
    """In the child, before exec: get SIGKILL if the launcher dies, even by SIGKILL (Linux)."""
    pr_set_pdeathsig = 1
    assert _LIBC is not None
    _LIBC.prctl(pr_set_pdeathsig, signal.SIGKILL)


# Gloo's line for each communicator it connects ("[Gloo] Rank 0 is connected to 1 peer
# ranks. ..."): kept in the worker's log, left off the console.
_GLOO = b"[Gloo] "


def for_console(text: bytes) -> tuple[bytes, bytes]:
    """(what of a log's new `text` the console shows now, what waits for more): its lines but
    Gloo's, and an unfinished last line at once (a progress bar's) unless it may be Gloo's."""
    lines = text.splitlines(keepends=True)
    last = lines.pop() if lines and not lines[-1].endswith((b"\n", b"\r")) else b""
    shown = b"".join(line for line in lines if not line.startswith(_GLOO))
    if last.startswith(_GLOO) or _GLOO.startswith(last):
        return shown, last
    return shown + last, b""


class _Echo:
    """Copies a worker's log onto the console from `offset` on as it grows (Paddle shows the
    node's first worker), but for Gloo's connection lines (`for_console`). A closed console
    ends the copying, never the worker or its log."""

    def __init__(self, log: pathlib.Path, offset: int) -> None:
        self._log, self._offset = log, offset
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._copy, daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        with open(self._log, "rb") as source:
            source.seek(self._offset)
            waiting = b""
            while True:
                finishing = self._done.is_set()  # then copy what is left, and stop
                chunk = source.read(1 << 16)
                if chunk:
                    shown, waiting = for_console(waiting + chunk)
                    try:
                        sys.stdout.buffer.write(shown)
                        sys.stdout.buffer.flush()
                    except OSError:
                        self._console_closed()
                        return
                elif finishing:
                    if not waiting.startswith(_GLOO):  # a last line that turned out not Gloo's
                        with contextlib.suppress(OSError):
                            sys.stdout.buffer.write(waiting)
                            sys.stdout.buffer.flush()
                    return
                else:
                    self._done.wait(_POLL_SECONDS)

    def _console_closed(self) -> None:
        say(
            f"the console is closed; the workers go on, worker output is in {self._log}",
            logging.WARNING,
        )
        # Python's own flush of stdout at exit must not fail on the closed pipe either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)

    def close(self) -> None:
        """Copy what the log holds now, and stop."""
        self._done.set()
        self._thread.join()


class Attempt:
    """This node's workers in one attempt of the job (`number` 0 is the first).

    Each worker runs `command` (which starts with `python -m fleetjax._worker`) and writes to
    its log: a new one in attempt 0, appended to after a line that names the attempt later.
    A thread per worker puts `("exit", attempt, index, time)` on `events` when it exits;
    `exited` and `poll` turn what happened into the attempt's first `Failure`.
    """

    def __init__(
        self,
        workers: Sequence[Worker],
        command: Sequence[str],
        log_dir: pathlib.Path,
        run_dir: pathlib.Path,
        events: queue.Queue,
        *,
        number: int = 0,
        heartbeat_timeout: float | None = None,
    ) -> None:
        self.workers, self._heartbeat_timeout = list(workers), heartbeat_timeout
        self.logs = [log_dir / worker.log_name for worker in workers]
        self._exit_files = [run_dir / f"exit.{worker.log_name}" for worker in workers]
        self._steps_files = [run_dir / f"steps.{worker.log_name}" for worker in workers]
        self._stacks_files = [run_dir / f"stacks.{worker.log_name}" for worker in workers]
        self._stacks_taken = 0.0  # the silence (its start) whose stacks an early end took
        self._silence: Failure | None = None  # a hang or an early end, once named
        self._seen_working: dict[int, float] = {}  # when its stack showed it worked (_hung)
        self._looked = 0.0  # when _hung last looked at the workers
        self._ended: dict[int, int] = {}  # index: exit status, of workers known to have ended
        self._exited: set[int] = set()
        self._joined: set[int] = set()  # workers that joined JAX's runtime
        self._early: tuple[int, float] | None = None  # the first to exit with 0 while others ran
        self._run_id = uuid.uuid4().hex
        self._marker = f"{_worker.RUN_ID}={self._run_id}"  # in each process's environment
        self._stopped = False
        # The guard ends the run if this process ends without doing so (SIGKILL).
        self._guard = subprocess.Popen(
            [sys.executable, "-I", _guard.__file__, self._marker, str(GRACE_SECONDS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
        self.procs: list[subprocess.Popen] = []
        offset = 0  # where the echo starts: at this attempt's output
        with contextlib.suppress(OSError):
            offset = self.logs[0].stat().st_size if number else 0
        for index in range(len(workers)):
            for path in self._files(index):
                path.unlink(missing_ok=True)
            self.procs.append(self._start(command, index, number))
            assert self._guard.stdin is not None
            self._guard.stdin.write(f"{self.procs[-1].pid}\n")  # the worker's process group
            self._guard.stdin.flush()
        self._echo: _Echo | None = _Echo(self.logs[0], offset)  # a thread only after every fork
        for index, proc in enumerate(self.procs):
            threading.Thread(
                target=lambda i, p: (p.wait(), events.put(("exit", self, i, time.time()))),
                args=(index, proc),
                daemon=True,
            ).start()

    def _start(self, command: Sequence[str], index: int, number: int) -> subprocess.Popen:
        log = self.logs[index]
        env = {
            # A worker's log is its live view (worker 0's is echoed here): lines as printed,
            # not 8 KiB later, and none lost in the buffer of a killed worker.
            "PYTHONUNBUFFERED": "1",
            **os.environ,
            **self.workers[index].env,
            _worker.RUN_ID: self._run_id,
            _worker.HEARTBEAT_FILE: str(log.absolute()),
            _worker.STEPS_FILE: str(self._steps_files[index].absolute()),
            _worker.EXIT_FILE: str(self._exit_files[index].absolute()),
            _worker.STACKS_FILE: str(self._stacks_files[index].absolute()),
        }
        if not number:
            log.write_bytes(b"")  # a new log each run
        # Appended to (O_APPEND), so that the stacks the launcher adds never overwrite output.
        with open(log, "ab") as out:
            if number:
                out.write(f"fleetjax-run: attempt {number + 1} starts\n".encode())
            return subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stopped as one, not by the tty's ^C
                preexec_fn=_die_with_launcher,
            )

    # -- what happened ---------------------------------------------------------------------
    def _name(self, index: int) -> str:
        return f"{self.workers[index].role} {self.workers[index].rank}"

    def _failure(self, index: int, what: str, code: int, when: float) -> Failure:
        """The failure of worker `index`, unless one exited with 0 before while others ran."""
        if self._early is not None and self._early[0] != index:
            early, at = self._early
            what = f"exited with code 0 while the others ran; then {self._name(index)} {what}"
            return Failure(self._name(early), what, code or 1, at, str(self.logs[early]))
        lost = self._jax_lost(index, code)
        if lost is not None:
            return lost
        return Failure(self._name(index), what, code, when, str(self.logs[index]))

    def _jax_lost(self, index: int, code: int) -> Failure | None:
        """The worker JAX's coordination service blamed, if it ended worker `index` (SIGABRT):
        one that stopped sending heartbeats, or the first to reach the shutdown barrier (it
        ended while the others did not) when that barrier timed out."""
        if code != 128 + signal.SIGABRT:
            return None
        log = tail(self.logs[index], 200)
        ended_by = f"so JAX ended {self._name(index)} with SIGABRT"
        if found := _JAX_LOST.search(log):
            what = f"stopped sending heartbeats to JAX's coordination service ({ended_by})"
            return Failure(
                f"worker {', '.join(found[1].split())}", what, HANG_EXIT_CODE, time.time()
            )
        if found := _JAX_EARLY.search(log):
            what = (
                "ended with code 0 while the others ran, and JAX's shutdown barrier timed out "
                f"waiting for them ({ended_by})"
            )
            return Failure(f"worker {found[1]}", what, HANG_EXIT_CODE, time.time())
        return None

    def _read_exit_file(self, index: int) -> None:
        """Note what worker `index`'s exit file says: that it joined JAX's runtime, or how its
        script ended."""
        if index in self._ended:
            return
        with contextlib.suppress(OSError):
            text = self._exit_files[index].read_text().strip()
            if text == _worker.JOINED:
                self._joined.add(index)
            elif text.isdigit():
                self._ended[index] = int(text)

    def exited(self, index: int, when: float) -> Failure | None:
        """Note that worker `index` exited (at `when`); its failure, if it is one."""
        code = self.procs[index].returncode
        self._read_exit_file(index)
        self._exited.add(index)
        left = index not in self._ended and index in self._joined  # os._exit: no barrier
        self._ended.setdefault(index, code)
        if code < 0 and -code != signal.SIGABRT:  # killed from outside: earlier than seen
            when -= KILL_SEEN_LATE_SECONDS
        if code != 0:
            return self._failure(index, describe(code), exit_code(code), when)
        if left and len(self._exited) < len(self.procs):
            what = (
                "exited with code 0 without ending its script (os._exit?) while the others ran, "
                "who need it in their collectives"
            )
            return Failure(self._name(index), what, 1, when, str(self.logs[index]))
        # A parameter server of fleetjax ends at once (its tables live on the trainers).
        trainer = self.workers[index].role == "worker"
        if trainer and len(self._exited) < len(self.procs) and self._early is None:
            self._early = (index, when)
        return None

    def poll(self) -> Failure | None:
        """A failure the workers' exit files or their silence show, if any."""
        for index in range(len(self.procs)):
            if index in self._ended:
                continue
            self._read_exit_file(index)
            if self._ended.get(index):
                status, when = self._ended[index], time.time()
                with contextlib.suppress(OSError):  # when the worker wrote it
                    when = self._exit_files[index].stat().st_mtime
                return self._failure(index, f"exited with code {status}", status, when)
        # Named once: looking again would signal the workers and add their stacks again.
        self._silence = self._silence or self._left_early() or self._hung()
        return self._silence

    def _hung(self) -> Failure | None:
        """If a running worker made no progress for longer than the timeout: the one the others
        wait for. The launcher looks at what each running worker does (`_look`, also once a
        worker has been silent for half the timeout; the stacks go into the logs once it names
        one): one seen importing works, and workers that wait in JAX while another works wait
        for it. Of the workers silent for half the timeout or more, the one named runs
        its own code rather than waits (`Snapshot.rank`), then has the fewest steps (those
        ahead wait in a collective), then has been silent the longest."""
        timeout = self._heartbeat_timeout
        running = [i for i in range(len(self.procs)) if i not in self._ended]
        if not timeout or not running:
            return None
        now = time.time()
        quiet = now - min(self._last_progress(i) for i in running)
        # At half the timeout too, for a worker that imports (or waits for one that does).
        if quiet <= timeout and (quiet <= timeout / 2 or now - self._looked < timeout / 2):
            return None
        seen = self._look(running)
        now = self._looked = time.time()
        for i in running:
            if seen[i].importing:
                self._seen_working[i] = now
        last = {i: self._last_progress(i) for i in running}
        silent = [i for i in running if now - last[i] >= timeout / 2]
        if silent and len(silent) < len(running) and all(seen[i].rank == 2 for i in silent):
            for i in silent:  # they wait in JAX for one that works
                self._seen_working[i] = now
            return None
        if not any(now - last[i] > timeout for i in silent):
            return None
        self._log_stacks(seen, f"no progress for {now - min(last.values()):.0f} s")
        steps = {i: _steps(self._steps_files[i]) for i in silent}
        index = min(silent, key=lambda i: (seen[i].rank, steps[i], last[i]))
        what = (
            f"made no progress for {now - last[index]:.0f} s (no output, no step, no "
            f"heartbeat; --heartbeat_timeout {timeout:g})"
        )
        if len(set(steps.values())) > 1:
            what += f" after {steps[index]} steps, the fewest"
        ranks = sorted(seen[i].rank for i in silent)
        found = len(ranks) > 1 and ranks[0] < ranks[1]  # it alone does other than wait
        if found:
            what += f", at {seen[index].where} while the others wait"
        # A worker found by what it does failed when it went silent; one found by its steps or
        # silence alone, now (on another node, a worker found by what it does may be the cause).
        log, when = str(self.logs[index]), last[index] if found or len(silent) == 1 else now
        finished = [i for i, status in self._ended.items() if status == 0]
        if finished and self.workers[finished[0]].role == "worker":  # the others wait for it
            what = f"ended with code 0 while the others ran; then {self._name(index)} {what}"
            index = finished[0]
        return Failure(self._name(index), what, HANG_EXIT_CODE, when, log)

    def _last_progress(self, index: int) -> float:
        """When worker `index` last made progress: wrote to its log, beat or ran a step, or
        was seen importing (JAX takes seconds: progress without output) or waiting for a
        worker that made progress."""
        seen = self._seen_working.get(index, 0.0)
        return max(seen, _last_progress(self.logs[index], self._steps_files[index]))

    def _left_early(self) -> Failure | None:
        """A worker that joined JAX's runtime and ended its script (code 0) after fewer steps
        than another, while every running worker has made no progress for `EARLY_END_SECONDS`
        since and waits (`Snapshot.rank`): they wait for it."""
        running = [i for i in range(len(self.procs)) if i not in self._ended]
        finished = [
            i
            for i, status in self._ended.items()
            if status == 0 and i in self._joined and self.workers[i].role == "worker"
        ]
        if not finished or not running:
            return None
        index, ended = finished[0], time.time()
        with contextlib.suppress(OSError):
            ended = self._exit_files[index].stat().st_mtime
        silent_since = max(ended, *(self._last_progress(i) for i in running))
        steps = _steps(self._steps_files[index])
        theirs = [_steps(self._steps_files[i]) for i in running]
        if time.time() - silent_since < EARLY_END_SECONDS or steps >= max(theirs):
            return None
        if self._stacks_taken == silent_since:  # asked in this silence: some run their own code
            return None
        self._stacks_taken = silent_since
        seen = self._look(running)
        if not all(seen[i].rank for i in running):
            return None
        self._log_stacks(seen, f"{self._name(index)} ended its script")
        what = (
            f"ended its script with code 0 after {steps} steps while the others ran; they "
            f"made no progress for {time.time() - silent_since:.0f} s since, waiting in JAX "
            f"after {max(theirs)} steps (their stacks are in their logs)"
        )
        return Failure(self._name(index), what, 1, ended, str(self.logs[index]))

    def _look(self, indices: Sequence[int]) -> dict[int, Snapshot]:
        """What workers `indices` are doing: each one's stacks, and whether its main thread
        ran Python code at one of `PROBES` probes over `LOOK_SECONDS` (a dump that is late is
        waited for up to `STACKS_WAIT_SECONDS`)."""
        asked, began = {}, time.monotonic()
        for index in indices:
            with contextlib.suppress(OSError):  # no file: its handlers are not set up yet
                asked[index] = self._stacks_files[index].stat().st_size
                os.kill(self.procs[index].pid, _worker.STACKS_SIGNAL)
        for _ in range(PROBES):
            time.sleep(LOOK_SECONDS / PROBES)
            for index in asked:
                with contextlib.suppress(OSError):
                    os.kill(self.procs[index].pid, _worker.PROBE_SIGNAL)
        texts: dict[int, str] = {}
        while True:
            for index, size in asked.items():
                with contextlib.suppress(OSError):
                    stacks = self._stacks_files[index].read_bytes()[size:]
                    texts[index] = stacks.decode(errors="replace")
            if all(texts.get(i) for i in asked) or time.monotonic() > began + STACKS_WAIT_SECONDS:
                break
            time.sleep(_POLL_SECONDS)
        looked = {}
        for index in indices:
            text, runs = texts.get(index, ""), f"{_worker.RUNS_PYTHON}\n"
            dump, python = text.replace(runs, ""), runs in text
            looked[index] = Snapshot(dump, thread_frames(dump, self._main_thread(index)), python)
        return looked

    def _main_thread(self, index: int) -> str:
        """Worker `index`'s main thread as its dumps name it (from its stacks file's first
        line), or ""."""
        with contextlib.suppress(OSError), open(self._stacks_files[index]) as stacks:
            label, _, ident = stacks.readline().strip().rpartition(" ")
            return ident if label == _worker.MAIN_THREAD else ""
        return ""

    def _log_stacks(self, seen: dict[int, Snapshot], why: str) -> None:
        """Append each worker's stack dump to its log, after a line that says `why`."""
        for index, snapshot in seen.items():
            text = snapshot.stacks or "(none came)\n"
            with contextlib.suppress(OSError):
                before = self.logs[index].stat()
                with open(self.logs[index], "a") as log:
                    log.write(f"fleetjax-run: the stacks of {self._name(index)} ({why}):\n{text}")
                # What the launcher writes is no progress of the worker's.
                os.utime(self.logs[index], ns=(before.st_atime_ns, before.st_mtime_ns))

    @property
    def succeeded(self) -> bool:
        """Whether every worker exited with 0."""
        return len(self._exited) == len(self.procs) and not any(self._ended.values())

    # -- ending ------------------------------------------------------------------------------
    def end_echo(self) -> str:
        """Stop copying worker output to the console; the log it copied."""
        if self._echo is not None:
            self._echo.close()
            self._echo = None
        return str(self.logs[0])

    def stop(self) -> None:
        """Stop every process of the attempt (SIGTERM, SIGKILL after `GRACE_SECONDS`), reap
        the workers and end the echo and the guard (once)."""
        if self._stopped:
            return
        self._stopped = True
        _guard.stop(self._marker, [proc.pid for proc in self.procs], GRACE_SECONDS)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (in the kernel)
                proc.wait(timeout=GRACE_SECONDS)
        self.end_echo()
        assert self._guard.stdin is not None
        self._guard.stdin.close()
        self._guard.wait()
        for index in range(len(self.procs)):
            for path in self._files(index):
                path.unlink(missing_ok=True)

    def _files(self, index: int) -> tuple[pathlib.Path, ...]:
        """The files through which worker `index` tells how it ends, its steps, its stacks."""
        return self._exit_files[index], self._steps_files[index], self._stacks_files[index]
