"""XLA flags: putting the flags a strategy's knobs map to into effect.

Paddle tunes its executor and NCCL with process flags (`FLAGS_fuse_parameter_memory_size`,
`FLAGS_cudnn_exhaustive_search`, ...). The XLA counterparts are XLA flags, which XLA reads from
the `XLA_FLAGS` environment variable once, when JAX starts its backend. `read_plan` maps the
knobs to flags (`Plan.xla_flags`; the table is in `fleetjax.plan`), and `fleet.init` calls
`apply(plan.xla_flags)` before anything starts the backend:

* a flag the installed jaxlib knows is added to `XLA_FLAGS` (an unknown flag makes jaxlib abort
  the process, so each is tried in a child process first);
* a flag that comes too late (the backend already started) is a one-time warning, never a
  silent no-op; so is a flag that the user's `XLA_FLAGS` already sets to another value (it
  wins: XLA reads it). A value an earlier `apply` wrote is fleetjax's, not the user's: a
  later strategy replaces it (or, once the backend started, is too late for it).

The precedence is one rule, explicit over implicit: the user's `XLA_FLAGS`, then a strategy
field that is set, then Paddle's `FLAGS_*` environment variable for it (`fleet.init`), then the
field's default.

The mapped flags tune XLA:GPU; XLA:CPU has no counterpart (it always combines all-reduces, up to
256 of any size, and has no autotuner), so on CPU they are accepted and change nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import jax

from fleetjax._warnings import warn_once

__all__ = ["Flag", "apply", "backend_started", "in_env", "refused", "tunes_gpu_only", "users"]


class Flag(NamedTuple):
    """One XLA flag and the strategy setting that asks for it.

    Attributes:
      name: the flag's name without dashes, e.g. "xla_gpu_autotune_level".
      value: its value as XLA_FLAGS spells it, e.g. "0" or "true".
      knob: the setting, e.g. "cudnn_exhaustive_search=False".
    """

    name: str
    value: str
    knob: str

    def __str__(self) -> str:
        return f"--{self.name}={self.value}"


def backend_started() -> bool:
    """Whether JAX has started its backend in this process (so XLA has read `XLA_FLAGS`)."""
    # No public JAX call says so directly. JAX refuses to change `jax_num_cpu_devices` once
    # the backend exists (a documented RuntimeError); before that the change is allowed and is
    # undone at once.
    current = jax.config.jax_num_cpu_devices
    try:
        jax.config.update("jax_num_cpu_devices", 2 if current == 1 else 1)
    except RuntimeError:
        return True
    jax.config.update("jax_num_cpu_devices", current)
    return False


# str(flag) -> None if the installed jaxlib accepts it, else jaxlib's complaint.
_verdicts: dict[str, str | None] = {}
# name -> value of the flags `apply` put into XLA_FLAGS (fleetjax's, not the user's).
_written: dict[str, str] = {}
_GLOG = re.compile(r"^[EF]\d{4} [\d:.]+\s+\d+ \S+\] (?P<message>.*)$", re.MULTILINE)
_CHECK_TIMEOUT_S = 120


def _complaint(flags: Sequence[str]) -> str | None:
    """None if jaxlib starts its backend with `flags` in XLA_FLAGS, else why it does not."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    try:
        child = subprocess.run(
            [sys.executable, "-c", "import jax; jax.devices()"],
            env=env,
            capture_output=True,
            text=True,
            timeout=_CHECK_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return f"jaxlib did not start within {_CHECK_TIMEOUT_S} s"
    if child.returncode == 0:
        return None
    found = _GLOG.search(child.stderr)
    return found["message"] if found else f"exit status {child.returncode}"


def refused(flags: Iterable[Flag]) -> dict[Flag, str]:
    """The flags the installed jaxlib refuses, each with jaxlib's message.

    An unknown XLA flag, or a value it cannot parse, makes jaxlib abort the whole process when
    the backend starts. So the flags are tried in a child Python that starts only the CPU
    backend (the flag list is the same for every platform): about a second, once per flag per
    process. Flag names read from jaxlib's binary would not do: XLA keeps the names of removed
    flags there (as reserved proto names, e.g. `xla_gpu_redzone_scratch_max_megabytes`).
    """
    flags = list(flags)
    new = sorted({str(f) for f in flags} - _verdicts.keys())
    if new:
        if _complaint(new) is None:
            _verdicts.update(dict.fromkeys(new))
        else:
            _verdicts.update((text, _complaint([text])) for text in new)
    return {f: why for f in flags if (why := _verdicts[str(f)]) is not None}


def in_env() -> dict[str, str]:
    """{name: value} of the flags in the `XLA_FLAGS` environment variable ("--name" alone
    means true)."""
    out = {}
    for token in os.environ.get("XLA_FLAGS", "").split():
        _, sep, value = token.lstrip("-").partition("=")
        out[_name(token)] = value if sep else "true"
    return out


def tunes_gpu_only(flag: Flag) -> bool:
    """Whether `flag` tunes XLA:GPU only (XLA:CPU has no counterpart: there it does nothing)."""
    return flag.name.startswith("xla_gpu_")


def users(name: str) -> bool:
    """Whether `XLA_FLAGS` sets flag `name` to a value of the user's (not one `apply` wrote)."""
    value = in_env().get(name)
    return value is not None and _written.get(name) != value


def apply(flags: Sequence[Flag], owner: str = "DistributedStrategy") -> tuple[Flag, ...]:
    """Put `flags` (a plan's `xla_flags`) into `XLA_FLAGS`, for the backend JAX starts next.

    Returns the flags in effect: those added, and those `XLA_FLAGS` already had with the same
    value. Warns once (`StrategyWarning`, naming the `owner` strategy's knob) for each flag that
    is not: jaxlib does not know it, `XLA_FLAGS` sets it to another value (which wins), or the
    backend already started.
    """
    present = in_env()
    in_effect, new = [], []
    for flag in flags:
        if present.get(flag.name) == flag.value:
            in_effect.append(flag)
        elif flag.name not in present or _written.get(flag.name) == present[flag.name]:
            new.append(flag)  # unset, or an earlier apply's value: this one replaces it
        else:
            warn_once(
                f"XLA_FLAGS sets --{flag.name}={present[flag.name]}, which wins over "
                f"{owner}.{flag.knob} (it asks for {flag})"
            )
    if not new:
        return tuple(in_effect)
    if backend_started():
        if all(map(tunes_gpu_only, new)) and jax.default_backend() == "cpu":
            return tuple(in_effect)  # XLA:CPU has no counterpart: nothing is lost
        listed = ", ".join(f"{owner}.{f.knob} ({f})" for f in new)
        warn_once(
            f"too late for {listed}: JAX's backend already started in this process and XLA "
            "read XLA_FLAGS then. Call fleet.init() before any JAX computation (jax.devices() "
            "included), or put the flags in XLA_FLAGS before Python starts"
        )
        return tuple(in_effect)
    rejected = refused(new)
    for flag, why in rejected.items():
        warn_once(f"{owner}.{flag.knob} has no effect: the installed jaxlib refuses {flag} ({why})")
    accepted = [f for f in new if f not in rejected]
    if accepted:
        names = {f.name for f in accepted}
        kept = [t for t in os.environ.get("XLA_FLAGS", "").split() if _name(t) not in names]
        os.environ["XLA_FLAGS"] = " ".join([*kept, *map(str, accepted)])
        _written.update((f.name, f.value) for f in accepted)
    return tuple(in_effect + accepted)


def _name(token: str) -> str:
    return token.lstrip("-").partition("=")[0]
