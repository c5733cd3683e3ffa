"""The cost model: a compiled step's time on one device, from its HLO and the device's constants.

On one device, with the constants of its `DeviceSpec`::

    time = max(matmul_flops / peak_flops, bytes_accessed / hbm_bandwidth)
         + sum over collectives of (latency + wire_bytes / bandwidth)
         + host_bytes / host_bandwidth

The first term is a roofline over the whole step: the tensor cores' work, or, where it is
larger, the kernels' reads and writes of device memory (on GPU targets, from XLA's
HloCostAnalysis; elsewhere the memory term is left out). The wire bytes of a collective over a
group of g devices with a result of R bytes are those of ring algorithms: all-reduce
``2 (g-1)/g R``, all-gather and all-to-all ``(g-1)/g R``, reduce-scatter ``(g-1) R``,
collective-permute ``R``. They go at the link bandwidth (NVLink, ICI) within a host; a group
that spans hosts with k of its devices on each sends ``wire_bytes / k`` over the network (one
adapter per device, k rings side by side) and the rest over the links. An optimizer state
offloaded to pinned host memory crosses PCIe twice per step (fetched for the update, written
back). Compute and communication are not assumed to overlap. A pipeline's bubble is in the
compiled program (its loop of ticks), not in a formula. The matmul flops and the collectives
are read from the compiled HLO with every known-trip-count loop counted once per trip (XLA's
cost analysis counts a loop body once, which would make micro-batching, pipelines and scanned
layers look cheap), and a conditional by its costliest branch.

GPU constants come from `fleetjax.targets` (one source for them: `Target.device_spec`,
`targets.device_spec(device)`), for compile-only devices of a target and real GPUs of that kind
alike; `DEVICE_SPECS` has the others. `fleetjax.explain`, `fleetjax.auto` and
`fleetjax.targets.Megatron` all use this model. Memory: `device_bytes` of a tree as its
shardings place it, `compiled_bytes` of a compiled step.
"""

from fleetjax.cost._analysis import Cost, cost_analysis
from fleetjax.cost._memory import compiled_bytes, device_bytes
from fleetjax.cost._model import (
    DEVICE_SPECS,
    GPU_COLLECTIVE_LATENCY,
    DeviceSpec,
    HloCost,
    Seconds,
    bytes_text,
    collective_seconds,
    hlo_cost,
    model_flops,
    network_share,
    ring_share,
    step_cost,
    wire_bytes,
)

__all__ = [
    "DEVICE_SPECS",
    "GPU_COLLECTIVE_LATENCY",
    "Cost",
    "DeviceSpec",
    "HloCost",
    "Seconds",
    "bytes_text",
    "collective_seconds",
    "compiled_bytes",
    "cost_analysis",
    "device_bytes",
    "hlo_cost",
    "model_flops",
    "network_share",
    "ring_share",
    "step_cost",
    "wire_bytes",
]
