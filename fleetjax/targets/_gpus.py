"""The GPUs fleetjax compiles for: each one's target config (shipped next to this file) and the
constants of a roofline model."""

from __future__ import annotations

import dataclasses
import importlib.resources

import jax

from fleetjax.cost import DEVICE_SPECS, GPU_COLLECTIVE_LATENCY, DeviceSpec

TB = 1e12
GB = 1e9


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """The roofline constants of one GPU: peak rates and bandwidths from NVIDIA's data sheets.

    Peak FLOP/s are dense (the data sheets' headline tensor figures are with 2:4 sparsity,
    twice these). Bandwidths are bytes per second in one direction.

    Attributes:
      peak_bf16_flops: bfloat16 tensor-core FLOP/s (FP32 accumulate).
      peak_fp16_flops: float16 tensor-core FLOP/s.
      peak_tf32_flops: TF32 tensor-core FLOP/s: XLA runs float32 matmuls at JAX's default
        precision on these (Ampere and later).
      peak_fp32_flops: float32 FLOP/s of the CUDA cores (elementwise work, `HIGHEST` precision).
      hbm_bytes: device memory as CUDA reports it (`device_memory_size` of the target config).
        JAX's allocator takes 75% of it by default (`XLA_PYTHON_CLIENT_MEM_FRACTION`).
      hbm_bandwidth: device memory bandwidth.
      nvlink_bandwidth: what one GPU sends to the others in its host over NVLink (half the
        data sheet's bidirectional figure).
      network_bandwidth: what one GPU sends to other hosts: one InfiniBand adapter per GPU, as
        in NVIDIA's DGX systems of this GPU.
      host_bandwidth: what one GPU moves to or from host memory over its PCIe link (one
        direction: half the data sheet's bidirectional figure).
      source: where the figures come from.
    """

    peak_bf16_flops: float
    peak_fp16_flops: float
    peak_tf32_flops: float
    peak_fp32_flops: float
    hbm_bytes: int
    hbm_bandwidth: float
    nvlink_bandwidth: float
    network_bandwidth: float
    host_bandwidth: float
    source: str


@dataclasses.dataclass(frozen=True)
class Target:
    """A GPU to compile for.

    Attributes:
      name: fleetjax's name for it ("h100"), as `fleetjax.targets.devices` takes it.
      description: the product ("NVIDIA H100 SXM5 80 GB").
      device_kind: what its devices report as `jax.Device.device_kind`, compile-only or real.
      spec: its roofline constants.
    """

    name: str
    description: str
    device_kind: str
    spec: GpuSpec

    def device_spec(self, half_precision: bool = True) -> DeviceSpec:
        """The cost model's constants of this GPU (`fleetjax.cost`): its bfloat16 peak, or its
        TF32 peak for float32 matmuls; NVLink, network, HBM and PCIe as `spec` says."""
        return DeviceSpec(
            f"{self.description} ({'bf16' if half_precision else 'tf32'} peak)",
            self.spec.peak_bf16_flops if half_precision else self.spec.peak_tf32_flops,
            self.spec.nvlink_bandwidth,
            GPU_COLLECTIVE_LATENCY,
            network_bandwidth=self.spec.network_bandwidth,
            hbm_bandwidth=self.spec.hbm_bandwidth,
            host_bandwidth=self.spec.host_bandwidth,
        )

    @property
    def config(self) -> str:
        """Its `stream_executor.GpuTargetConfigProto` in text format (`<name>.txtpb` here),
        which says how it was made."""
        return importlib.resources.files(__package__).joinpath(f"{self.name}.txtpb").read_text()


_H100_SHEET = (
    "NVIDIA H100 Tensor Core GPU Architecture whitepaper (table 3, SXM5) and H100 data sheet; "
    "DGX H100 user guide (8 ConnectX-7 400 Gb/s InfiniBand NDR adapters per 8 GPUs)"
)
_HOPPER_FLOPS = {
    "peak_bf16_flops": 989.4 * TB,
    "peak_fp16_flops": 989.4 * TB,
    "peak_tf32_flops": 494.7 * TB,
    "peak_fp32_flops": 66.9 * TB,
}
_AMPERE_FLOPS = {
    "peak_bf16_flops": 312 * TB,
    "peak_fp16_flops": 312 * TB,
    "peak_tf32_flops": 156 * TB,
    "peak_fp32_flops": 19.5 * TB,
}
_A100_SHEET = (
    "NVIDIA A100 Tensor Core GPU data sheet (SXM4) and Ampere architecture whitepaper; "
    "DGX A100 user guide (8 ConnectX-6 200 Gb/s InfiniBand HDR adapters per 8 GPUs)"
)

