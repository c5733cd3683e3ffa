"""The process `fleetjax-run` starts for each worker: `python -m fleetjax._worker train.py ARGS`
runs `train.py` as `python train.py ARGS` would, and writes how it ended (its exit code) to
`FLEETJAX_EXIT_FILE` before Python's exit handlers run.

Why: a process that joined JAX's runtime waits in those handlers for every other process
(JAX's shutdown barrier, up to 5 minutes), and those may wait for it in a collective. The
launcher reads the file, so a worker that ends (`sys.exit(3)`, an uncaught exception) is named
with its code at once, whatever the others do afterwards.
"""

from __future__ import annotations

import os
import runpy
import sys
import types

EXIT_FILE_VARIABLE = "FLEETJAX_EXIT_FILE"
JOINED = "joined"  # in the exit file until the script ends: the process joined JAX's runtime


def exit_status(code: object) -> int:
    """The process exit status of `sys.exit(code)`: None is 0, an int its low byte, anything
    else (a message) 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    return 1


def _record(text: str) -> None:
    path = os.environ.get(EXIT_FILE_VARIABLE)
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


def main(argv: list[str]) -> None:
    script, *args = argv
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
