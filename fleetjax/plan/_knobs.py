"""Strategy knobs that tune the compiler, not the computation: the XLA flags they map to, and
the settings that have no effect in fleetjax, each with its reason.

Paddle tunes its executor and NCCL with process flags; the XLA counterparts are XLA flags
(`fleetjax.xla_flags.apply` puts them in effect). A fusion XLA always makes, turned off, and a
field whose schema notes it has no JAX meaning, are settings without effect: `read_plan` warns
once for each, naming why.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fleetjax._config import Message
from fleetjax.plan._values import NoEffect
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.xla_flags import Flag

MiB = 2**20  # Paddle's MB (`comm_buffer_size * 1024 * 1024` in DataParallel)


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
            if not s.is_set("fuse_grad_size_in_MB"):  # the user set only the switch
                knob = f"fuse_all_reduce_ops=True (Paddle's {knob})"
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


def ignored_knobs(strategy: DistributedStrategy | Strategy) -> tuple[NoEffect, ...]:
    """The fusion settings of `strategy` that XLA cannot honour, each with the reason: a fusion
    XLA always makes (`XLA_FUSES`) turned off, and `Strategy.fused_passes` keys without
    `fused_passes.enable`."""
    label = type(strategy).__name__
    found = []
    for key in XLA_FUSES:
        owner, path = key.split(".", 1)
        if owner == label and _get(strategy, path) is False and _default(strategy, path):
            found.append(NoEffect(f"{path}=False", _XLA_FUSES))
    if isinstance(strategy, Strategy) and not strategy.fused_passes.enable:
        # Paddle applies no fused pass unless the section is enabled.
        for name in ("gemm_epilogue", "dropout_add"):
            if strategy.fused_passes[name]:
                found.append(
                    NoEffect(
                        f"fused_passes.{name}=True",
                        "fused passes apply only with fused_passes.enable=True, as in Paddle",
                    )
                )
    return tuple(found)


def noted_fields(message: Message, prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """(path, note, value) for every non-default field whose schema says it has no effect here,
    within repeated messages too (``downpour_table_param[0].shard_num``)."""
    for f in message._spec.fields:
        value = message._get(f.name)
        path = prefix + f.name
        if f.note:
            changed = value.non_defaults() if isinstance(value, Message) else None
            if changed or (changed is None and message._plain(f.name) != f.default):
                yield path, f.note, changed or value
        elif isinstance(value, Message):
            yield from noted_fields(value, path + ".")
        elif f.is_message and f.repeated:
            for i, element in enumerate(value):
                yield from noted_fields(element, f"{path}[{i}].")


def no_effect(strategy: DistributedStrategy | Strategy) -> tuple[NoEffect, ...]:
    """The settings of `strategy` without effect: fields whose schema notes they have no JAX
    meaning, and fusions XLA cannot turn off (`ignored_knobs`)."""
    noted = tuple(
        NoEffect(f"{path}={value!r}", note) for path, note, value in noted_fields(strategy)
    )
    return noted + ignored_knobs(strategy)
