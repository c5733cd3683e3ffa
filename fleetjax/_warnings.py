"""`StrategyWarning` and the once-per-process warnings that settings without effect give."""

from __future__ import annotations

import warnings


class StrategyWarning(UserWarning):
    """A strategy field that fleetjax accepts but that has no effect."""

    _shown: set[str] = set()  # noqa: RUF012 (shared by design: once per process)

    @classmethod
    def reset(cls) -> None:
        """Forget which warnings were shown, so each shows again (tests, a re-run notebook)."""
        cls._shown.clear()


def warn_once(message: str) -> None:
    """Warn with `message` (a `StrategyWarning`) the first time it is seen in this process."""
    if message not in StrategyWarning._shown:
        StrategyWarning._shown.add(message)
        warnings.warn(message, StrategyWarning, stacklevel=3)