TARGETS: dict[str, Target] = {
    target.name: target
    for target in (
        Target(
            "h100",
            "NVIDIA H100 SXM5 80 GB",
            "NVIDIA H100 80GB HBM3",
            GpuSpec(
                **_HOPPER_FLOPS,
                hbm_bytes=84_942_979_072,
                hbm_bandwidth=3.35 * TB,
                nvlink_bandwidth=450 * GB,  # NVLink 4: 18 links, 900 GB/s both ways
                network_bandwidth=50 * GB,  # 400 Gb/s
                host_bandwidth=64 * GB,  # PCIe Gen5 x16: 128 GB/s both ways
                source=_H100_SHEET,
            ),
        ),
        Target(
            "h200",
            "NVIDIA H200 SXM 141 GB",
            "NVIDIA H200 141GB HBM3e",
            GpuSpec(
                **_HOPPER_FLOPS,  # the H100's chip with more and faster memory
                hbm_bytes=151_397_597_184,
                hbm_bandwidth=4.8 * TB,
                nvlink_bandwidth=450 * GB,
                network_bandwidth=50 * GB,
                host_bandwidth=64 * GB,  # PCIe Gen5 x16
                source="NVIDIA H200 Tensor Core GPU data sheet (SXM); DGX H200 user guide "
                "(8 ConnectX-7 400 Gb/s InfiniBand NDR adapters per 8 GPUs)",
            ),
        ),
        Target(
            "a100-80g",
            "NVIDIA A100 SXM4 80 GB",
            "NVIDIA A100-SXM4-80GB",
            GpuSpec(
                **_AMPERE_FLOPS,
                hbm_bytes=85_100_068_864,
                hbm_bandwidth=2.039 * TB,
                nvlink_bandwidth=300 * GB,  # NVLink 3: 12 links, 600 GB/s both ways
                network_bandwidth=25 * GB,  # 200 Gb/s
                host_bandwidth=32 * GB,  # PCIe Gen4 x16: 64 GB/s both ways
                source=_A100_SHEET,
            ),
        ),
        Target(
            "a100-40g",
            "NVIDIA A100 SXM4 40 GB",
            "NVIDIA A100-SXM4-40GB",
            GpuSpec(
                **_AMPERE_FLOPS,
                hbm_bytes=42_331_013_120,
                hbm_bandwidth=1.555 * TB,
                nvlink_bandwidth=300 * GB,
                network_bandwidth=25 * GB,
                host_bandwidth=32 * GB,  # PCIe Gen4 x16
                source=_A100_SHEET,
            ),
        ),
    )
}


def get(name: str) -> Target:
    """The target named `name` (a key of `TARGETS`).

    Raises:
      ValueError: for another name, listing the known ones.
    """
    if name not in TARGETS:
        raise ValueError(f"unknown GPU target {name!r}; known targets: {', '.join(TARGETS)}")
    return TARGETS[name]


def of(device: jax.Device) -> Target | None:
    """The target whose devices `device` is one of (by `device_kind`; a real GPU of that kind
    too), or None."""
    return next((t for t in TARGETS.values() if t.device_kind == device.device_kind), None)


def device_spec(device: jax.Device | None = None, *, half_precision: bool = True) -> DeviceSpec:
    """The cost model's constants for `device` (default: the first device): a GPU target's
    (`Target.device_spec`: its peak for half-precision matmuls, or with
    `half_precision=False` TF32's), the others' from `fleetjax.cost.DEVICE_SPECS`.

    Raises:
      ValueError: for a device kind neither knows; pass `search(..., device=DeviceSpec(...))`.
    """
    device = device if device is not None else jax.devices()[0]
    target = of(device)
    if target is not None:
        return target.device_spec(half_precision)
    kind = device.device_kind.lower()
    for key, spec in DEVICE_SPECS:
        if key in kind:
            return spec
    raise ValueError(
        f"no cost-model constants for device kind {device.device_kind!r} (known: "
        f"{', '.join(key for key, _ in DEVICE_SPECS)} and the GPU targets "
        f"{', '.join(t.device_kind for t in TARGETS.values())}); pass "
        "device=fleetjax.auto.DeviceSpec(name, peak_flops, link_bandwidth, latency)"
    )
