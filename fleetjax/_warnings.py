"""`StrategyWarning` and the once-per-process warnings that settings without effect give."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class StrategyWarning(UserWarning):
    """A strategy field that fleetjax accepts but that has no effect."""

    _shown: set[str] = set()  # noqa: RUF012 (shared by design: once per process)

    @classmethod
    def reset(cls) -> None:
        """Forget which warnings were shown, so each shows again (tests, a re-run notebook)."""
        cls._shown.clear()


def user_stacklevel() -> int:
    """The `stacklevel` (for a `warnings.warn` in the caller of this function's caller) of the
    line that called into fleetjax: the frame just outside the outermost fleetjax frame (a
    warning raised while tracing a user's loss inside a step points at the step's call)."""
    frame, level, outermost = sys._getframe(2), 2, 2
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE):
            outermost = level
        frame, level = frame.f_back, level + 1
    return outermost + 1


def warn_once(message: str) -> None:
    """Warn with `message` (a `StrategyWarning`) the first time it is seen in this process,
    pointing at the user's line that led to it."""
    if message not in StrategyWarning._shown:
        StrategyWarning._shown.add(message)
        warnings.warn(message, StrategyWarning, stacklevel=user_stacklevel())
