"""Building the device mesh from degrees: `dp`, `sharding`, `pp`, `mp`, and Paddle's sequence
axes `sep` and `cp` where their degree is above 1."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from fleetjax.vocabulary import AXES, PADDLE_ORDER, REQUIRED_AXES, SEQUENCE_AXES


def check_order(order: Sequence[str], sequence: Sequence[str] = ()) -> tuple[str, ...]:
    """The mesh axis order from a Paddle `hybrid_configs["order"]`-style list: its axes that
    the mesh has, the `sequence` axes ('sep', 'cp') only where they are listed there."""
    order = tuple(order)
    unknown = [a for a in order if a not in PADDLE_ORDER]
    if unknown or len(set(order)) != len(order) or not set(REQUIRED_AXES) <= set(order):
        raise ValueError(
            f"order must name each of {', '.join(REQUIRED_AXES)} exactly once (and 'sep' and "
            f"'cp' at most once each), got {list(order)}"
        )
    missing = [a for a in sequence if a not in order]
    if missing:
        raise ValueError(
            f"order must name {missing[0]!r}, whose degree is above 1, got {list(order)}"
        )
    return tuple(a for a in order if a in REQUIRED_AXES or a in sequence)


def _default_devices() -> list[jax.Device]:
    # Consecutive devices share a process (host), so the fastest-varying mesh axes, whose
    # collectives are the most frequent, stay within a host.
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def _checked_devices(devices: Sequence[jax.Device] | None) -> list[jax.Device]:
    if devices is None:
        return _default_devices()
    devices = list(devices)
    if not devices:
        raise ValueError("devices is empty; pass at least one device, or None for all of them")
    seen: dict[tuple[int, int], int] = {}
    for i, d in enumerate(devices):
        key = (d.process_index, d.id)
        if key in seen:
            raise ValueError(
                f"devices lists {d} twice (at {seen[key]} and {i}); a mesh holds each device once"
            )
        seen[key] = i
    return devices


def simulation_hint(devices: Sequence[jax.Device], needed: int) -> str:
    """How to simulate `needed` CPU devices, where `devices` are fewer CPU devices (a laptop
    has one); "" otherwise. A sentence that error messages append."""
    if len(devices) >= needed or devices[0].platform != "cpu":
        return ""
    return (
        f"To simulate {needed} CPU devices, set JAX_NUM_CPU_DEVICES={needed} (or "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}) before JAX starts, e.g. "
        f"as the first lines of the script: import os; "
        f"os.environ['JAX_NUM_CPU_DEVICES'] = '{needed}'"
    )


def _sentence(hint: str) -> str:
    return f". {hint}" if hint else ""


def build_mesh(
    dp: int = -1,
    sharding: int = 1,
    pp: int = 1,
    mp: int = 1,
    order: Sequence[str] | None = None,
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisType | None = None,
    *,
    sep: int = 1,
    cp: int = 1,
) -> Mesh:
    """A `jax.sharding.Mesh` with axes `dp`, `sharding`, `pp` and `mp`, and `sep` and `cp`
    where their degree is above 1.

    Args:
      dp, sharding, pp, mp: the degrees (Paddle's `dp_degree`, `sharding_degree`,
        `pp_degree`, `mp_degree`); `dp=-1` takes all devices the others leave.
      order: the axis order, slowest-varying first (Paddle's `hybrid_configs["order"]`);
        default Paddle's `dp, pp, sharding, sep, cp, mp`, so `mp` neighbours share a host.
      devices: the devices, in order; default all devices, grouped by process.
      axis_types: `AxisType.Auto` (default; GSPMD propagates shardings) or `Explicit`.
      sep, cp: the sequence axes' degrees (Paddle's `sep_degree`: the sequence split and heads
        exchanged around attention; `cp_degree`: ring attention over the split sequence).

    Raises:
      ValueError: if a degree is not a positive int (or -1 for dp), `devices` is empty or
        repeats a device, or the product of the degrees is not the device count (the message
        states both, and on CPU how to simulate more devices).
    """
    devices = _checked_devices(devices)
    degrees = {"dp": dp, "sharding": sharding, "pp": pp, "sep": sep, "cp": cp, "mp": mp}
    for axis, degree in degrees.items():
        allowed = (-1,) if axis == "dp" else ()
        is_int = isinstance(degree, (int, np.integer)) and not isinstance(degree, bool)
        if not is_int or (degree < 1 and degree not in allowed):
            want = "-1 or a positive int" if axis == "dp" else "a positive int"
            raise ValueError(f"{axis} degree must be {want}, got {degree!r}")
    shown = [a for a in AXES if a in REQUIRED_AXES or degrees[a] > 1]
    others = math.prod(degrees[a] for a in shown if a != "dp")
    if dp == -1:
        if len(devices) % others:
            raise ValueError(
                f"cannot infer dp: {len(devices)} devices are not divisible by "
                f"{' x '.join(a for a in shown if a != 'dp')} = "
                f"{' x '.join(str(degrees[a]) for a in shown if a != 'dp')} = {others}"
                + _sentence(simulation_hint(devices, others))
            )
        degrees["dp"] = len(devices) // others
    total = math.prod(degrees.values())
    if total != len(devices):
        raise ValueError(
            " x ".join(shown)
            + " = "
            + " x ".join(str(degrees[a]) for a in shown)
            + f" = {total}, but there are {len(devices)} devices"
            + _sentence(simulation_hint(devices, total))
        )
    sequence = tuple(a for a in SEQUENCE_AXES if degrees[a] > 1)
    names = check_order(order if order is not None else PADDLE_ORDER, sequence)
    grid = np.array(devices, dtype=object).reshape([degrees[a] for a in names])
    types = (axis_types or AxisType.Auto,) * len(names)
    return Mesh(grid, names, axis_types=types)
