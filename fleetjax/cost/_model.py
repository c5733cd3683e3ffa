"""The cost model's terms (see `fleetjax.cost`): a device's constants, a compiled step's time by
part, and the ring algorithms' bytes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend
import numpy as np

from fleetjax import hlo
from fleetjax.cost._analysis import cost_analysis


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """The constants of the cost model for one kind of device.

    Attributes:
      name: what the constants are for.
      peak_flops: matmul flops per second (dense tensor-core peak at the step's precision on
        GPUs: bfloat16 / float16, or TF32 for float32; the MXU peak on TPUs).
      link_bandwidth: bytes per second one device sends in a collective within its host
        (one direction: NVLink, ICI).
      latency: seconds each collective costs on top of its bytes.
      network_bandwidth: bytes per second one device sends to other hosts (its network
        adapter); None: as `link_bandwidth`.
      hbm_bandwidth: device-memory bytes per second, for the memory term; None: no memory
        term.
      host_bandwidth: bytes per second between the device and pinned host memory (one
        direction: PCIe), for an offloaded optimizer state; None: not counted.
    """

    name: str
    peak_flops: float
    link_bandwidth: float
    latency: float
    network_bandwidth: float | None = None
    hbm_bandwidth: float | None = None
    host_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for name in ("peak_flops", "link_bandwidth", "latency"):
            _check_positive(name, getattr(self, name))
        for name in ("network_bandwidth", "hbm_bandwidth", "host_bandwidth"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"DeviceSpec.{name} must be a positive number, got {value!r}")


# A small NCCL collective's time on NVLink and InfiniBand (tens of microseconds at scale).
GPU_COLLECTIVE_LATENCY = 1e-5

# Devices other than GPUs, matched against `device.device_kind` (lower case), first match wins.
# Published peaks; the bandwidths are per device and direction (TPU ICI); latencies are typical
# small-message collective times. The simulated CPU devices share the host's cores and memory.
DEVICE_SPECS: tuple[tuple[str, DeviceSpec], ...] = (
    ("cpu", DeviceSpec("XLA:CPU (simulated devices)", 5e10, 1e10, 2e-5)),
    ("tpu v4", DeviceSpec("TPU v4 (ICI)", 275e12, 150e9, 1e-5)),
    ("tpu v5 lite", DeviceSpec("TPU v5e (ICI)", 197e12, 100e9, 1e-5)),
    ("tpu v5", DeviceSpec("TPU v5p (ICI)", 459e12, 300e9, 1e-5)),
)


class Seconds(NamedTuple):
    """One step's estimated time on one device, by part (see the module docstring).

    `total` assumes no overlap; `overlapped` takes off what the asynchronous collectives can
    hide behind the computation XLA's schedule places beside them (`hidden`).
    """

    compute: float  # matmul flops / peak flops
    memory: float  # bytes accessed / HBM bandwidth (0 without a memory term)
    links: float  # collective bytes within a host / link bandwidth
    network: float  # collective bytes across hosts / network bandwidth
    latency: float  # a latency per collective
    host: float  # bytes to and from pinned host memory / host bandwidth
    hidden: float = 0.0  # communication the schedule runs beside computation

    @property
    def total(self) -> float:
        """The step with no overlap of communication and computation (an upper bound)."""
        communication = self.links + self.network + self.latency + self.host
        return max(self.compute, self.memory) + communication

    @property
    def overlapped(self) -> float:
        """The step with the asynchronous collectives overlapped (a lower bound)."""
        return self.total - self.hidden


class HloCost(NamedTuple):
    """What one step of a compiled module does on one device, every loop trip counted.

    Attributes:
      matmul_flops: 2 x the multiply-adds of dots and convolutions (and of library matmul calls
        whose backend config gives dot dimensions, as cuBLAS calls on GPUs do).
      collective_bytes: the collectives' result bytes.
      wire_bytes: the bytes each device sends, by ring algorithms (see the module docstring).
      collectives: how many collectives run (each costs a latency).
      network_bytes: the part of `wire_bytes` that goes over the network to other hosts.
      bytes_accessed: device-memory bytes the kernels read and write (XLA's HloCostAnalysis,
        `cost_analysis`; 0 where not measured).
      host_bytes: bytes moved between the device and pinned host memory (an offloaded
        optimizer state fetched for the update and written back; 0 without offload).
      hidden_seconds: the collectives' seconds that XLA's schedule runs beside computation
        (`fleetjax.hlo.overlap`; 0 where not measured).
    """

    matmul_flops: float = 0.0
    collective_bytes: float = 0.0
    wire_bytes: float = 0.0
    collectives: float = 0.0
    network_bytes: float = 0.0
    bytes_accessed: float = 0.0
    host_bytes: float = 0.0
    hidden_seconds: float = 0.0

    def __add__(self, other: tuple) -> HloCost:  # type: ignore[override]
        return HloCost(*(a + b for a, b in zip(self, other, strict=True)))

    def times(self, n: float) -> HloCost:
        return HloCost(*(n * a for a in self))

    def time(self, device: DeviceSpec) -> Seconds:
        """The estimate under the cost model, by part."""
        network = device.network_bandwidth or device.link_bandwidth
        return Seconds(
            self.matmul_flops / device.peak_flops,
            self.bytes_accessed / device.hbm_bandwidth if device.hbm_bandwidth else 0.0,
            (self.wire_bytes - self.network_bytes) / device.link_bandwidth,
            self.network_bytes / network,
            self.collectives * device.latency,
            self.host_bytes / device.host_bandwidth if device.host_bandwidth else 0.0,
            self.hidden_seconds,
        )

    def seconds(self, device: DeviceSpec) -> tuple[float, float]:
        """(computation, communication) seconds under the cost model."""
        t = self.time(device)
        return max(t.compute, t.memory), t.total - max(t.compute, t.memory)


def ring_share(op: str, group: int) -> float:
    """Bytes one device sends, by ring algorithms, per byte of a collective's payload over a
    group of `group` devices: ``2 (g-1)/g`` for an all-reduce, ``(g-1)/g`` for an all-gather,
    a reduce-scatter and an all-to-all, 1 for a collective-permute. The payload is the result,
    and a reduce-scatter's operand (its result times the group)."""
    if op == "collective-permute":
        return 1.0
    if group <= 1:
        return 0.0
    return (2.0 if op == "all-reduce" else 1.0) * (group - 1) / group


