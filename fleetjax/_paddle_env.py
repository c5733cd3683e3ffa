"""Paddle's process flags: the `FLAGS_*` environment variables of seed 003, read by `fleet.init`.

Paddle reads its `FLAGS_*` from the environment when it starts; seed 003 tunes training with
them (`os.environ['FLAGS_fuse_parameter_memory_size'] = "16"`, ...). `fleet.init` reads them
first, before JAX's backend starts:

* `FLAGS_fraction_of_gpu_memory_to_use` -> `XLA_PYTHON_CLIENT_MEM_FRACTION`, the share of each
  GPU's memory JAX's allocator takes up front (Paddle's preallocated fraction);
* `FLAGS_selected_gpus` -> JAX's `jax_cuda_visible_devices`, unless `CUDA_VISIBLE_DEVICES`
  already picks the GPUs (fleetjax-run sets both);
* flags with a strategy field (`FLAGS_fuse_parameter_memory_size` -> `fuse_grad_size_in_MB`,
  ...) set that field of the `DistributedStrategy` when the strategy leaves it unset, and take
  effect as the field does (an XLA flag, see `fleetjax.xla_flags`);
* any other `FLAGS_*` warns once: fleetjax does not read it.

A value that is set both ways keeps the explicit one (`XLA_PYTHON_CLIENT_MEM_FRACTION`, a
strategy field), with a warning when they differ.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from fleetjax import xla_flags
from fleetjax._warnings import warn_once
from fleetjax.strategy import DistributedStrategy, Strategy

__all__ = ["FIELD_FLAGS", "apply"]

logger = logging.getLogger("fleetjax")

MEMORY_FRACTION = "FLAGS_fraction_of_gpu_memory_to_use"
SELECTED_GPUS = "FLAGS_selected_gpus"


def _bool(text: str) -> bool:
    """A gflags boolean: 1/0, true/false, yes/no (any case)."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "y"):
        return True
    if value in ("0", "false", "no", "n"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use 1/0 or true/false)")


def _megabytes(text: str) -> int | None:
    """Paddle's fused-gradient group size in MB (a float); <= 0 means no size limit (None)."""
    size = float(text)
    return max(1, round(size)) if size > 0 else None


def _group_size(text: str) -> int | None:
    """Paddle's parameters per fused group; 1 and -1 mean no count limit (None)."""
    count = int(text)
    return count if count > 1 else None


class FieldFlag(NamedTuple):
    """A Paddle flag that sets a `DistributedStrategy` field the strategy leaves unset.

    Attributes:
      flag: the environment variable, e.g. "FLAGS_fuse_parameter_memory_size".
      field: the strategy field it sets, e.g. "fuse_grad_size_in_MB".
      parse: its text to the field's value; None keeps the field's default (and XLA's own
        behaviour), as the flag's value means.
    """

    flag: str
    field: str
    parse: Callable[[str], Any]


# The fusion sizes of seed 003, and the four flags Paddle's DistributedStrategy() takes its
# defaults from.
FIELD_FLAGS: tuple[FieldFlag, ...] = (
    FieldFlag("FLAGS_fuse_parameter_memory_size", "fuse_grad_size_in_MB", _megabytes),
    FieldFlag("FLAGS_fuse_parameter_groups_size", "fuse_grad_size_in_num", _group_size),
    FieldFlag("FLAGS_cudnn_exhaustive_search", "cudnn_exhaustive_search", _bool),
    FieldFlag("FLAGS_conv_workspace_size_limit", "conv_workspace_size_limit", int),
    FieldFlag(
        "FLAGS_cudnn_batchnorm_spatial_persistent", "cudnn_batchnorm_spatial_persistent", _bool
    ),
    FieldFlag("FLAGS_sync_nccl_allreduce", "sync_nccl_allreduce", _bool),
)
READ = frozenset([MEMORY_FRACTION, SELECTED_GPUS, *(f.flag for f in FIELD_FLAGS)])


