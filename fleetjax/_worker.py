"""The worker's side of `fleetjax-run`: the environment the launcher gives each worker (the
contract both sides import: every `FLEETJAX_*` variable is named here and nowhere else), and
the process it starts for each worker.

`python -m fleetjax._worker train.py ARGS` runs `train.py` as `python train.py ARGS` would, and
writes how it ended (its exit code) to `FLEETJAX_EXIT_FILE` before Python's exit handlers run.
Why: a process that joined JAX's runtime waits in those handlers for every other process
(JAX's shutdown barrier, up to 5 minutes), and those may wait for it in a collective. The
launcher reads the file, so a worker that ends (`sys.exit(3)`, an uncaught exception) is named
with its code at once, whatever the others do afterwards.

When a worker seems hung, the launcher asks what it does: on `STACKS_SIGNAL` the worker
writes the Python stack of each of its threads to `FLEETJAX_STACKS_FILE` (`faulthandler`: from
the signal handler itself, so also while the process waits in XLA or in a collective); on
`PROBE_SIGNAL` a line if its main thread runs Python code rather than wait in a C call (XLA's,
a collective's, a sleep). This file imports nothing of fleetjax (nor JAX): the launcher runs it
as a script, and importing the package (and so JAX) before the user's script would read JAX's
settings before it sets them.
"""

from __future__ import annotations

import dis
import faulthandler
import os
import runpy
import signal
import sys
import threading
import types

# -- the environment fleetjax-run gives each worker (the launcher sets, the worker reads) --------
# Where this entry writes how the script ended (or JOINED while it runs).
EXIT_FILE = "FLEETJAX_EXIT_FILE"
# Where the worker writes its threads' stacks on STACKS_SIGNAL, and the probe's answers.
STACKS_FILE = "FLEETJAX_STACKS_FILE"
# Real-time signals: nothing else sends them (schedulers send SIGUSR1/SIGUSR2, SIGTERM).
STACKS_SIGNAL = signal.SIGRTMIN + 2
PROBE_SIGNAL = signal.SIGRTMIN + 3
MAIN_THREAD = "main thread"  # the stacks file's first line: "main thread 0x<its id>"
RUNS_PYTHON = "the main thread runs Python code"  # in the stacks file, on PROBE_SIGNAL
JOINED = "joined"  # in the exit file until the script ends: the process joined JAX's runtime
# The worker's log, which `fleetjax._liveness` touches as progress, and its steps file, where
# each train-step call writes the count of calls so far.
HEARTBEAT_FILE = "FLEETJAX_HEARTBEAT_FILE"
STEPS_FILE = "FLEETJAX_STEPS_FILE"
# The run's id, which every process of the run inherits (`fleetjax.launch._guard` finds them).
RUN_ID = "FLEETJAX_RUN_ID"
# `fleet.init()`'s wait for every process to join JAX's runtime (`--join_timeout`), in whole
# seconds; without it, JAX's own.
JOIN_TIMEOUT = "FLEETJAX_JOIN_TIMEOUT"
JOIN_TIMEOUT_SECONDS = 300
# JAX's heartbeat timeout, in whole seconds: twice the launchers' `--peer_timeout`.
JAX_HEARTBEAT_TIMEOUT = "FLEETJAX_JAX_HEARTBEAT_TIMEOUT"
# The most nodes of an elastic job (`--nnodes min:max`), for `fleet.init()`'s message when a
# restart on fewer nodes leaves too few devices.
MAX_NODES = "FLEETJAX_MAX_NODES"


def exit_status(code: object) -> int:
    """The process exit status of `sys.exit(code)`: None is 0, an int its low byte, anything
    else (a message) 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def _record(text: str) -> None:
    path = os.environ.get(EXIT_FILE)
    if path:
        with open(path, "w") as f:
            f.write(f"{text}\n")


def note_joined() -> None:
    """Tell the launcher that this worker joined JAX's runtime (`fleet.init()` does): from now
    on its peers need it, so leaving without ending its script (`os._exit(0)`) is a failure."""
    _record(JOINED)


def _from_script(tb: types.TracebackType | None, script: str) -> types.TracebackType | None:
    """The traceback from the script's first frame on: without this file's and runpy's."""
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    return tb


def _stacks_on_signal() -> None:
    """On `STACKS_SIGNAL`, write every thread's stack to the stacks file; on `PROBE_SIGNAL`,
    `RUNS_PYTHON` there if the main thread runs Python code (not if it waits in a C call); the
    file's first line names the main thread. The launcher signals once the file exists."""
    path = os.environ.get(STACKS_FILE)
    if not path:
        return
    # Kept open by faulthandler for the process's life; each dump is appended. Named only once
    # the handlers are there: the signals would end a process without them.
    stacks = open(f"{path}.new", "a")  # noqa: SIM115
    stacks.write(f"{MAIN_THREAD} 0x{threading.get_ident():016x}\n")  # as dumps name it
    stacks.flush()

    def probe(signum: int, frame: types.FrameType | None) -> None:
        # Python runs this between two instructions of the frame it interrupts, or after a
        # call into C (one that checks for signals while it waits, as XLA's and sleep do):
        # only the first shows Python code running.
        op = dis.opname[frame.f_code.co_code[frame.f_lasti]] if frame is not None else "CALL"
        if not op.startswith(("CALL", "PRECALL")):
            os.write(stacks.fileno(), f"{RUNS_PYTHON}\n".encode())

    signal.signal(PROBE_SIGNAL, probe)
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True)
    os.rename(f"{path}.new", path)


def main(argv: list[str]) -> None:
    script, *args = argv
    _stacks_on_signal()
    sys.argv = [script, *args]
    # As `python train.py` has it (`python -P` left the entry out, keeping PYTHONPATH's first).
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        _record(str(exit_status(e.code)))
        raise
    except KeyboardInterrupt:
        _record("130")
        raise  # Python ends by SIGINT, as the script alone would
    except BaseException as e:
        _record("1")
        # Printed as Python prints an uncaught exception (fleet.init's hook then exits at once).
        tb = _from_script(e.__traceback__, script)
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        sys.exit(1)
    _record("0")


if __name__ == "__main__":
    main(sys.argv[1:])