def wire_bytes(c: hlo.Collective, devices: int) -> float:
    """Bytes one device sends for `c` by ring algorithms (`ring_share`); a group the text does
    not state is taken to be all `devices` (an upper bound)."""
    group = c.group_size or devices
    payload = c.result_bytes * (group if c.op == "reduce-scatter" else 1)
    return ring_share(c.op, group) * payload


def network_share(groups: Sequence[Sequence[int]] | None, hosts: Sequence[int] | None) -> float:
    """The share of a collective's wire bytes that one device sends over the network: 0
    within a host; for a group spanning hosts with k devices on each, 1 / k. `groups` are the
    replica groups as device positions (None: one group of all); `hosts` the host (process)
    of each device of the computation, by position (None: one host)."""
    if hosts is None:
        return 0.0
    groups = groups or (tuple(range(len(hosts))),)
    host_of = np.asarray(hosts)
    shares = [0.0]
    for group in groups:
        _, per_host = np.unique(host_of[list(group)], return_counts=True)
        if len(per_host) > 1:
            shares.append(1.0 / per_host.max())
    return max(shares)


def hlo_cost(
    hlo_text: str, device: DeviceSpec, devices: int, hosts: Sequence[int] | None = None
) -> HloCost:
    """The `HloCost` of one call of a compiled module (`compiled.as_text()`).

    A while loop with a known trip count (XLA's ``known_trip_count``) counts its body that many
    times (once if unknown); a conditional counts its costliest branch (by `device`'s cost
    model); fusions and calls count their computations once per call. `devices` is the
    group size assumed for a collective whose replica groups the text does not state; `hosts`
    the host (process index) of each of the computation's devices, by position
    (`[d.process_index for d in mesh.devices.flat]`; None: all on one host).
    """

    def measure(line: str, shapes: Mapping[str, tuple[int, ...]]) -> HloCost:
        total = HloCost(matmul_flops=hlo.matmul_flops(line, shapes))
        for c in hlo.collectives(line):
            wire = wire_bytes(c, devices)
            launches = 1.0 if wire or c.op == "collective-permute" else 0.0
            network = wire * network_share(c.groups, hosts)
            total += HloCost(0.0, float(c.result_bytes), wire, launches, network)
        return total

    def costliest(branches: list[HloCost]) -> HloCost:
        return max(branches, key=lambda c: c.time(device).total)

    return hlo.per_call(hlo_text, measure, HloCost(), costliest)


def step_cost(
    compiled: jax.stages.Compiled, device: DeviceSpec, mesh: jax.sharding.Mesh
) -> HloCost:
    """The `HloCost` of a step compiled over `mesh`, with the bytes its kernels access where
    `device` has a memory term (XLA's HloCostAnalysis: `cost_analysis`), and
    the communication its schedule hides (`hidden_seconds`)."""
    text = compiled.as_text()
    hosts = [d.process_index for d in mesh.devices.flat]
    cost = hlo_cost(text, device, mesh.size, hosts)
    hidden = hlo.overlap(
        text,
        lambda line, shapes: hlo.matmul_flops(line, shapes) / device.peak_flops,
        lambda c: collective_seconds(c, device, mesh.size, hosts),
    ).hidden
    cost = cost._replace(hidden_seconds=hidden)
    if device.hbm_bandwidth is None:
        return cost
    return cost._replace(bytes_accessed=cost_analysis(text).bytes_accessed)


def collective_seconds(
    c: hlo.Collective, device: DeviceSpec, devices: int, hosts: Sequence[int] | None
) -> float:
    """`c`'s time under the cost model: a latency (where it sends anything) and its wire bytes
    over the links within a host and the network across hosts."""
    wire = wire_bytes(c, devices)
    if not wire and c.op != "collective-permute":
        return 0.0
    share = network_share(c.groups, hosts)
    network = device.network_bandwidth or device.link_bandwidth
    return device.latency + wire * (1 - share) / device.link_bandwidth + wire * share / network


def model_flops(fn: Any, *args: Any) -> float:
    """2 x the multiply-adds of the matmuls and convolutions `fn(*args)` traces (arrays or
    `jax.ShapeDtypeStruct`s; nothing runs), a scan's body once per step: the model's matmul
    flops on one device, which a layout over N devices splits at best evenly."""
    return _jaxpr_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def _jaxpr_flops(jaxpr: jax.extend.core.Jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += (
                2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contracting)
            )
        elif name == "conv_general_dilated":
            kernel = eqn.invars[1].aval.shape
            out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(kernel) / out_features
        inner = [_jaxpr_flops(j) for j in jax.extend.core.jaxprs_in_params(eqn.params)]
        if name == "cond":
            total += max(inner, default=0.0)
        else:
            total += eqn.params["length"] * sum(inner) if name == "scan" else sum(inner)
    return total


def bytes_text(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"
