"""Compile for NVIDIA GPUs that are not there: compile-only devices of a named GPU, its roofline
constants, and the flops and bytes of what XLA compiled for it.

```python
# pip install -e '.[aot]' in fleetjax's clone; import fleetjax before JAX starts
from fleetjax import targets

mesh = targets.mesh("h100", 64, sharding=8, mp=8)  # 8 hosts of 8 H100s
compiled = jax.jit(step).lower(abstract_state, abstract_batch).compile()
compiled.memory_analysis()  # per-device bytes, as XLA:GPU plans them
compiled.as_text()  # the scheduled GPU HLO: all-gather-start, Triton GEMM fusions, ...
targets.cost_analysis(compiled)  # flops and memory bytes; compiled.cost_analysis() is None
targets.get("h100").spec.peak_bf16_flops  # 989.4e12
targets.get("h100").device_spec()  # its constants in the cost model (fleetjax.cost)
```

The devices come from jax's CUDA plugin (`jax.experimental.topologies.get_topology_desc` with
a `stream_executor.GpuTargetConfigProto`, shipped here per GPU); they lower and compile but
never run. Without a GPU there is no autotuning: XLA picks its default GEMM configurations.
See docs/gpu_targets.md.
"""

from fleetjax.cost import Cost, cost_analysis
from fleetjax.targets._formula import Megatron
from fleetjax.targets._gpus import TARGETS, GpuSpec, Target, device_spec, get, of
from fleetjax.targets._topology import (
    compile_only_without_a_driver,
    cudnn_version,
    devices,
    mesh,
    plugin_installed,
)

__all__ = [
    "TARGETS",
    "Cost",
    "GpuSpec",
    "Megatron",
    "Target",
    "compile_only_without_a_driver",
    "cost_analysis",
    "cudnn_version",
    "device_spec",
    "devices",
    "get",
    "mesh",
    "of",
    "plugin_installed",
]
