"""Compile-only devices of a named GPU, from jax's CUDA plugin, on a machine without them."""

from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
from collections.abc import Sequence

import jax
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh

from fleetjax.mesh import build_mesh
from fleetjax.targets._gpus import Target, get

# The plugins' Python packages: jax registers the first one it finds as platform "cuda".
CUDA_PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")
# Their version helpers, in the order jax asks them (`jax._src.lib.cuda_versions`).
CUDA_VERSIONS = ("jax_cuda13_plugin._versions", "jax_cuda12_plugin._versions")


def devices(target: str | Target, count: int, *, per_host: int = 8) -> list[jax.Device]:
    """`count` compile-only devices of `target`, `per_host` to a host (process), host by host.

    They lower and compile (`jax.jit(f).lower(...).compile()`) but never run. The same
    arguments give the same devices. `count` below `per_host` is one host with that many.

    Raises:
      ValueError: for an unknown target, a count that is not a positive int, or a count that
        does not fill whole hosts of `per_host` GPUs.
      RuntimeError: when jax's CUDA plugin is not installed (the `aot` extra) or did not
        register (the message says why).
    """
    target = get(target) if isinstance(target, str) else target
    for name, value in (("count", count), ("per_host", per_host)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if count > per_host and count % per_host:
        below, above = count // per_host * per_host, (count // per_host + 1) * per_host
        raise ValueError(
            f"{count} {target.name} GPUs do not fill whole hosts of per_host={per_host}: "
            f"{count} / {per_host} = {count / per_host:g} hosts; use a multiple of {per_host} "
            f"({below} or {above}), or set per_host to the GPUs each host has"
        )
    hosts, per_host = (count // per_host, per_host) if count > per_host else (1, count)
    return list(_topology(target, hosts, per_host))


def mesh(
    target: str | Target,
    count: int,
    *,
    dp: int = -1,
    sharding: int = 1,
    pp: int = 1,
    mp: int = 1,
    order: Sequence[str] | None = None,
    axis_types: AxisType | None = None,
    per_host: int = 8,
    sep: int = 1,
    cp: int = 1,
) -> Mesh:
    """`fleetjax.build_mesh` over `devices(target, count, per_host=per_host)`.

    With the default axis order (`dp, pp, sharding, sep, cp, mp`) the `mp` neighbours share a
    host, so tensor parallelism of up to `per_host` stays on NVLink.

    Raises:
      ValueError, RuntimeError: as `devices` and `build_mesh` do.
    """
    return build_mesh(
        dp,
        sharding,
        pp,
        mp,
        order=order,
        devices=devices(target, count, per_host=per_host),
        axis_types=axis_types,
        sep=sep,
        cp=cp,
    )


@functools.cache
def _topology(target: Target, hosts: int, per_host: int) -> tuple[jax.Device, ...]:
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology=f"1x{hosts}x{per_host}", target_config=target.config
        )
    except NotImplementedError as e:  # jax has no "cuda" topology: no plugin registered
        raise RuntimeError(_no_plugin_message()) from e
    return tuple(topology.devices)


def plugin_installed() -> bool:
    """Whether one of jax's CUDA plugins (`CUDA_PLUGINS`) can be imported."""
    try:
        return any(importlib.util.find_spec(name) for name in CUDA_PLUGINS)
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def compile_only_without_a_driver() -> bool:
    """Start JAX on the CPU where jax's CUDA plugin is installed but no NVIDIA driver is.

    That is the ``aot`` extra (which the ``test`` extra includes) on a machine without GPUs:
    the plugin can only compile there, and its check of the CUDA libraries, which JAX runs when
    it starts its backends with CUDA among them, fails and logs a traceback as an ERROR. With
    JAX's platforms set to ``"cpu"`` (what ``JAX_PLATFORMS=cpu`` does) the plugin skips that
    check and still registers, so `devices` compiles for GPU targets and arrays live on the
    CPU. `import fleetjax` calls it. It changes nothing where the platforms are chosen already
    (``JAX_PLATFORMS`` or ``jax_platforms``), JAX's backends have started, no CUDA plugin is
    installed, the driver (``libcuda.so.1``) loads, or ``libtpu`` is installed. Returns
    whether it set them.
    """
    from jax._src import xla_bridge  # no public API says whether the backends have started

    if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
        return False
    if not plugin_installed() or importlib.util.find_spec("libtpu") is not None:
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        jax.config.update("jax_platforms", "cpu")
        return True
    return False


def cudnn_version() -> int | None:
    """The cuDNN version jax's CUDA plugin loads (92801 for 9.28.1), or None without one.

    `jax.nn.dot_product_attention(..., implementation="cudnn")` asks the plugin for it while
    tracing, so cuDNN's fused attention compiles for a GPU target only where it is installed
    (the ``aot-cudnn`` extra: the ``nvidia-cudnn-cu13`` wheel); without, jax raises "cuDNN not
    found.". Compiling needs the library only for that question: no GPU runs it.
    """
    for name in CUDA_VERSIONS:
        try:
            versions = importlib.import_module(name)
        except ImportError:
            continue
        try:
            return versions.cudnn_get_version()
        except RuntimeError:  # the plugin's "cuDNN not found."
            return None
    return None


def _no_plugin_message() -> str:
    if not plugin_installed():
        return (
            "compiling for a GPU target needs jax's CUDA plugin, which is not installed: "
            "pip install -e '.[aot]' in fleetjax's clone, or pip install "
            f"'jax[cuda13-local]=={jax.__version__}' (jax-cuda13-plugin and jax-cuda13-pjrt at "
            "the installed jax version; no CUDA libraries are needed)"
        )
    return (
        "jax's CUDA plugin is installed but did not register: without a GPU its CUDA-library "
        "check fails unless JAX leaves CUDA out of its backends. Import fleetjax before JAX "
        "starts its backends (it leaves CUDA out where no NVIDIA driver is), or set "
        f"JAX_PLATFORMS=cpu before JAX starts (now {jax.config.jax_platforms!r}); JAX then runs "
        "on the CPU and compiles for the GPU target. The plugin's own error is in JAX's log above."
    )
