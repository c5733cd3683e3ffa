"""The cost model: a compiled step's time on one device, from its HLO and the device's constants.

On one device, with the constants of its `DeviceSpec`::

    time = matmul_flops / peak_flops
         + sum over collectives of (latency + wire_bytes / link_bandwidth)

where the wire bytes of a collective over a group of g devices with a result of R bytes are
those of ring algorithms: all-reduce ``2 (g-1)/g R``, all-gather and all-to-all
``(g-1)/g R``, reduce-scatter ``(g-1) R``, collective-permute ``R``. Compute and communication
are not assumed to overlap. A pipeline's bubble is in the compiled program (its loop of
ticks), not in a formula. The matmul flops and the collectives are read from the compiled HLO
with every known-trip-count loop counted once per trip (XLA's cost analysis counts a loop body
once, which would make micro-batching, pipelines and scanned layers look cheap), and a
conditional by its costliest branch.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import NamedTuple

import jax

from fleetjax import hlo


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """The constants of the cost model for one kind of device.

    Attributes:
      name: what the constants are for.
      peak_flops: matmul flops per second (dense bfloat16 tensor-core peak on accelerators).
      link_bandwidth: bytes per second one device sends in a collective (one direction).
      latency: seconds each collective costs on top of its bytes.
    """

    name: str
    peak_flops: float
    link_bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        for name in ("peak_flops", "link_bandwidth", "latency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"DeviceSpec.{name} must be a positive number, got {value!r}")


# Matched against `device.device_kind` (lower case), first match wins. Published peaks; the
# bandwidths are per device and direction (NVLink, TPU ICI); latencies are typical small-message
# collective times. The simulated CPU devices share the host's cores and memory.
DEVICE_SPECS: tuple[tuple[str, DeviceSpec], ...] = (
    ("cpu", DeviceSpec("XLA:CPU (simulated devices)", 5e10, 1e10, 2e-5)),
    ("h200", DeviceSpec("NVIDIA H200 (NVLink 4)", 989e12, 450e9, 1e-5)),
    ("h100", DeviceSpec("NVIDIA H100 SXM (NVLink 4)", 989e12, 450e9, 1e-5)),
    ("a100", DeviceSpec("NVIDIA A100 SXM (NVLink 3)", 312e12, 300e9, 1e-5)),
    ("tpu v4", DeviceSpec("TPU v4 (ICI)", 275e12, 150e9, 1e-5)),
    ("tpu v5 lite", DeviceSpec("TPU v5e (ICI)", 197e12, 100e9, 1e-5)),
    ("tpu v5", DeviceSpec("TPU v5p (ICI)", 459e12, 300e9, 1e-5)),
)


def device_spec(device: jax.Device | None = None) -> DeviceSpec:
    """The cost-model constants for `device` (default: the first device), from `DEVICE_SPECS`.

    Raises:
      ValueError: for a device kind the table lacks; pass `search(..., device=DeviceSpec(...))`.
    """
    device = device if device is not None else jax.devices()[0]
    kind = device.device_kind.lower()
    for key, spec in DEVICE_SPECS:
        if key in kind:
            return spec
    raise ValueError(
        f"no cost-model constants for device kind {device.device_kind!r} (known: "
        f"{', '.join(key for key, _ in DEVICE_SPECS)}); pass "
        "device=fleetjax.auto.DeviceSpec(name, peak_flops, link_bandwidth, latency)"
    )


def default_memory_budget(device: jax.Device | None = None) -> tuple[int, str]:
    """(bytes, where from): the allocator's limit of `device` (`memory_stats()["bytes_limit"]`),
    or, where the device reports none (CPU), the host's physical memory shared evenly by this
    process's devices."""
    device = device if device is not None else jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"memory_stats()['bytes_limit'] of {device}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = jax.local_device_count()
    return host // local, f"host memory {bytes_text(host)} / {local} local devices"


class HloCost(NamedTuple):
    """What one step of a compiled module does on one device, every loop trip counted.

    Attributes:
      matmul_flops: 2 x the multiply-adds of dots and convolutions (and of library matmul calls
        whose backend config gives dot dimensions, as cuBLAS calls on GPUs do).
      collective_bytes: the collectives' result bytes.
      wire_bytes: the bytes each device sends, by ring algorithms (see the module docstring).
      collectives: how many collectives run (each costs a latency).
    """

    matmul_flops: float = 0.0
    collective_bytes: float = 0.0
    wire_bytes: float = 0.0
    collectives: float = 0.0

    def __add__(self, other: tuple) -> HloCost:  # type: ignore[override]
        return HloCost(*(a + b for a, b in zip(self, other, strict=True)))

    def times(self, n: float) -> HloCost:
        return HloCost(*(n * a for a in self))

    def seconds(self, device: DeviceSpec) -> tuple[float, float]:
        """(compute, communication) seconds under the cost model."""
        compute = self.matmul_flops / device.peak_flops
        return compute, self.collectives * device.latency + self.wire_bytes / device.link_bandwidth


def _wire_bytes(c: hlo.Collective, devices: int) -> float:
    """Bytes one device sends for `c` by ring algorithms; a group the text does not state is
    taken to be all `devices` (an upper bound)."""
    group, result = c.group_size or devices, c.result_bytes
    if c.op == "collective-permute":
        return float(result)
    if group <= 1:
        return 0.0
    share = (group - 1) / group
    return {"all-reduce": 2 * share, "reduce-scatter": group - 1.0}.get(c.op, share) * result


def hlo_cost(hlo_text: str, device: DeviceSpec, devices: int) -> HloCost:
    """The `HloCost` of one call of a compiled module (`compiled.as_text()`).

    A while loop with a known trip count (XLA's ``known_trip_count``) counts its body that many
    times (once if unknown); a conditional counts its costliest branch (by `device`'s cost
    model); fusions and calls count their computations once per call. `devices` is the
    group size assumed for a collective whose replica groups the text does not state.
    """

    def measure(line: str, shapes: Mapping[str, tuple[int, ...]]) -> HloCost:
        total = HloCost(matmul_flops=hlo.matmul_flops(line, shapes))
        for c in hlo.collectives(line):
            wire = _wire_bytes(c, devices)
            launches = 1.0 if wire or c.op == "collective-permute" else 0.0
            total += HloCost(0.0, float(c.result_bytes), wire, launches)
        return total

    def costliest(branches: list[HloCost]) -> HloCost:
        return max(branches, key=lambda c: sum(c.seconds(device)))

    return hlo.per_call(hlo_text, measure, HloCost(), costliest)


def bytes_text(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