def _parsed(flag: str, text: str, parse: Callable[[str], Any]) -> Any:
    try:
        return parse(text)
    except ValueError as e:
        raise ValueError(f"environment variable {flag}={text!r}: {e}") from None


def _set_memory_fraction(text: str) -> None:
    fraction = _parsed(MEMORY_FRACTION, text, float)
    if not 0 < fraction <= 1:
        raise ValueError(f"environment variable {MEMORY_FRACTION}={text!r}: must be in (0, 1]")
    current = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if current is not None:
        if float(current) != fraction:
            warn_once(
                f"XLA_PYTHON_CLIENT_MEM_FRACTION={current} wins over {MEMORY_FRACTION}={text}"
            )
        return
    if xla_flags.backend_started():
        warn_once(
            f"too late for {MEMORY_FRACTION}={text}: JAX's backend already started and "
            "allocated its memory; call fleet.init() before any JAX computation, or set "
            "XLA_PYTHON_CLIENT_MEM_FRACTION before Python starts"
        )
        return
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(fraction)
    logger.info("%s=%s: XLA_PYTHON_CLIENT_MEM_FRACTION=%s", MEMORY_FRACTION, text, fraction)


def _select_gpus(text: str) -> None:
    gpus = ",".join(str(_parsed(SELECTED_GPUS, g, int)) for g in text.split(",") if g.strip())
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        return  # the launcher (or the user) already picked this process's GPUs
    if xla_flags.backend_started():
        warn_once(
            f"too late for {SELECTED_GPUS}={text}: JAX's backend already started with every "
            "GPU; call fleet.init() before any JAX computation, or set CUDA_VISIBLE_DEVICES"
        )
        return
    jax.config.update("jax_cuda_visible_devices", gpus)
    logger.info("%s=%s: jax_cuda_visible_devices=%s", SELECTED_GPUS, text, gpus)


def _with_field_flags(strategy: DistributedStrategy | Strategy) -> DistributedStrategy | Strategy:
    """`strategy`, or a copy with the fields that the environment's flags set."""
    env, filled = os.environ, strategy
    for flag, name, parse in FIELD_FLAGS:
        if flag not in env:
            continue
        if isinstance(strategy, Strategy):
            warn_once(
                f"{flag} has no effect with a fleetjax.Strategy: it sets "
                f"DistributedStrategy.{name}, which a Strategy does not have"
            )
            continue
        value = _parsed(flag, env[flag], parse)
        if strategy.is_set(name):
            if value is not None and value != strategy._get(name):
                warn_once(
                    f"DistributedStrategy.{name}={strategy._get(name)!r} wins over "
                    f"{flag}={env[flag]} (Paddle's strategy overwrites the flag too)"
                )
        elif value is not None:
            filled = filled.__copy__() if filled is strategy else filled
            try:
                filled.update({name: value})
            except (TypeError, ValueError) as e:
                raise ValueError(f"environment variable {flag}={env[flag]!r}: {e}") from None
            logger.info("%s=%s: DistributedStrategy.%s=%r", flag, env[flag], name, value)
    return filled


def apply(strategy: DistributedStrategy | Strategy) -> DistributedStrategy | Strategy:
    """Put the environment's Paddle `FLAGS_*` into effect for `strategy`.

    Returns the strategy to use: `strategy` itself, or a copy with the fields the flags set.
    Warns once for each flag with no effect, and once listing the `FLAGS_*` fleetjax does
    not read.

    Raises:
      ValueError: a flag's value that does not parse, naming the variable.
    """
    env = os.environ
    if MEMORY_FRACTION in env:
        _set_memory_fraction(env[MEMORY_FRACTION])
    if SELECTED_GPUS in env:
        _select_gpus(env[SELECTED_GPUS])
    unread = sorted(name for name in env if name.startswith("FLAGS_") and name not in READ)
    if unread:
        warn_once(
            f"fleetjax does not read these Paddle flags: {', '.join(unread)} (they tune "
            "Paddle's executor, allocator or kernels; docs/knobs.md lists the flags it reads)"
        )
    return _with_field_flags(strategy)
