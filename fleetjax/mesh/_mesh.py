"""Building the `('dp', 'sharding', 'pp', 'mp')` device mesh from degrees."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from fleetjax._schema import HYBRID_AXES, PADDLE_ORDER

AXES = ("dp", "sharding", "pp", "mp")
# Paddle's hybrid order with the axes fleetjax has: mp varies fastest.
DEFAULT_ORDER = tuple(a for a in PADDLE_ORDER if a in AXES)


def check_order(order: Sequence[str]) -> tuple[str, ...]:
    """The mesh axis order from a Paddle `hybrid_configs["order"]`-style list (Paddle's axes
    that fleetjax's mesh lacks, 'sep' and 'cp', are skipped)."""
    order = tuple(order)
    unknown = [a for a in order if a not in HYBRID_AXES]
    if unknown or len(set(order)) != len(order) or not set(AXES) <= set(order):
        raise ValueError(
            f"order must name each of {', '.join(AXES)} exactly once (Paddle's 'sep' and "
            f"'cp' may also appear and are skipped), got {list(order)}"
        )
    return tuple(a for a in order if a in AXES)


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


def _simulation_hint(devices: Sequence[jax.Device], needed: int) -> str:
    """On CPU, how to simulate more devices (a laptop has one)."""
    if len(devices) >= needed or devices[0].platform != "cpu":
        return ""
    return (
        f". To simulate {needed} CPU devices, set JAX_NUM_CPU_DEVICES={needed} (or "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={needed}) before JAX starts, e.g. "
        f"as the first lines of the script: import os; "
        f"os.environ['JAX_NUM_CPU_DEVICES'] = '{needed}'"
    )


def build_mesh(
    dp: int = -1,
    sharding: int = 1,
    pp: int = 1,
    mp: int = 1,
    order: Sequence[str] | None = None,
    devices: Sequence[jax.Device] | None = None,
    axis_types: AxisType | None = None,
) -> Mesh:
    """A `jax.sharding.Mesh` with axes `dp`, `sharding`, `pp` and `mp`.

    Args:
      dp, sharding, pp, mp: the degrees (Paddle's `dp_degree`, `sharding_degree`,
        `pp_degree`, `mp_degree`); `dp=-1` takes all devices the others leave.
      order: the axis order, slowest-varying first (Paddle's `hybrid_configs["order"]`);
        default Paddle's `dp, pp, sharding, mp`, so `mp` neighbours share a host.
      devices: the devices, in order; default all devices, grouped by process.
      axis_types: `AxisType.Auto` (default; GSPMD propagates shardings) or `Explicit`.

    Raises:
      ValueError: if a degree is not a positive int (or -1 for dp), `devices` is empty or
        repeats a device, or the product of the degrees is not the device count (the message
        states both, and on CPU how to simulate more devices).
    """
    devices = _checked_devices(devices)
    degrees = {"dp": dp, "sharding": sharding, "pp": pp, "mp": mp}
    for axis, degree in degrees.items():
        allowed = (-1,) if axis == "dp" else ()
        is_int = isinstance(degree, (int, np.integer)) and not isinstance(degree, bool)
        if not is_int or (degree < 1 and degree not in allowed):
            want = "-1 or a positive int" if axis == "dp" else "a positive int"
            raise ValueError(f"{axis} degree must be {want}, got {degree!r}")
    others = sharding * pp * mp
    if dp == -1:
        if len(devices) % others:
            raise ValueError(
                f"cannot infer dp: {len(devices)} devices are not divisible by "
                f"sharding x pp x mp = {sharding} x {pp} x {mp} = {others}"
            )
        degrees["dp"] = len(devices) // others
    total = math.prod(degrees.values())
    if total != len(devices):
        raise ValueError(
            "dp x sharding x pp x mp = "
            + " x ".join(str(degrees[a]) for a in AXES)
            + f" = {total}, but there are {len(devices)} devices"
            + _simulation_hint(devices, total)
        )
    names = check_order(order if order is not None else DEFAULT_ORDER)
    grid = np.array(devices, dtype=object).reshape([degrees[a] for a in names])
    types = (axis_types or AxisType.Auto,) * len(names)
    return Mesh(grid, names, axis_types=types)
