"""Strategy knobs that tune the compiler, not the computation: XLA flags, and knobs with no JAX
meaning.

Paddle tunes its executor and NCCL with process flags (`FLAGS_fuse_parameter_memory_size`,
`FLAGS_cudnn_exhaustive_search`, ...). The XLA counterparts are XLA flags, which XLA reads from
the `XLA_FLAGS` environment variable once, when JAX starts its backend. So `fleet.init` calls
`apply(strategy)` before anything starts the backend:

* a knob with an XLA counterpart (`flags_for`) adds its flag to `XLA_FLAGS`, if the installed
  jaxlib knows the flag (an unknown flag makes jaxlib abort the process);
* a flag that comes too late (the backend already started) is a one-time warning, never a
  silent no-op; so is a flag that `XLA_FLAGS` already sets to another value (it wins, as
  Paddle's environment flags win over the strategy);
* a fusion XLA always makes, turned off (`ignored_knobs`), warns once, saying why. (Knobs with no
  JAX meaning at all carry their reason in the schema, and warn from `fleetjax._support`.)

The mapped flags tune XLA:GPU; XLA:CPU has no counterpart (it always combines all-reduces, up to
256 of any size, and has no autotuner), so on CPU they are accepted and change nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax

from fleetjax._config import Message
from fleetjax._support import warn_once
from fleetjax.strategy import DistributedStrategy, Strategy

__all__ = [
    "XLA_FUSES",
    "Flag",
    "Ignored",
    "apply",
    "backend_started",
    "flags_for",
    "ignored_knobs",
    "refused",
    "warn_ignored",
]

MiB = 2**20  # Paddle's MB (`comm_buffer_size * 1024 * 1024` in DataParallel)


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


class Ignored(NamedTuple):
    """A setting that has no effect in fleetjax, and why."""

    knob: str  # e.g. "nccl_comm_num=2"
    why: str


def _get(message: Message, path: str) -> Any:
    *parents, leaf = path.split(".")
    for name in parents:
        message = message._get(name)
    return message._get(leaf)


def _default(message: Message, path: str) -> Any:
    spec = message._spec
    *parents, leaf = path.split(".")
    for name in parents:
        spec = spec.field(name).type
    return spec.field(leaf).default


# -- knobs -> XLA flags ------------------------------------------------------------------------

# A knob maps to a flag only when the strategy asks XLA for something it does not do by default;
# a knob left alone keeps XLA's own behaviour, which is close to Paddle's defaults (e.g. XLA
# combines all-reduces up to about 30 MiB, Paddle buckets 32 MB).
_ALL_REDUCE = "xla_gpu_all_reduce_combine_threshold_bytes"
_COMBINE_COUNT = "xla_gpu_collective_combine_threshold_count"
_ALL_GATHER = "xla_gpu_all_gather_combine_threshold_bytes"
_REDUCE_SCATTER = "xla_gpu_reduce_scatter_combine_threshold_bytes"
_AUTOTUNE = "xla_gpu_autotune_level"
_CUBLASLT = "xla_gpu_enable_cublaslt"
_SYNC_COLLECTIVES = "xla_gpu_disable_async_collectives"
_DUMP_TO = "xla_dump_to"
_DUMP_DOT = "xla_dump_hlo_as_dot"


def _sharding_buckets(size_mb: int, knob: str) -> list[Flag]:
    """ZeRO's communication buckets: XLA's all-gather and reduce-scatter combine thresholds."""
    return [Flag(name, str(size_mb * MiB), knob) for name in (_ALL_GATHER, _REDUCE_SCATTER)]


def _distributed_flags(s: DistributedStrategy) -> list[Flag]:
    flags = []
    if s.is_set("fuse_all_reduce_ops") or s.is_set("fuse_grad_size_in_MB"):
        # Gradients are all-reduced in buckets of fuse_grad_size_in_MB; off: one per gradient.
        if s.fuse_all_reduce_ops:
            knob = f"fuse_grad_size_in_MB={s.fuse_grad_size_in_MB}"
            flags.append(Flag(_ALL_REDUCE, str(s.fuse_grad_size_in_MB * MiB), knob))
        else:
            flags.append(Flag(_ALL_REDUCE, "0", "fuse_all_reduce_ops=False"))
    if s.is_set("fuse_grad_size_in_num") and s.fuse_all_reduce_ops:
        # At most this many gradients per fused all-reduce (XLA: per combined collective).
        num = s.fuse_grad_size_in_num
        flags.append(Flag(_COMBINE_COUNT, str(num), f"fuse_grad_size_in_num={num}"))
    if s.is_set("cudnn_exhaustive_search") and not s.cudnn_exhaustive_search:
        # XLA benchmarks every candidate algorithm by default; level 0 takes the heuristic pick
        # without benchmarking (for convolutions and GEMMs alike).
        flags.append(Flag(_AUTOTUNE, "0", "cudnn_exhaustive_search=False"))
    if s.calc_comm_same_stream:
        # Synchronous collectives run on the compute stream.
        flags.append(Flag(_SYNC_COLLECTIVES, "ALLCOLLECTIVES", "calc_comm_same_stream=True"))
    if s.sharding and s.sharding_configs.is_set("segment_broadcast_MB"):
        # Paddle broadcasts parameters in segments of this size; XLA combines all-gathers.
        size = s.sharding_configs["segment_broadcast_MB"]
        knob = f"sharding_configs.segment_broadcast_MB={size}"
        flags.append(Flag(_ALL_GATHER, str(int(size * MiB)), knob))
    sharding = s.hybrid_configs["sharding_configs"]
    if sharding.is_set("comm_buffer_size_MB"):
        size = sharding["comm_buffer_size_MB"]
        flags += _sharding_buckets(
            size, f"hybrid_configs.sharding_configs.comm_buffer_size_MB={size}"
        )
    build = s.build_strategy
    if build.fuse_gemm_epilogue:
        flags.append(Flag(_CUBLASLT, "true", "build_strategy.fuse_gemm_epilogue=True"))
    if build.debug_graphviz_path:
        # Paddle writes its graph as graphviz; XLA writes each compiled module as a .dot file.
        knob = f"build_strategy.debug_graphviz_path={build.debug_graphviz_path!r}"
        flags += [Flag(_DUMP_TO, build.debug_graphviz_path, knob), Flag(_DUMP_DOT, "true", knob)]
    return flags


def _auto_flags(s: Strategy) -> list[Flag]:
    flags = []
    if s.fused_passes.enable and s.fused_passes.gemm_epilogue:
        flags.append(Flag(_CUBLASLT, "true", "fused_passes.gemm_epilogue=True"))
    if s.sharding.is_set("comm_buffer_size_MB"):
        size = s.sharding.comm_buffer_size_MB
        flags += _sharding_buckets(size, f"sharding.comm_buffer_size_MB={size}")
    return flags


def flags_for(strategy: DistributedStrategy | Strategy) -> tuple[Flag, ...]:
    """The XLA flags `strategy` asks for (before checking that jaxlib knows them).

    Paddle's knob -> XLA flag (all XLA:GPU):

    * `fuse_all_reduce_ops`, `fuse_grad_size_in_MB` -> the all-reduce combiner's threshold,
      `fuse_grad_size_in_MB` MiB (0, no combining, when `fuse_all_reduce_ops` is False);
    * `fuse_grad_size_in_num` -> the most collectives combined into one;
    * `cudnn_exhaustive_search=False` -> `--xla_gpu_autotune_level=0` (no benchmarking);
    * `calc_comm_same_stream=True` -> synchronous collectives, on the compute stream;
    * `hybrid_configs.sharding_configs.comm_buffer_size_MB`, `Strategy.sharding.comm_buffer_size_MB`
      -> the all-gather and reduce-scatter combiners' thresholds (ZeRO's buckets);
    * `sharding_configs.segment_broadcast_MB` (with `sharding`) -> the all-gather combiner's
      threshold (ZeRO's parameter segments);
    * `build_strategy.fuse_gemm_epilogue`, `Strategy.fused_passes.gemm_epilogue` (with
      `fused_passes.enable`) -> cuBLASLt GEMMs, which fuse bias and activation epilogues;
    * `build_strategy.debug_graphviz_path` -> XLA dumps each compiled module there as .dot.
    """
    if isinstance(strategy, Strategy):
        return tuple(_auto_flags(strategy))
    if isinstance(strategy, DistributedStrategy):
        return tuple(_distributed_flags(strategy))
    raise TypeError(
        "strategy must be a fleetjax.DistributedStrategy or fleetjax.Strategy, "
        f"got {type(strategy).__name__}"
    )


# -- knobs with no JAX meaning -----------------------------------------------------------------

# Fusions XLA makes on its own: True is XLA's behaviour, so only False (which XLA cannot honour)
# warns.
XLA_FUSES: tuple[str, ...] = (
    "DistributedStrategy.build_strategy.fuse_elewise_add_act_ops",
    "DistributedStrategy.build_strategy.fuse_bn_act_ops",
    "DistributedStrategy.build_strategy.fuse_bn_add_act_ops",
    "DistributedStrategy.build_strategy.fuse_relu_depthwise_conv",
    "DistributedStrategy.build_strategy.fuse_broadcast_ops",
    "DistributedStrategy.build_strategy.fuse_all_optimizer_ops",
    "DistributedStrategy.build_strategy.enable_auto_fusion",
    "DistributedStrategy.build_strategy.fused_feedforward",
    "Strategy.fused_passes.dropout_add",
)


_XLA_FUSES = (
    "XLA fuses these operations by itself (elementwise chains, and bias and activation "
    "epilogues where the backend supports them) and cannot be told not to per pattern"
)


def ignored_knobs(strategy: DistributedStrategy | Strategy) -> tuple[Ignored, ...]:
    """The fusion settings of `strategy` that XLA cannot honour, each with the reason: a fusion
    XLA always makes (`XLA_FUSES`) turned off, and `Strategy.fused_passes` keys without
    `fused_passes.enable`."""
    label = type(strategy).__name__
    found = []
    for key in XLA_FUSES:
        owner, path = key.split(".", 1)
        if owner == label and _get(strategy, path) is False and _default(strategy, path):
            found.append(Ignored(f"{path}=False", _XLA_FUSES))
    if isinstance(strategy, Strategy) and not strategy.fused_passes.enable:
        # Paddle applies no fused pass unless the section is enabled.
        for name in ("gemm_epilogue", "dropout_add"):
            if strategy.fused_passes[name]:
                found.append(
                    Ignored(
                        f"fused_passes.{name}=True",
                        "fused passes apply only with fused_passes.enable=True, as in Paddle",
                    )
                )
    return tuple(found)


def warn_ignored(strategy: DistributedStrategy | Strategy) -> None:
    """Warn once per process for each setting of `strategy` that has no effect, saying why."""
    label = type(strategy).__name__
    for knob, why in ignored_knobs(strategy):
        warn_once(f"{label}.{knob} has no effect in fleetjax: {why}")


# -- applying flags ----------------------------------------------------------------------------


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


def _parse(xla_flags: str) -> dict[str, str]:
    """{name: value} of the flags in an XLA_FLAGS string ("--name" alone means true)."""
    out = {}
    for token in xla_flags.split():
        name, sep, value = token.lstrip("-").partition("=")
        out[name] = value if sep else "true"
    return out


def apply(strategy: DistributedStrategy | Strategy) -> tuple[Flag, ...]:
    """Put the XLA flags `strategy` maps to into `XLA_FLAGS`, for the backend JAX starts next,
    and warn once for each setting that has no effect. `fleet.init` calls this first.

    Returns the flags in effect: those added, and those `XLA_FLAGS` already had with the same
    value. Warns once (`StrategyWarning`) for each flag that is not: jaxlib does not know it,
    `XLA_FLAGS` sets it to another value (which wins), or the backend already started.
    """
    label = type(strategy).__name__
    warn_ignored(strategy)
    present = _parse(os.environ.get("XLA_FLAGS", ""))
    in_effect, new = [], []
    for flag in flags_for(strategy):
        if flag.name not in present:
            new.append(flag)
        elif present[flag.name] == flag.value:
            in_effect.append(flag)
        else:
            warn_once(
                f"XLA_FLAGS sets --{flag.name}={present[flag.name]}, which wins over "
                f"{label}.{flag.knob} (it asks for {flag})"
            )
    if not new:
        return tuple(in_effect)
    if backend_started():
        listed = ", ".join(f"{label}.{f.knob} ({f})" for f in new)
        warn_once(
            f"too late for {listed}: JAX's backend already started in this process and XLA "
            "read XLA_FLAGS then. Call fleet.init() before any JAX computation (jax.devices() "
            "included), or put the flags in XLA_FLAGS before Python starts"
        )
        return tuple(in_effect)
    rejected = refused(new)
    for flag, why in rejected.items():
        warn_once(f"{label}.{flag.knob} has no effect: the installed jaxlib refuses {flag} ({why})")
    accepted = [f for f in new if f not in rejected]
    if accepted:
        current = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = " ".join([current, *map(str, accepted)]).strip()
    return tuple(in_effect + accepted)
