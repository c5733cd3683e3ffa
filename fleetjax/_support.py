"""What a strategy asks for that this version of fleetjax does not do: never silently ignored.

* A switch that changes what training computes (AMP, recompute, ZeRO, pipeline, ...) and is
  not built yet raises `NotImplementedError` when a train step is made from the strategy.
* A knob that does not change the numbers and has no effect here (parameter-server settings,
  executor and NCCL tuning, ...) gives a `StrategyWarning` once per process, naming why.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

from fleetjax._config import Message
from fleetjax.strategy import DistributedStrategy, Strategy


class StrategyWarning(UserWarning):
    """A strategy field that fleetjax accepts but that has no effect."""


_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Warn with `message` the first time it is seen in this process."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, StrategyWarning, stacklevel=3)


# Switches that change the computation; each is implemented by its own transform.
_NOT_YET_DISTRIBUTED = {
    "asp": "2:4 structured sparsity (ASP)",
    "qat": "quantization-aware training",
    "semi_auto": "semi-automatic parallelism",
    "auto_search": "automatic parallel search",
}


def _unsupported(what: str, setting: str) -> NotImplementedError:
    return NotImplementedError(
        f"{setting}: {what} is not available in this version of fleetjax; "
        "turn it off to train without it"
    )


def _noted_fields(message: Message, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(path, note) for every non-default field whose schema says it has no effect here."""
    for f in message._spec.fields:
        value = message._get(f.name)
        path = prefix + f.name
        if f.note:
            changed = value.non_defaults() if isinstance(value, Message) else None
            if changed or (changed is None and message._plain(f.name) != f.default):
                yield path, f.note
        elif isinstance(value, Message):
            yield from _noted_fields(value, path + ".")


def check_supported(strategy: DistributedStrategy | Strategy) -> None:
    """Raise for switches fleetjax cannot apply yet; warn once for knobs without effect."""
    if isinstance(strategy, Strategy):
        for path, note in _noted_fields(strategy):
            warn_once(f"Strategy.{path} has no effect in fleetjax: {note}")
        return
    for name, what in _NOT_YET_DISTRIBUTED.items():
        if getattr(strategy, name):
            raise _unsupported(what, f"DistributedStrategy.{name}=True")
    if strategy.auto:
        from fleetjax.auto import check_auto_alone  # here: fleetjax.auto imports the step

        check_auto_alone(strategy)
    if strategy.gradient_scale_configs["scale_strategy"] != "avg":
        raise _unsupported(
            "gradient scaling other than the mean over replicas",
            "gradient_scale_configs.scale_strategy="
            f"{strategy.gradient_scale_configs['scale_strategy']!r}",
        )
    for path, note in _noted_fields(strategy):
        warn_once(f"DistributedStrategy.{path} has no effect in fleetjax: {note}")
