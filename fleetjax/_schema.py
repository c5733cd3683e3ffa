"""The fields of Paddle's strategies: names, types, defaults, proto numbers and value checks.

`DISTRIBUTED_STRATEGY` mirrors `message DistributedStrategy` of Paddle's
`distributed_strategy.proto` (3.3.1, plus the 2.x fields it dropped), so that Paddle prototxt
files load and ours load in Paddle, including the parameter-server table messages
(`downpour_table_param`, which `sparse_table_configs` sets). Defaults are Paddle's, except
where the seed documents say otherwise; those fields carry `paddle_default` and are listed by
`seed_default_differences()`.

`AUTO_STRATEGY` mirrors the sections of the newer `paddle.distributed.Strategy`.
"""

from __future__ import annotations

from typing import Any

from fleetjax._config import (
    Check,
    Enum,
    FieldSpec,
    MessageSpec,
    at_least,
    between,
    field,
    greater_than,
    message,
    one_of,
)

# Paddle spellings of pipeline schedules (static fleet, auto-parallel and dygraph registries).
PADDLE_SCHEDULE_MODES = ("1F1B", "F-then-B", "FThenB", "VPP", "Eager1F1B", "ZBH1", "ZBVPP")

# The plain policies of `jax.checkpoint_policies`, for the `policy` extension key of recompute.
REMAT_POLICIES = (
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
)
_remat_policy = one_of("", *REMAT_POLICIES)
_half = one_of("float16", "bfloat16")
_merge_mode = one_of("across_calls", "in_step")

# Axes Paddle's hybrid topology knows, in its default order (`hybrid_configs["order"]`);
# fleetjax.mesh.AXES says which of them a mesh has.
HYBRID_AXES = ("dp", "pp", "sharding", "sep", "cp", "mp")
PADDLE_ORDER = list(HYBRID_AXES)

_PS = (
    "a setting of Paddle's parameter-server runtime (its server processes, trainer dumps, "
    "file system client, heterogeneous workers); fleetjax's parameter-server step is one SPMD "
    "program and reads only a_sync, a_sync_configs.k_steps and the sparse table configs"
)
_PS_RUNTIME = (
    "a setting of Paddle's parameter-server communicator threads and queues; fleetjax's "
    "parameter-server step is one SPMD program with no communicator"
)
_TABLE_STORE = (
    "how Paddle's servers store and cache a table; fleetjax splits a table's rows over the "
    "devices' memory"
)
_CTR = (
    "Paddle's CTR accessor bookkeeping (show/click counts, shrinking, save filters); "
    "fleetjax's tables are plain embeddings that keep every row"
)
_STATIC = "a Paddle static-graph executor setting; XLA compiles and schedules the whole step"

_XLA_SCHEDULES = "XLA compiles the whole step into one program and schedules it itself"
_XLA_BUFFERS = (
    "XLA's buffer assignment already reuses buffers in place (and the train step "
    "donates its state); there is nothing to switch"
)
_ATTENTION = (
    "XLA does not rewrite attention into a fused kernel; call "
    "jax.nn.dot_product_attention(..., implementation='cudnn') in the model"
)
_SPMD_SYNC = (
    "SPMD keeps a replicated array identical on every device; there is nothing to "
    "broadcast or synchronise"
)
_XLA_OVERLAP = "XLA's scheduler decides how communication overlaps computation"
_XLA_LAYOUT = "XLA fuses kernels and lays out buffers itself"
_XLA_FREES = "XLA frees each buffer as soon as the step no longer needs it"
_PROFILER = "a Paddle timer; profile with jax.profiler"
_SCHEDULE_HINT = "a hint for Paddle's pipeline scheduler; fleetjax's schedules are fixed tables"
_RECOMPUTE_POLICY = (
    "Paddle's recompute selection; choose what to keep with recompute 'checkpoints' or 'policy'"
)
_ZERO_EVEN = (
    "ZeRO here splits every large tensor evenly over the sharding axis (zero_spec) "
    "instead of assigning whole tensors to ranks"
)

# Effects several knobs share (docs/knobs.md).
_COMM_BUFFER = (
    "`--xla_gpu_all_gather_combine_threshold_bytes` and "
    "`--xla_gpu_reduce_scatter_combine_threshold_bytes` = this many MiB: ZeRO's communication "
    "buckets."
)
_QAT_OFF = "Quantization-aware training is not implemented (`qat` raises)."
_XLA_FUSES = (
    "XLA fuses these operations by itself (elementwise chains; bias and activation epilogues "
    "where the backend supports them). False cannot be honoured and warns once."
)
_AMP = "Mixed precision: per-operation autocast and loss scaling (`fleetjax.transforms.amp`)."
_AUTO_QAT_OFF = "Quantization-aware training is not implemented (`qat.enable` raises)."

_positive = at_least(1)
_non_negative = at_least(0)
_sparsity = Check(lambda v: 0 <= v < 1, "in [0, 1)")
_dp_degree = Check(lambda v: v == -1 or v >= 1, "-1 (inferred from the device count) or >= 1")


NCCL_CONFIG = message(
    "NCCLConfig",
    "nccl_config",
    [
        field(1, "commName", str, ""),
        field(2, "ll_buffsize", int, 0),
        field(3, "ll128_buffsize", int, 0),
        field(4, "simple_buffsize", int, 0),
        field(5, "buffsize_align", int, 0),
        field(6, "nchannels", int, 0),
        field(7, "algoStr", str, ""),
        field(8, "protoStr", str, ""),
    ],
)
_NCCL_NOTE = "NCCL communicator tuning; XLA creates its own NCCL communicators"


def _comm_group(name: str, label: str, *extra: str) -> MessageSpec:
    """A hybrid sub-group message that only carries NCCL communicator configs."""
    names = ("nccl_config", *extra)
    return message(
        name,
        label,
        [field(i + 1, n, NCCL_CONFIG, note=_NCCL_NOTE) for i, n in enumerate(names)],
    )


REFINED_OPS_PATTERN = message(
    "RefinedOpsPattern",
    "refined_ops_patterns",
    [
        field(1, "main_ops", str, []),
        field(2, "num", int, 0),
        field(3, "pre_ops", str, []),
        field(4, "suf_ops", str, []),
    ],
)

RECOMPUTE_CONFIG = message(
    "RecomputeConfig",
    "recompute_configs",
    [
        field(
            1,
            "checkpoints",
            str,
            [],
            doc=("The activations (named with `fleetjax.checkpoint_name`) that recompute keeps."),
        ),
        field(
            2,
            "enable_offload",
            bool,
            False,
            doc=(
                "Kept activations go to pinned host memory (`save_and_offload_only_these_names`)."
            ),
        ),
        field(
            3,
            "checkpoint_shape",
            int,
            [],
            check=_positive,
            doc="The shape of the kept activations, checked against them.",
        ),
        field(4, "enable_tuning", bool, False, note=_RECOMPUTE_POLICY, kind="not yet"),
        field(
            5,
            "refined_ops_patterns",
            REFINED_OPS_PATTERN,
            [],
            note=_RECOMPUTE_POLICY,
            kind="not yet",
        ),
        # fleetjax: a named jax.checkpoint_policies policy, alone or with the checkpoints.
        field(
            1001,
            "policy",
            str,
            "",
            paddle=False,
            check=_remat_policy,
            doc=(
                "fleetjax extension: a `jax.checkpoint_policies` name, alone or with `checkpoints`."
            ),
        ),
    ],
)


def _loss_scaling(first: int, **decr_ratio: Any) -> list[FieldSpec]:
    """The loss-scaling fields both AMP sections have, numbered from `first`; `decr_ratio` is
    the default (and Paddle's default) of that one."""
    return [
        field(
            first,
            "init_loss_scaling",
            float,
            32768.0,
            check=greater_than(0),
            doc="The initial loss scale.",
        ),
        field(
            first + 1,
            "incr_every_n_steps",
            int,
            1000,
            check=_positive,
            doc="Finite steps before the loss scale grows.",
        ),
        field(
            first + 2,
            "decr_every_n_nan_or_inf",
            int,
            2,
            check=_positive,
            doc="Non-finite steps before the loss scale shrinks.",
        ),
        field(
            first + 3,
            "incr_ratio",
            float,
            2.0,
            check=greater_than(1),
            doc="The loss scale's growth factor.",
        ),
        field(
            first + 4,
            "decr_ratio",
            float,
            check=between(0, 1),
            doc="The loss scale's shrink factor.",
            **decr_ratio,
        ),
    ]


AMP_CONFIG = message(
    "AMPConfig",
    "amp_configs",
    [
        *_loss_scaling(1, default=0.5, paddle_default=0.8),
        field(
            6,
            "use_dynamic_loss_scaling",
            bool,
            True,
            doc=("Dynamic loss scaling (skip non-finite steps); False keeps the scale fixed."),
        ),
        field(7, "custom_white_list", str, [], doc="Operations added to the half-precision list."),
        field(8, "custom_black_list", str, [], doc="Operations kept in float32."),
        field(
            9,
            "custom_black_varnames",
            str,
            [],
            doc="Named values (`checkpoint_name`) whose consumers stay float32.",
        ),
        field(
            10,
            "use_pure_fp16",
            bool,
            False,
            doc="O2: float16 parameters for compute, float32 master weights.",
        ),
        field(
            11,
            "use_fp16_guard",
            bool,
            True,
            doc=("Under pure float16, only code inside `fleetjax.fp16_guard` runs in float16."),
        ),
        field(
            12,
            "use_optimizer_fp16",
            bool,
            False,
            note="not read by Paddle's fleet either; optimizer states stay float32",
            kind="not yet",
        ),
        field(13, "use_pure_bf16", bool, False, doc="O2 in bfloat16."),
        # fleetjax: the O1 half-precision dtype (Paddle's static O1 is float16 only).
        field(
            1001,
            "dtype",
            str,
            "float16",
            paddle=False,
            check=_half,
            doc=("fleetjax extension: the O1 half-precision dtype, `float16` or `bfloat16`."),
        ),
    ],
    hints={"use_bf16": "the bf16 switch is 'use_pure_bf16'"},
)

LOCALSGD_CONFIG = message(
    "LocalSGDConfig",
    "localsgd_configs",
    [
        field(1, "k_steps", int, 1, check=_positive, doc="Steps between parameter averages."),
        field(
            2,
            "begin_step",
            int,
            1,
            check=_non_negative,
            doc="Every step is averaged before this step.",
        ),
    ],
)

GRADIENT_MERGE_CONFIG = message(
    "GradientMergeConfig",
    "gradient_merge_configs",
    [
        field(1, "k_steps", int, 1, check=_positive, doc="Micro-steps merged into one update."),
        field(
            2,
            "avg",
            bool,
            True,
            doc=(
                "Mean (True) or sum of the merged gradients. In one step under the "
                "pipeline always the mean, as in Paddle (False warns)."
            ),
        ),
        # fleetjax: "across_calls" (Paddle's: the optimizer runs every k calls) or "in_step"
        # (each call splits its batch into k micro-batches).
        field(
            1001,
            "mode",
            str,
            "across_calls",
            paddle=False,
            check=_merge_mode,
            doc=(
                "fleetjax extension: `across_calls` (Paddle's: the optimizer runs every k "
                "calls) or `in_step` (each call splits its batch; under the pipeline, "
                "into its `k_steps` micro-batches, so `accumulate_steps` is 1 or "
                "`k_steps`)."
            ),
        ),
    ],
)

DGC_CONFIG = message(
    "DGCConfig",
    "dgc_configs",
    [
        field(
            1,
            "rampup_begin_step",
            int,
            0,
            check=_non_negative,
            doc="Dense momentum before this step.",
        ),
        field(
            2,
            "rampup_step",
            int,
            1,
            check=_positive,
            doc="Steps over which the sparsity list is walked.",
        ),
        field(
            3,
            "sparsity",
            float,
            [0.999],
            check=_sparsity,
            paddle_default=[],
            doc="The sparsity schedule.",
        ),
    ],
)

PIPELINE_CONFIG = message(
    "PipelineConfig",
    "pipeline_configs",
    [
        field(1, "micro_batch_size", int, 1, check=_positive, doc="The size of one micro-batch."),
        field(
            2,
            "accumulate_steps",
            int,
            1,
            check=_positive,
            doc=(
                "Micro-batches per step; in-step gradient merge's `k_steps` sets it (they "
                "must agree where both are set)."
            ),
        ),
        field(
            3,
            "schedule_mode",
            str,
            "1F1B",
            check=one_of(*PADDLE_SCHEDULE_MODES),
            doc=(
                "The schedule (`fleetjax.transforms.pipeline.pipeline_schedule`): `1F1B`, "
                "`Eager1F1B` (the same lockstep table, Paddle's `m >= 2P - 1`), "
                "`F-then-B`/`FThenB`, `VPP`, or the zero-bubble `ZBH1` and `ZBVPP`, whose "
                "backward is split into its input- and weight-gradient halves."
            ),
        ),
        field(4, "p2p_cache_shape", bool, True, note="shapes are static under XLA"),
        field(
            5,
            "enable_partial_send_recv",
            bool,
            True,
            note="XLA decides how activations are sent between stages",
        ),
    ],
    hints={
        "micro_batch": "Paddle 2.0's 'micro_batch' (the number of micro-batches) is "
        "'accumulate_steps' since Paddle 2.1; 'micro_batch_size' is the size of one"
    },
)

ASYNC_CONFIG = message(
    "AsyncConfig",
    "a_sync_configs",
    [
        # a_sync=True with k_steps > 0: Geo-SGD every k_steps (fleetjax.optimizers.geo_sgd).
        field(
            1,
            "k_steps",
            int,
            -1,
            doc=(
                "Geo-SGD's exchange interval when `a_sync` is set to True "
                "(`fleetjax.optimizers.geo_sgd`, "
                "`fleetjax.transforms.sparse_rows.geo_exchange`); without that (`a_sync` "
                "left at its default, a collective strategy, or False) it warns."
            ),
        ),
        field(2, "max_merge_var_num", int, 1, note=_PS_RUNTIME),
        field(3, "send_queue_size", int, 16, note=_PS_RUNTIME),
        field(4, "independent_recv_thread", bool, False, note=_PS_RUNTIME),
        field(5, "min_send_grad_num_before_recv", int, 1, note=_PS_RUNTIME),
        field(6, "thread_pool_size", int, 1, note=_PS_RUNTIME),
        field(7, "send_wait_times", int, 1, note=_PS_RUNTIME),
        field(8, "runtime_split_send_recv", bool, False, note=_PS_RUNTIME),
        field(9, "launch_barrier", bool, True, note=_PS_RUNTIME),
        field(10, "heter_worker_device_guard", str, "cpu", note=_PS),
        field(11, "lr_decay_steps", int, 10, note=_PS),
        field(12, "use_ps_gpu", int, 0, note=_PS),
        field(13, "use_gpu_graph", int, 0, note=_PS),
    ],
)

LARS_CONFIG = message(
    "LarsConfig",
    "lars_configs",
    [
        field(1, "lars_coeff", float, 0.001, check=_non_negative, doc="LARS trust coefficient."),
        field(2, "lars_weight_decay", float, 0.0005, check=_non_negative, doc="LARS weight decay."),
        field(3, "epsilon", float, 0.0, check=_non_negative, doc="LARS denominator epsilon."),
        field(
            4,
            "exclude_from_weight_decay",
            str,
            [],
            doc="Parameter-name substrings without weight decay (and trust ratio).",
        ),
    ],
)

LAMB_CONFIG = message(
    "LambConfig",
    "lamb_configs",
    [
        field(1, "lamb_weight_decay", float, 0.01, check=_non_negative, doc="LAMB weight decay."),
        field(
            2,
            "exclude_from_weight_decay",
            str,
            [],
            doc="Parameter-name suffixes without weight decay.",
        ),
    ],
)

ADAPTIVE_LOCALSGD_CONFIG = message(
    "AdaptiveLocalSGDConfig",
    "adaptive_localsgd_configs",
    [
        field(1, "init_k_steps", int, 1, check=_positive, doc="The first averaging interval."),
        field(
            2,
            "begin_step",
            int,
            1,
            check=_non_negative,
            doc="Every step is averaged before this step.",
        ),
    ],
)

SHARDING_CONFIG = message(
    "ShardingConfig",
    "sharding_configs",
    [
        field(
            1,
            "sharding_segment_strategy",
            str,
            "segment_broadcast_MB",
            check=one_of("segment_broadcast_MB", "segment_anchors"),
            note=(
                "XLA groups the parameter all-gathers by size (segment_broadcast_MB maps to its "
                "combine threshold), not by anchors"
            ),
            kind="not yet",
        ),
        field(
            2,
            "segment_broadcast_MB",
            float,
            32.0,
            check=greater_than(0),
            kind="XLA flag",
            doc=(
                "With `sharding` on: ZeRO's parameter all-gathers are combined up to this "
                "size (`--xla_gpu_all_gather_combine_threshold_bytes`)."
            ),
        ),
        field(
            3,
            "segment_anchors",
            str,
            [],
            note=(
                "XLA groups the parameter all-gathers by size (segment_broadcast_MB maps to its "
                "combine threshold), not by anchors"
            ),
            kind="not yet",
        ),
        field(
            4,
            "sharding_degree",
            int,
            8,
            check=_positive,
            doc=("The `sharding` mesh axis size (Paddle's default 8) when `sharding` is on."),
        ),
        field(
            5,
            "mp_degree",
            int,
            1,
            check=_positive,
            doc="The `mp` mesh axis size when `sharding` is on.",
        ),
        field(
            6,
            "dp_degree",
            int,
            1,
            check=_positive,
            doc="The `dp` mesh axis size when `sharding` is on.",
        ),
        field(7, "hybrid_dp", bool, False, note="deprecated in Paddle: dp_degree >= 2 implies it"),
        field(
            8,
            "gradient_merge_acc_step",
            int,
            1,
            check=_positive,
            doc=(
                "Gradient merge across calls under sharding. Under the pipeline it warns "
                "and has no effect: Paddle's sharding merges the pipeline's "
                "`accumulate_steps` micro-batches instead."
            ),
        ),
        field(
            9,
            "optimize_offload",
            bool,
            False,
            doc="The optimizer state lives in pinned host memory.",
        ),
        field(
            10,
            "pp_allreduce_in_optimize",
            bool,
            False,
            kind="XLA default",
            doc=(
                "The pipeline reduces gradients over the data axes once, after its loop, "
                "before the optimizer (`fleetjax.transforms.pipeline`; in half precision "
                "under `fp16_allreduce`)."
            ),
        ),
        field(
            11,
            "pp_degree",
            int,
            1,
            check=_positive,
            doc="The `pp` mesh axis size when `sharding` is on.",
        ),
        field(
            12,
            "optimize_cast",
            bool,
            False,
            note="parameters stay float32 master weights; AMP casts them inside the step",
            kind="not yet",
        ),
        field(13, "_dp_as_optimizer_sharding", bool, False, note=_STATIC),
        field(
            14,
            "stage",
            int,
            1,
            check=one_of(1, 2, 3),
            doc="The ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters.",
        ),
        field(15, "enable_tuning", bool, False, note=_STATIC),
        field(16, "use_calc_stream", bool, False, note=_STATIC),
    ],
)

MP_CONFIG = message(
    "MpConfig",
    "mp_configs",
    [
        field(1, "sync_param", bool, True, note=_SPMD_SYNC, kind="not yet"),
        field(2, "sync_grad", bool, False, note=_SPMD_SYNC, kind="not yet"),
        field(3, "sync_moment", bool, False, note=_SPMD_SYNC, kind="not yet"),
        field(
            4,
            "sync_mode",
            str,
            "broadcast",
            check=one_of("broadcast", "average"),
            note=_SPMD_SYNC,
            kind="not yet",
        ),
        field(5, "mp_async_allreduce", bool, False, note=_XLA_OVERLAP, kind="not yet"),
        field(6, "mp_skip_c_identity", bool, False, note=_XLA_LAYOUT, kind="not yet"),
        field(7, "mp_fused_linear_param_grad_add", bool, False, note=_XLA_LAYOUT, kind="not yet"),
        field(
            8,
            "need_broadcast_data",
            bool,
            True,
            note="the train step places every batch on the mesh itself",
            kind="not yet",
        ),
        field(
            9,
            "recompute_allgather",
            bool,
            False,
            doc=(
                "`ColumnSequenceParallelLinear` keeps its input as it arrives, split "
                "along the sequence over `mp`, and all-gathers it again in the backward "
                "pass instead of keeping the gathered input "
                "(`fleetjax.layers.sequence_parallel`)."
            ),
        ),
        field(
            10,
            "sp_async_reduce_scatter",
            bool,
            False,
            kind="XLA default",
            when="silent",
            doc=(
                "XLA:GPU runs the reduce-scatter of a sequence-parallel column layer's "
                "input gradient asynchronously, and its scheduler overlaps it with the "
                "weight gradient's matmul, as this option makes Paddle do."
            ),
        ),
        field(11, "nccl_config", NCCL_CONFIG, note=_NCCL_NOTE),
        # Python-only in Paddle (DistributedStrategy.sync_param_name).
        field(
            1001,
            "sync_param_name",
            str,
            ["embedding", "layer_norm", ".b_"],
            paddle=False,
            note=_SPMD_SYNC,
            kind="not yet",
        ),
    ],
)

PP_CONFIG = message(
    "PpConfig",
    "pp_configs",
    [
        field(1, "dp_comm_overlap", bool, False, note=_XLA_OVERLAP, kind="not yet"),
        field(
            2,
            "delay_scale_loss",
            bool,
            False,
            note="the pipeline's loss is the exact mean over micro-batches whenever it is scaled",
            kind="not yet",
        ),
        field(3, "enable_timer", bool, False, note=_PROFILER, kind="not yet"),
        field(4, "sharding_comm_overlap", bool, False, note=_XLA_OVERLAP, kind="not yet"),
        field(5, "profiling", bool, False, note=_PROFILER, kind="not yet"),
        field(6, "release_gradients", bool, False, note=_XLA_FREES, kind="not yet"),
        field(7, "overlap_p2p_comm", bool, False, note=_XLA_OVERLAP, kind="not yet"),
        field(8, "clear_every_step_cache", bool, False, note=_XLA_FREES, kind="not yet"),
        field(9, "use_batch_p2p_comm", bool, True, note=_XLA_OVERLAP, kind="not yet"),
        field(10, "best_unbalanced_scheduler", bool, False, note=_SCHEDULE_HINT, kind="not yet"),
        field(11, "enable_offload_queue", bool, False, note=_XLA_FREES, kind="not yet"),
        field(
            12,
            "enable_dynamic_shape",
            bool,
            False,
            note="XLA compiles static shapes",
            kind="not yet",
        ),
        field(
            13,
            "use_dualpipev",
            bool,
            False,
            note=(
                "the DualPipeV schedule is not in fleetjax; the pipeline runs "
                "pipeline_configs.schedule_mode"
            ),
            kind="not yet",
        ),
        field(
            14, "forward_backward_overlap_scheduler", bool, False, note=_XLA_OVERLAP, kind="not yet"
        ),
        field(15, "coll_nccl_config", NCCL_CONFIG, note=_NCCL_NOTE),
        field(16, "p2p_nccl_config", NCCL_CONFIG, note=_NCCL_NOTE),
        field(17, "shared_nccl_config", NCCL_CONFIG, note=_NCCL_NOTE),
        field(18, "sync_param", bool, False, note=_SPMD_SYNC, kind="not yet"),
        field(19, "sync_moment", bool, False, note=_SPMD_SYNC, kind="not yet"),
        field(
            20,
            "sync_mode",
            str,
            "broadcast",
            check=one_of("broadcast", "average"),
            note=_SPMD_SYNC,
            kind="not yet",
        ),
    ],
)

DYGRAPH_SHARDING_CONFIG = message(
    "DygraphShardingConfig",
    "hybrid_configs.sharding_configs",
    [
        field(1, "tensor_fusion", bool, False, note=_XLA_LAYOUT, kind="not yet"),
        field(
            2,
            "accumulate_steps",
            int,
            1,
            check=_positive,
            note="a hint that the user accumulates gradients; merge them with gradient_merge",
            kind="not yet",
        ),
        field(3, "comm_overlap", bool, False, note=_XLA_OVERLAP, kind="not yet"),
        field(
            4,
            "split_param",
            bool,
            False,
            doc="With `sharding_degree > 1`: ZeRO stage 2 instead of 1.",
        ),
        field(5, "fuse_optimizer", bool, True, note=_XLA_LAYOUT, kind="not yet"),
        field(
            6,
            "use_reduce_avg",
            bool,
            True,
            note="the step averages gradients over the replicas in any case",
            kind="not yet",
        ),
        field(
            7,
            "comm_buffer_size_MB",
            int,
            256,
            check=_positive,
            kind="XLA flag",
            doc=_COMM_BUFFER,
        ),
        field(8, "release_gradients", bool, False, note=_XLA_FREES, kind="not yet"),
        field(9, "free_grads_in_comm", bool, False, note=_XLA_FREES, kind="not yet"),
        field(10, "enable_fuse_optimizer_states", bool, False, note=_XLA_LAYOUT, kind="not yet"),
        field(11, "nccl_config", NCCL_CONFIG, note=_NCCL_NOTE),
        field(12, "check_nccl_config", NCCL_CONFIG, note=_NCCL_NOTE),
        field(
            13,
            "offload_opt_buffer_size",
            int,
            -1,
            note=(
                "partial offload is not in fleetjax; sharding_configs.optimize_offload moves the "
                "whole optimizer state"
            ),
            kind="not yet",
        ),
    ],
)


HYBRID_CONFIG = message(
    "HybridConfig",
    "hybrid_configs",
    [
        field(
            1,
            "dp_degree",
            int,
            -1,
            check=_dp_degree,
            doc="The `dp` mesh axis size (-1: the devices the other axes leave).",
        ),
        field(
            2,
            "mp_degree",
            int,
            1,
            check=_positive,
            doc=(
                "The `mp` mesh axis size; above 1, parameters must be split over it "
                "(`param_specs`), else `make_train_step` raises."
            ),
        ),
        field(
            3,
            "pp_degree",
            int,
            1,
            check=_positive,
            doc="The `pp` mesh axis size; above 1 the step is a pipeline.",
        ),
        field(
            4,
            "sharding_degree",
            int,
            1,
            check=_positive,
            doc=(
                "The `sharding` mesh axis size; above 1, ZeRO stage 1 (2 with "
                "`sharding_configs.split_param`), Paddle's dygraph rule."
            ),
        ),
        field(
            5,
            "sep_degree",
            int,
            1,
            check=_positive,
            doc=(
                "The `sep` mesh axis (segment parallelism), in the mesh above 1: the sequence "
                "split over it, and `fleetjax.layers.attention` trades the split for one of the "
                "heads by all-to-all around attention (Ulysses); the heads must divide by `mp` x "
                "`sep` ([Long sequences](long_sequences.md))."
            ),
        ),
        field(6, "mp_configs", MP_CONFIG),
        field(7, "pp_configs", PP_CONFIG),
        field(8, "sharding_configs", DYGRAPH_SHARDING_CONFIG),
        field(9, "enable_optimizer_timer", bool, False, note=_PROFILER, kind="not yet"),
        field(
            10,
            "split_norm_comm",
            bool,
            False,
            note="XLA reduces a global norm in one all-reduce",
            kind="not yet",
        ),
        field(
            11,
            "ep_degree",
            int,
            1,
            check=_positive,
            kind="not yet",
            doc="Above 1: the mesh has no expert-parallel axis yet.",
        ),
        field(
            12,
            "moe_sharding_degree",
            int,
            1,
            check=_positive,
            kind="not yet",
            doc="Above 1: fleetjax's mesh has no mixture-of-experts axis yet.",
        ),
        field(13, "dp_configs", _comm_group("DpConfig", "dp_configs", "check_nccl_config")),
        field(14, "sep_configs", _comm_group("SepConfig", "sep_configs")),
        field(15, "dp_sep_configs", _comm_group("DpSepConfig", "dp_sep_configs")),
        field(16, "pp_tp_configs", _comm_group("PpTpConfig", "pp_tp_configs")),
        field(17, "ep_configs", _comm_group("EpConfig", "ep_configs", "grad_nccl_config")),
        field(
            18,
            "moe_sharding_configs",
            _comm_group("MoeShardingConfig", "moe_sharding_configs", "check_nccl_config"),
        ),
        field(
            19,
            "default_comm_group_configs",
            _comm_group("DefaultCommGroupConfig", "default_comm_group_configs"),
        ),
        field(
            20,
            "cp_degree",
            int,
            1,
            check=_positive,
            doc=(
                "The `cp` mesh axis (context parallelism), in the mesh above 1: the "
                "sequence split over it and attention a causal, load-balanced ring over "
                "it (`fleetjax.layers.attention`). As in Paddle it is carved out of the "
                "sharding group: it must divide `sharding_degree`, and the `sharding` "
                "axis keeps `sharding_degree / cp_degree` ([Long "
                "sequences](long_sequences.md))."
            ),
        ),
        field(
            21,
            "cp_sharding_degree",
            int,
            1,
            check=_positive,
            doc=(
                "Paddle's `sharding_degree / cp_degree`, the size of the mesh's "
                "`sharding` axis under context parallelism; another value raises. ZeRO "
                "splits over `sharding` alone, not also over `cp` as Paddle's sharding "
                "group does ([Differences](differences.md))."
            ),
        ),
        field(22, "cp_configs", _comm_group("CpConfig", "cp_configs")),
        field(23, "cp_sharding_configs", _comm_group("CpShardingConfig", "cp_sharding_configs")),
        field(24, "dp_cp_configs", _comm_group("DpCpConfig", "dp_cp_configs")),
        field(25, "cp_mp_configs", _comm_group("CpMpConfig", "cp_mp_configs")),
        # Python-only in Paddle (DistributedStrategy.hybrid_parallel_order): mesh axis order,
        # slowest-varying first.
        field(
            1001,
            "order",
            str,
            list(PADDLE_ORDER),
            paddle=False,
            check=one_of(*HYBRID_AXES),
            doc="The mesh axis order, slowest-varying first.",
        ),
    ],
)

TENSOR_PARALLEL_CONFIG = message(
    "TensorParallelConfig",
    "tensor_parallel_configs",
    [
        field(
            1,
            "tensor_parallel_degree",
            int,
            1,
            check=_positive,
            doc="The `mp` mesh axis size when `tensor_parallel` is on.",
        ),
        field(
            2,
            "tensor_init_seed",
            int,
            -1,
            note="parameters come initialised from the user's code, with its own keys",
            kind="not yet",
        ),
    ],
)

TRAINER_DESC_CONFIG = message(
    "TrainerDescConfig",
    "trainer_desc_configs",
    [
        field(1, "dump_fields_path", str, "", note=_PS),
        field(2, "dump_fields", str, [], note=_PS),
        field(3, "dump_param", str, [], note=_PS),
        field(4, "stat_var_names", str, [], note=_PS),
        field(5, "trainer", str, "", note=_PS),
        field(6, "device_worker", str, "", note=_PS),
        field(7, "local_sparse", str, [], note=_PS),
        field(8, "remote_sparse", str, [], note=_PS),
    ],
)

# -- parameter-server tables (`downpour_table_param`, set through `sparse_table_configs`) -------
# Paddle's `TableParameter` and its accessor; fleetjax reads a table's rules (`embed_sgd_param`,
# `embedx_sgd_param`) and checks its dimensions against the `SparseEmbedding` of that name.

_NOT_MODELLED_RULE = (
    "a table starts as its SparseEmbedding initialised it (initial_range is the layer's)"
)


SPARSE_NAIVE_SGD_RULE = message(
    "SparseNaiveSGDRuleParameter",
    "naive",
    [
        field(1, "learning_rate", float, 0.05),
        field(2, "initial_range", float, 0.0001, note=_NOT_MODELLED_RULE),
        field(3, "weight_bounds", float, []),
    ],
)

SPARSE_ADAGRAD_SGD_RULE = message(
    "SparseAdagradSGDRuleParameter",
    "adagrad",
    [
        field(1, "learning_rate", float, 0.05),
        field(2, "initial_g2sum", float, 3.0),
        field(3, "initial_range", float, 0.0001, note=_NOT_MODELLED_RULE),
        field(4, "weight_bounds", float, []),
    ],
)

SPARSE_ADAM_SGD_RULE = message(
    "SparseAdamSGDParameter",
    "adam",
    [
        field(1, "learning_rate", float, 0.001),
        field(2, "initial_range", float, 0.0001, note=_NOT_MODELLED_RULE),
        field(3, "beta1_decay_rate", float, 0.9),
        field(4, "beta2_decay_rate", float, 0.999),
        field(5, "ada_epsilon", float, 1e-08),
        field(6, "weight_bounds", float, []),
    ],
)

SGD_PARAMETER = message(
    "SGDParameter",
    "sgd_param",
    [
        field(1, "name", str, ""),
        field(2, "naive", SPARSE_NAIVE_SGD_RULE),
        field(3, "adagrad", SPARSE_ADAGRAD_SGD_RULE),
        field(4, "adam", SPARSE_ADAM_SGD_RULE),
    ],
)

CTR_ACCESSOR_PARAMETER = message(
    "CtrAccessorParameter",
    "ctr_accessor_param",
    [
        field(1, "nonclk_coeff", float, 0.1, note=_CTR),
        field(2, "click_coeff", float, 1.0, note=_CTR),
        field(3, "base_threshold", float, 1.5, note=_CTR),
        field(4, "delta_threshold", float, 0.25, note=_CTR),
        field(5, "delta_keep_days", float, 16.0, note=_CTR),
        field(6, "show_click_decay_rate", float, 0.98, note=_CTR),
        field(7, "delete_threshold", float, 0.8, note=_CTR),
        field(8, "delete_after_unseen_days", float, 30.0, note=_CTR),
        field(9, "ssd_unseenday_threshold", int, 1, note=_CTR),
        field(10, "show_scale", bool, True, note=_CTR),
        field(11, "zero_init", bool, True, note=_NOT_MODELLED_RULE),
        field(12, "load_filter_slots", float, [], note=_CTR),
        field(13, "save_filter_slots", float, [], note=_CTR),
    ],
)

TABLE_ACCESSOR_SAVE_PARAMETER = message(
    "TableAccessorSaveParameter",
    "table_accessor_save_param",
    [
        field(1, "param", int, 0),
        field(2, "converter", str, ""),
        field(3, "deconverter", str, ""),
    ],
)

GRAPH_SGD_PARAMETER = message(
    "GraphSGDParameter",
    "graph_sgd_param",
    [
        field(1, "nodeid_slot", int, 9008),
        field(2, "feature_learning_rate", float, 0.05),
    ],
)

_GRAPH = "graph-learning tables; fleetjax has sparse embedding tables only"

TABLE_ACCESSOR_PARAMETER = message(
    "TableAccessorParameter",
    "accessor",
    [
        # "" or SparseAccessor; Paddle's CTR accessors add show/click columns (not modelled).
        field(1, "accessor_class", str, ""),
        field(4, "fea_dim", int, 11),  # checked: embedding_dim + 2 (show, click, embed, embedx)
        field(5, "embedx_dim", int, 8),  # checked: embedding_dim - 1
        field(
            6,
            "embedx_threshold",
            int,
            10,
            note="Paddle trains a row's embedx columns once its show/click score reaches it; "
            "fleetjax trains every column from a row's first lookup",
        ),
        field(7, "ctr_accessor_param", CTR_ACCESSOR_PARAMETER),
        field(8, "table_accessor_save_param", TABLE_ACCESSOR_SAVE_PARAMETER, [], note=_CTR),
        field(10, "embed_sgd_param", SGD_PARAMETER),
        field(11, "embedx_sgd_param", SGD_PARAMETER),
        field(12, "graph_sgd_param", GRAPH_SGD_PARAMETER, note=_GRAPH),
    ],
)

TABLE_TYPE = Enum("TableType", (("PS_SPARSE_TABLE", 0), ("PS_DENSE_TABLE", 1)))

TABLE_PARAMETER = message(
    "TableParameter",
    "downpour_table_param",
    [
        field(1, "table_id", int, 0, note="fleetjax identifies a table by its table_name"),
        field(2, "table_name", str, ""),
        field(3, "table_class", str, "", note=_TABLE_STORE),
        field(4, "shard_num", int, 1000, note=_TABLE_STORE),
        field(
            5,
            "type",
            TABLE_TYPE,
            "PS_SPARSE_TABLE",
            note="dense parameters train data parallel; only sparse tables are tables",
        ),
        field(6, "accessor", TABLE_ACCESSOR_PARAMETER),
        field(7, "compress_in_save", bool, False, note=_TABLE_STORE),
        field(10, "enable_sparse_table_cache", bool, True, note=_TABLE_STORE),
        field(11, "sparse_table_cache_rate", float, 0.00055, note=_TABLE_STORE),
        field(12, "sparse_table_cache_file_num", int, 16, note=_TABLE_STORE),
        field(13, "enable_revert", bool, False, note=_TABLE_STORE),
        field(14, "shard_merge_rate", float, 1.0, note=_TABLE_STORE),
        field(15, "use_gpu_graph", bool, False, note=_GRAPH),
    ],
)

FS_CLIENT_PARAMETER = message(
    "FsClientParameter",
    "fs_client_param",
    [
        field(1, "uri", str, "", note=_PS),
        field(2, "user", str, "", note=_PS),
        field(3, "passwd", str, "", note=_PS),
        field(4, "hadoop_bin", str, "", note=_PS),
    ],
)

QAT_CONFIG = message(
    "QatConfig",
    "qat_configs",
    [
        field(
            1,
            "channel_wise_abs_max",
            bool,
            True,
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
        field(
            2,
            "weight_bits",
            int,
            8,
            check=_positive,
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
        field(
            3,
            "activation_bits",
            int,
            8,
            check=_positive,
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
        field(
            4,
            "not_quant_pattern",
            str,
            [],
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
        field(
            5,
            "algo",
            str,
            "",
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
    ],
)


def _set_by_fleet(name: str) -> str:
    return (
        f"Paddle's fleet replaces it with DistributedStrategy.{name}, the field fleetjax reads; "
        "set that one"
    )


_FROM_ROLE = (
    "Paddle's fleet fills it in from the role maker; fleetjax reads the role (fleet.worker_num(),"
    " fleet.worker_index(), fleet.worker_endpoints())"
)
_ONEDNN = "oneDNN kernels for Paddle's CPU operators; XLA:CPU picks its own kernels"

_BUILD_STRATEGY_PYTHON_FIELDS = (
    field(
        1001,
        "nccl_comm_num",
        int,
        1,
        paddle=False,
        check=_positive,
        note=_set_by_fleet("nccl_comm_num"),
    ),
    field(
        1002,
        "use_hierarchical_allreduce",
        bool,
        False,
        paddle=False,
        note=_set_by_fleet("use_hierarchical_allreduce"),
    ),
    field(
        1003,
        "hierarchical_allreduce_inter_nranks",
        int,
        0,
        paddle=False,
        check=_non_negative,
        note=_set_by_fleet("hierarchical_allreduce_inter_nranks"),
    ),
    field(
        1004, "sync_batch_norm", bool, False, paddle=False, note=_set_by_fleet("sync_batch_norm")
    ),
    field(
        1005,
        "fuse_all_reduce_ops",
        bool,
        True,
        paddle=False,
        note=_set_by_fleet("fuse_all_reduce_ops"),
    ),
    field(1006, "num_trainers", int, 1, paddle=False, check=_positive, note=_FROM_ROLE),
    field(1007, "trainer_id", int, 0, paddle=False, check=_non_negative, note=_FROM_ROLE),
    field(1008, "trainers_endpoints", str, [], paddle=False, note=_FROM_ROLE),
    field(
        1009,
        "bkcl_comm_num",
        int,
        1,
        paddle=False,
        check=_positive,
        note="the number of BKCL communicators on Kunlun XPUs; JAX has no Kunlun backend",
    ),
    field(1010, "async_mode", bool, False, paddle=False, note=_PS),
    field(
        1011,
        "build_cinn_pass",
        bool,
        False,
        paddle=False,
        note="Paddle's CINN compiler pass; XLA compiles every train step already",
    ),
    field(
        1012,
        "fuse_adamw",
        bool,
        False,
        paddle=False,
        kind="XLA default",
        when="silent",
        doc=(
            "XLA fuses the optimizer's elementwise updates itself (as for "
            "`fuse_all_optimizer_ops`)."
        ),
    ),
    field(1013, "memory_optimize", bool, None, paddle=False, note=_XLA_BUFFERS),
    field(1014, "mkldnn_enabled_op_types", str, [], paddle=False, note=_ONEDNN),
    field(1015, "onednn_enabled_op_types", str, [], paddle=False, note=_ONEDNN),
    field(1016, "sequential_run", bool, False, paddle=False, note=_XLA_SCHEDULES),
)

BUILD_STRATEGY = message(
    "BuildStrategy",
    "build_strategy",
    [
        field(1, "enable_sequential_execution", bool, False, paddle=False, note=_XLA_SCHEDULES),
        field(
            2,
            "fuse_elewise_add_act_ops",
            bool,
            False,
            kind="XLA default",
            doc=_XLA_FUSES,
        ),
        field(
            3,
            "fuse_bn_act_ops",
            bool,
            False,
            kind="XLA default",
            doc=_XLA_FUSES,
        ),
        field(
            4,
            "fuse_relu_depthwise_conv",
            bool,
            False,
            kind="XLA default",
            doc=_XLA_FUSES,
        ),
        field(
            5,
            "fuse_broadcast_ops",
            bool,
            False,
            kind="XLA default",
            doc=_XLA_FUSES,
        ),
        field(
            6,
            "fuse_all_optimizer_ops",
            bool,
            False,
            kind="XLA default",
            doc=_XLA_FUSES.replace(
                "once.", "once (XLA:GPU fuses the many small parameter updates horizontally)."
            ),
        ),
        field(7, "enable_inplace", bool, False, note=_XLA_BUFFERS),
        field(8, "enable_backward_optimizer_op_deps", bool, True, note=_XLA_SCHEDULES),
        field(
            9,
            "cache_runtime_context",
            bool,
            False,
            note=(
                "a cache of Paddle's per-operator runtime context; a compiled XLA program has none"
            ),
        ),
        field(
            10,
            "fuse_bn_add_act_ops",
            bool,
            True,
            kind="XLA default",
            doc=_XLA_FUSES.replace("once.", "once (this one is True by default, so False warns)."),
        ),
        field(
            11,
            "enable_auto_fusion",
            bool,
            False,
            kind="XLA default",
            doc=_XLA_FUSES,
        ),
        field(12, "enable_addto", bool, False, note=_XLA_BUFFERS),
        field(13, "fix_op_run_order", bool, False, paddle=False, note=_XLA_SCHEDULES),
        field(
            14,
            "allow_cuda_graph_capture",
            bool,
            False,
            kind="XLA default",
            doc=(
                "XLA:GPU runs fusions and library calls as CUDA graphs (command buffers) "
                "by default."
            ),
        ),
        field(
            15,
            "reduce_strategy",
            int,
            0,
            check=one_of(0, 1, 2),
            note=(
                "Paddle's Reduce mode gives each parameter's update to one device; in fleetjax "
                "that is ZeRO sharding (DistributedStrategy.sharding), and gradients are always "
                "all-reduced"
            ),
        ),
        field(
            16,
            "fuse_gemm_epilogue",
            bool,
            False,
            kind="XLA flag",
            doc=(
                "True: `--xla_gpu_enable_cublaslt=true`: GEMMs through cuBLASLt, which "
                "fuses bias and activation epilogues (XLA marks the flag deprecated; "
                "Triton GEMM fusions also fuse epilogues)."
            ),
        ),
        field(
            17,
            "debug_graphviz_path",
            str,
            "",
            kind="XLA flag",
            doc=(
                "`--xla_dump_to=<path> --xla_dump_hlo_as_dot=true`: XLA writes each "
                "compiled module there as graphviz `.dot` files."
            ),
        ),
        field(18, "fused_attention", bool, False, note=_ATTENTION),
        field(
            19,
            "fused_feedforward",
            bool,
            False,
            kind="XLA default",
            doc=_XLA_FUSES,
        ),
        field(20, "fuse_dot_product_attention", bool, False, note=_ATTENTION),
        field(
            21,
            "fuse_resunit",
            bool,
            False,
            note=(
                "cuDNN's fused ResNet-unit kernel (convolution, batch norm, add, ReLU); XLA has "
                "no such rewrite (it fuses the elementwise parts itself)"
            ),
        ),
        # paddle.static.BuildStrategy's Python-side attributes (not in the proto; Paddle drops
        # them when the build strategy is assigned to a DistributedStrategy, fleetjax keeps
        # them); defaults are paddle.static.BuildStrategy()'s in Paddle 3.3.1.
        *_BUILD_STRATEGY_PYTHON_FIELDS,
    ],
)

EXECUTION_STRATEGY = message(
    "ExecutionStrategy",
    "execution_strategy",
    [
        field(
            1,
            "num_threads",
            int,
            1,
            check=_positive,
            note=(
                "the thread pool of Paddle's executor; XLA runs each step as one program with its"
                " own threads"
            ),
        ),
        field(
            2,
            "num_iteration_per_drop_scope",
            int,
            10,
            check=_positive,
            note=(
                "how often Paddle's executor frees its scope of temporaries; XLA frees a step's "
                "temporaries when the step ends"
            ),
        ),
        field(
            3,
            "num_iteration_per_run",
            int,
            3,
            check=_positive,
            paddle_default=1,
            doc=(
                "`TrainStep.run(state, batches)` runs this many optimizer steps in one "
                "compiled call (a `lax.scan` over the batches: one host round trip) and "
                "returns every step's metrics; `__call__` still runs one."
            ),
        ),
        field(
            4,
            "use_thread_barrier",
            bool,
            False,
            note="a barrier between Paddle's executor threads; XLA has no executor threads",
        ),
    ],
)

GRADIENT_SCALE_CONFIG = message(
    "GradientScaleConfig",
    "gradient_scale_configs",
    [
        field(
            1,
            "scale_strategy",
            str,
            "avg",
            check=one_of("avg", "sum", "customized"),
            kind="not yet",
            doc=(
                "`avg` (the mean over replicas) is what the step does; `sum` and "
                "`customized` raise."
            ),
        ),
        field(
            2,
            "scale_gradient",
            bool,
            False,
            note=(
                "the step averages gradients over the replicas; scale_strategy selects anything "
                "else"
            ),
            kind="not yet",
        ),
    ],
)

# Names fleetjax had and removed: their errors name the replacement.
_EXPLAIN_REMOVED = (
    "strategy.explain() was removed (fleetjax's redesign, issue 17); "
    "print(fleetjax.applied_strategy(strategy)) shows what a strategy does, and "
    "fleet.applied_strategy() what the fleet's does on its mesh"
)

MODE = Enum("Mode", (("COLLECTIVE", 1), ("PS", 2), ("PIPELINE", 3), ("HETER", 4)))

DISTRIBUTED_STRATEGY = message(
    "DistributedStrategy",
    "DistributedStrategy",
    [
        field(
            1,
            "mode",
            MODE,
            "COLLECTIVE",
            check=one_of("COLLECTIVE"),
            doc="Collective mode; validation accepts only `COLLECTIVE`.",
        ),
        field(
            2,
            "amp",
            bool,
            False,
            doc=_AMP,
        ),
        field(
            3,
            "recompute",
            bool,
            False,
            doc=(
                "`jax.checkpoint` of the layers marked with `fleetjax.recompute`, keeping "
                "what `recompute_configs` names."
            ),
        ),
        field(
            4,
            "localsgd",
            bool,
            False,
            doc=(
                "LocalSGD (`fleetjax.optimizers`): each replica trains its own "
                "parameters, averaged every `k_steps`."
            ),
        ),
        field(
            5,
            "dgc",
            bool,
            False,
            doc=(
                "Deep gradient compression (`fleetjax.optimizers`): top-k sparse gradient "
                "exchange with momentum correction."
            ),
        ),
        field(
            6,
            "gradient_merge",
            bool,
            False,
            doc=(
                "Gradient merge (`fleetjax.transforms.gradient_merge`): across calls or "
                "within one step, see `gradient_merge_configs.mode`. Under the pipeline, "
                "across calls wraps the optimizer as without it; within one step it is "
                "the pipeline's accumulation (`k_steps` micro-batches)."
            ),
        ),
        field(7, "lars", bool, False, doc="Paddle's LARS momentum (`fleetjax.optimizers`)."),
        field(8, "lamb", bool, False, doc="Paddle's LAMB (`fleetjax.optimizers`)."),
        field(
            9,
            "pipeline",
            bool,
            False,
            doc=(
                "Pipeline parallelism over the `pp` mesh axis "
                "(`fleetjax.transforms.pipeline`); the loss is a `PipelineLayer` (three "
                "functions, or Paddle's `LayerDesc` list). It combines with gradient "
                "merge, `fp16_allreduce`, hierarchical all-reduce, ZeRO, AMP, recompute "
                "and model state; not with DGC/LocalSGD (an error)."
            ),
        ),
        field(
            10,
            "elastic",
            bool,
            False,
            note="Paddle's elastic training is set up on its launcher, and so is fleetjax's: "
            "fleetjax-run's --max_restart, --elastic_level and --nnodes min:max restart the job "
            "after a failure, and training resumes from the latest intact checkpoint",
        ),
        field(
            11,
            "auto",
            bool,
            False,
            doc=(
                "`fleetjax.auto.search` chooses the degrees, ZeRO stage, recompute and "
                "micro-batching by compiling candidate steps ([the auto "
                "planner](auto.md)); with another parallel switch it is an error naming "
                "both; `make_train_step` refuses `auto=True` and points to the planner, "
                "which needs the parameters and an example batch."
            ),
        ),
        # With sparse tables: False is the synchronous step, True with a_sync_configs.k_steps > 0
        # Geo-SGD; True otherwise (Paddle's async) runs synchronously and warns.
        field(
            12,
            "a_sync",
            bool,
            True,
            doc=(
                "Paddle's parameter-server modes ([parameter "
                "server](parameter_server.md)): False the synchronous step; set to True "
                "with `a_sync_configs.k_steps` > 0 Geo-SGD "
                "(`fleetjax.optimizers.geo_sgd`); set to True otherwise, Paddle's "
                "asynchronous mode, runs synchronously and warns (no SPMD counterpart). "
                "Left at its default it is a collective strategy's. As in Paddle, "
                "assigning it sets `a_sync_configs.k_steps` to 0."
            ),
        ),
        field(
            13,
            "sync_nccl_allreduce",
            bool,
            True,
            note=(
                "Paddle waits on the NCCL stream after each all-reduce; XLA orders its "
                "collectives and the computation itself"
            ),
        ),
        field(
            14,
            "nccl_comm_num",
            int,
            1,
            check=_positive,
            note=(
                "the number of NCCL communicators Paddle opens per group; XLA creates its own "
                "(tune NCCL with its NCCL_* environment variables)"
            ),
        ),
        # Both applied by fleetjax.transforms.grad_allreduce.hierarchical_mean.
        field(
            15,
            "use_hierarchical_allreduce",
            bool,
            False,
            doc=(
                "`fleetjax.transforms.grad_allreduce.hierarchical_mean`: gradients are "
                "averaged by ring reduce-scatter within each node, an all-reduce of each "
                "device's part across nodes, and a ring all-gather within the node "
                "(collective-permutes), so only 1/ranks-per-node of each gradient crosses "
                "nodes. Under the pipeline, each replica's gradients are reduced so once, "
                "after its loop. Not with ZeRO stage 2/3 or DGC/LocalSGD (an error)."
            ),
        ),
        field(
            16,
            "hierarchical_allreduce_inter_nranks",
            int,
            1,
            check=_positive,
            doc=(
                "The devices per node of the two-level reduction (consecutive "
                "data-parallel replicas, node-major as JAX lists a host's devices); left "
                "unset, a node is one process's replicas (Paddle: one machine's GPUs). It "
                "must divide the data-parallel size."
            ),
        ),
        field(
            17,
            "sync_batch_norm",
            bool,
            False,
            doc=(
                "`fleetjax.layers.BatchNorm` statistics over all data-parallel replicas "
                "(`sync=True`) or each replica's rows. `fleet.distributed_model(model)` "
                "converts a model's `nnx.BatchNorm` layers to it, as the strategy says "
                "(`fleetjax.layers.batch_norm.convert_batch_norm(model, sync=..., "
                "replicas=...)` by hand)."
            ),
        ),
        field(
            18,
            "fuse_all_reduce_ops",
            bool,
            True,
            kind="XLA flag",
            doc=(
                "`--xla_gpu_all_reduce_combine_threshold_bytes`: `fuse_grad_size_in_MB` "
                "MiB when True, 0 (one all-reduce per gradient) when False. Unset, XLA's "
                "own heuristic (about 30 MiB) stays."
            ),
        ),
        field(
            19,
            "fuse_grad_size_in_MB",
            int,
            32,
            check=_non_negative,
            kind="XLA flag",
            doc=(
                "`--xla_gpu_all_reduce_combine_threshold_bytes` = this many MiB (0 if "
                "`fuse_all_reduce_ops` is False)."
            ),
        ),
        field(
            20,
            "fuse_grad_size_in_TFLOPS",
            float,
            20.0,
            check=_non_negative,
            paddle_default=50.0,
            note=(
                "Paddle caps its gradient fusion groups by layer count; XLA combines by size "
                "(fuse_grad_size_in_MB) and by count of collectives (fuse_grad_size_in_num)"
            ),
        ),
        field(
            21,
            "cudnn_exhaustive_search",
            bool,
            True,
            paddle_default=False,
            kind="XLA flag",
            doc=(
                "False: `--xla_gpu_autotune_level=0`, the heuristic algorithm without "
                "benchmarking (for GEMMs too). True: XLA's default autotuning (level 4), "
                "which benchmarks every candidate; no flag needed."
            ),
        ),
        field(
            22,
            "conv_workspace_size_limit",
            int,
            4000,
            check=_non_negative,
            paddle_default=512,
            note=(
                "a cap on cuDNN's convolution workspace; XLA picks convolution algorithms and "
                "their workspace itself, and this jaxlib has no flag to cap it"
            ),
        ),
        field(
            23,
            "cudnn_batchnorm_spatial_persistent",
            bool,
            True,
            paddle_default=False,
            note=(
                "a cuDNN batch-norm mode; JAX computes batch norm from reductions that XLA fuses,"
                " with no cuDNN batch-norm call to configure"
            ),
        ),
        field(
            24,
            "adaptive_localsgd",
            bool,
            False,
            doc=(
                "Adaptive LocalSGD (`fleetjax.optimizers`): the averaging interval "
                "follows the loss."
            ),
        ),
        field(
            25,
            "fp16_allreduce",
            bool,
            False,
            doc=(
                "Gradients all-reduced in half precision (`fp16_allreduce_dtype`) inside "
                "`shard_map` (`fleetjax.transforms.grad_allreduce`); under the pipeline, "
                "each replica's accumulated gradients, once, after its loop."
            ),
        ),
        field(
            26,
            "sharding",
            bool,
            False,
            doc=("ZeRO over the `sharding` mesh axis; the stage is `sharding_configs.stage`."),
        ),
        field(
            27,
            "last_comm_group_size_MB",
            float,
            1.0,
            check=greater_than(0),
            note=(
                "the size of the last gradient bucket of Paddle's DataParallel; XLA's all-reduce "
                "combiner has one threshold for all (fuse_grad_size_in_MB)"
            ),
        ),
        field(
            28,
            "find_unused_parameters",
            bool,
            False,
            note=(
                "Paddle's DataParallel searches the graph for parameters without gradients; JAX's"
                " autodiff gives them zero gradients"
            ),
        ),
        field(
            29,
            "tensor_parallel",
            bool,
            False,
            doc=(
                "Tensor parallelism over the `mp` axis: parameters placed by "
                "`param_specs` (`fleetjax.layers.partition_specs` reads flax partitioning "
                "metadata); the `mp` size from `tensor_parallel_configs`."
            ),
        ),
        field(30, "without_graph_optimization", bool, True, note=_STATIC),
        field(
            31,
            "fuse_grad_size_in_num",
            int,
            8,
            check=_positive,
            kind="XLA flag",
            doc=(
                "`--xla_gpu_collective_combine_threshold_count`: at most this many "
                "collectives combined into one (XLA applies it to all its collective "
                "combiners); only while `fuse_all_reduce_ops` is True."
            ),
        ),
        field(
            32,
            "calc_comm_same_stream",
            bool,
            False,
            kind="XLA flag",
            doc=(
                "True: `--xla_gpu_disable_async_collectives=ALLCOLLECTIVES`, synchronous "
                "collectives on the compute stream."
            ),
        ),
        field(
            33,
            "asp",
            bool,
            False,
            kind="not yet",
            doc="2:4 structured sparsity is not implemented.",
        ),
        field(
            34,
            "fuse_grad_merge",
            bool,
            False,
            note=(
                "Paddle fuses its gradient-merge buffers for communication; XLA lays out all "
                "buffers itself"
            ),
        ),
        field(
            35,
            "semi_auto",
            bool,
            False,
            kind="not yet",
            doc="Semi-automatic parallelism is not implemented.",
        ),
        field(36, "adam_d2sum", bool, False, note=_PS),
        field(
            37,
            "auto_search",
            bool,
            False,
            kind="not yet",
            doc="Raises, pointing to `fleetjax.auto.search` (the search is a call).",
        ),
        field(38, "heter_ccl_mode", bool, False, note=_PS),
        field(39, "is_fl_ps_mode", bool, False, note=_PS),
        field(40, "with_coordinator", bool, False, note=_PS),
        field(
            41,
            "qat",
            bool,
            False,
            kind="not yet",
            doc="Quantization-aware training is not implemented.",
        ),
        field(
            42,
            "split_data",
            bool,
            True,
            note="it tells Paddle's auto-parallel data loader to split batches; a fleetjax step "
            "always splits the global batch over the data axes",
        ),
        # fleetjax: the dtype fp16_allreduce communicates in.
        field(
            1001,
            "fp16_allreduce_dtype",
            str,
            "float16",
            paddle=False,
            check=_half,
            doc=(
                "fleetjax extension: `float16` or `bfloat16`, the dtype `fp16_allreduce` sums in."
            ),
        ),
        field(101, "recompute_configs", RECOMPUTE_CONFIG),
        field(102, "amp_configs", AMP_CONFIG),
        field(103, "localsgd_configs", LOCALSGD_CONFIG),
        field(104, "gradient_merge_configs", GRADIENT_MERGE_CONFIG),
        field(105, "dgc_configs", DGC_CONFIG),
        field(106, "pipeline_configs", PIPELINE_CONFIG),
        field(107, "a_sync_configs", ASYNC_CONFIG),
        field(108, "lars_configs", LARS_CONFIG),
        field(109, "lamb_configs", LAMB_CONFIG),
        field(110, "adaptive_localsgd_configs", ADAPTIVE_LOCALSGD_CONFIG),
        field(111, "sharding_configs", SHARDING_CONFIG),
        field(112, "hybrid_configs", HYBRID_CONFIG),
        field(113, "tensor_parallel_configs", TENSOR_PARALLEL_CONFIG),
        field(114, "trainer_desc_configs", TRAINER_DESC_CONFIG),
        field(
            115,
            "downpour_table_param",
            TABLE_PARAMETER,
            [],
            doc=(
                "Paddle's sparse table configs (`TableParameter`s, set with "
                "`sparse_table_configs`), one per `SparseEmbedding` by `table_name`: its "
                "accessor's `embed_sgd_param` and `embedx_sgd_param` pick the sparse "
                "rules of the first and the other columns "
                "(`fleetjax.transforms.sparse_rows`), `fea_dim` and `embedx_dim` are "
                "checked against the table; table storage, CTR bookkeeping and graph "
                "settings warn once each (see [parameter server](parameter_server.md))."
            ),
        ),
        field(116, "fs_client_param", FS_CLIENT_PARAMETER),
        field(117, "qat_configs", QAT_CONFIG),
        field(201, "build_strategy", BUILD_STRATEGY),
        field(202, "execution_strategy", EXECUTION_STRATEGY, paddle=False),
        field(203, "gradient_scale_configs", GRADIENT_SCALE_CONFIG),
    ],
    hints={"explain": _EXPLAIN_REMOVED},
)

# -- paddle.distributed.Strategy (auto-parallel; seed 002) -------------------------------------
# Section keys and defaults are Paddle's (python/paddle/distributed/auto_parallel/constants.py);
# numbers only order the fields.

# Quantization-aware training (Paddle's auto-parallel constants.py QAT section).
_NO_QAT = "quantization-aware training is not in fleetjax"
AUTO_QAT = message(
    "QATSection",
    "qat",
    [
        field(
            1,
            "enable",
            bool,
            False,
            kind="not yet",
            doc="Quantization-aware training is not implemented.",
        ),
        field(
            2,
            "channel_wise_abs_max",
            bool,
            True,
            kind="not yet",
            when="silent",
            doc=_AUTO_QAT_OFF,
        ),
        field(
            3,
            "weight_bits",
            int,
            8,
            check=_positive,
            kind="not yet",
            when="silent",
            doc=_AUTO_QAT_OFF,
        ),
        field(
            4,
            "activation_bits",
            int,
            8,
            check=_positive,
            kind="not yet",
            when="silent",
            doc=_AUTO_QAT_OFF,
        ),
        field(
            5,
            "not_quant_pattern",
            str,
            ["skip_quant"],
            kind="not yet",
            when="silent",
            doc=_AUTO_QAT_OFF,
        ),
        field(
            6,
            "algo",
            str,
            None,
            kind="not yet",
            when="silent",
            doc=_AUTO_QAT_OFF,
        ),
        field(
            7,
            "onnx_format",
            bool,
            True,
            kind="not yet",
            when="silent",
            doc=_AUTO_QAT_OFF,
        ),
    ],
)

AUTO_SHARDING = message(
    "ShardingSection",
    "sharding",
    [
        field(1, "enable", bool, False, doc="ZeRO over the `sharding` mesh axis."),
        field(
            2,
            "stage",
            int,
            1,
            check=one_of(1, 2, 3),
            doc="The ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters.",
        ),
        field(3, "degree", int, 8, check=_positive, doc="The `sharding` mesh axis size."),
        field(4, "enable_overlap", bool, False, note=_XLA_OVERLAP, kind="not yet"),
        field(
            5, "param_comm_stream_num", int, 1, check=_positive, note=_XLA_OVERLAP, kind="not yet"
        ),
        field(
            6, "grad_comm_stream_num", int, 1, check=_positive, note=_XLA_OVERLAP, kind="not yet"
        ),
        field(
            7,
            "param_bucket_size_numel",
            int,
            1,
            check=_positive,
            note="XLA combines collectives by bytes (comm_buffer_size_MB), not by element count",
            kind="not yet",
        ),
        field(
            8,
            "grad_bucket_size_numel",
            int,
            1,
            check=_positive,
            note="XLA combines collectives by bytes (comm_buffer_size_MB), not by element count",
            kind="not yet",
        ),
        field(
            9,
            "enable_hierarchical_comm",
            bool,
            False,
            note="NCCL picks hierarchical algorithms itself (NCCL_ALGO)",
            kind="not yet",
        ),
        field(10, "partition_algor", str, "greedy_even", note=_ZERO_EVEN, kind="not yet"),
        field(11, "enable_tuning", bool, False, note=_STATIC),
        field(
            12,
            "tuning_range",
            int,
            [],
            note="there is no sharding tuner in fleetjax",
            kind="not yet",
        ),
        field(13, "release_gradients", bool, False, note=_XLA_FREES, kind="not yet"),
        field(
            14,
            "comm_buffer_size_MB",
            int,
            256,
            check=_positive,
            kind="XLA flag",
            doc=_COMM_BUFFER,
        ),
        field(15, "enable_tensor_fusion", bool, False, note=_XLA_LAYOUT, kind="not yet"),
        field(
            16,
            "save_unbalanced_param",
            bool,
            True,
            note="checkpoints hold whole arrays (orbax), whatever the placement",
            kind="not yet",
        ),
        field(
            17,
            "segment_broadcast_MB",
            float,
            32.0,
            note="Paddle 2.4's size of the parameter broadcast segments (Paddle 3 dropped the key "
            "and takes it as any attribute); XLA schedules ZeRO's all-gathers itself",
        ),
    ],
)

AUTO_FUSED_PASSES = message(
    "FusedPassesSection",
    "fused_passes",
    [
        field(
            1,
            "enable",
            bool,
            False,
            doc=(
                "Turns on the fused passes below (`gemm_epilogue` maps to an XLA flag; "
                "`dropout_add` is XLA's default)."
            ),
        ),
        field(
            2,
            "gemm_epilogue",
            bool,
            False,
            kind="XLA flag",
            doc=(
                "With `enable`: `--xla_gpu_enable_cublaslt=true`, GEMMs through cuBLASLt, "
                "which fuses bias and activation epilogues. Without `enable`, warns once "
                "(Paddle applies no pass then)."
            ),
        ),
        field(
            3,
            "dropout_add",
            bool,
            False,
            kind="XLA default",
            doc=(
                "XLA fuses dropout's mask-multiply and the residual add into one kernel "
                "by itself. Without `enable`, warns once (Paddle applies no pass then)."
            ),
        ),
    ],
    hints={"gemm_spilogue": "the key is 'gemm_epilogue' (Paddle's docstring has a typo)"},
)

AUTO_GRADIENT_MERGE = message(
    "GradientMergeSection",
    "gradient_merge",
    [
        field(
            1, "enable", bool, False, doc="Gradient merge (`fleetjax.transforms.gradient_merge`)."
        ),
        field(2, "k_steps", int, 1, check=_positive, doc="Micro-steps merged into one update."),
        field(
            3,
            "avg",
            bool,
            True,
            doc=(
                "Mean (True) or sum of the merged gradients. Under the pipeline always "
                "the mean, as Paddle's engine sets it (False warns)."
            ),
        ),
        field(
            4,
            "mode",
            str,
            "in_step",
            check=_merge_mode,
            doc=(
                "fleetjax extension: `in_step` (Paddle's auto-parallel: the batch is "
                "split; under the pipeline, into the pipeline's `k_steps` micro-batches, "
                "as Paddle's engine) or `across_calls`."
            ),
        ),
    ],
)

AUTO_PIPELINE = message(
    "PipelineSection",
    "pipeline",
    [
        field(
            1,
            "enable",
            bool,
            False,
            doc=("Pipeline parallelism over the `pp` mesh axis; the loss is a `PipelineLayer`."),
        ),
        field(
            2,
            "schedule_mode",
            str,
            "1F1B",
            check=one_of(*PADDLE_SCHEDULE_MODES),
            doc=(
                "`1F1B`, `Eager1F1B`, `FThenB`, `VPP`, or the zero-bubble `ZBH1` and `ZBVPP` "
                "(see `pipeline_configs.schedule_mode`)."
            ),
        ),
        field(3, "pp_degree", int, 1, check=_positive, doc="The `pp` mesh axis size."),
        field(
            4, "vpp_degree", int, 1, check=_positive, doc="Virtual stages per device under `VPP`."
        ),
        field(
            5,
            "vpp_seg_method",
            str,
            "",
            note="the PipelineLayer defines its stages",
            kind="not yet",
            doc=(
                "The PipelineLayer defines its stages (its `seg_method`, in the `LayerDesc` form)."
            ),
        ),
        field(6, "micro_batch_size", int, 1, check=_positive, doc="The size of one micro-batch."),
        field(
            7,
            "accumulate_steps",
            int,
            1,
            check=_positive,
            doc=(
                "Micro-batches per step; `gradient_merge.k_steps` sets it under in-step "
                "gradient merge (they must agree where both are set)."
            ),
        ),
        field(
            8,
            "generation_batch_size",
            int,
            1,
            check=_positive,
            note="generation is not in fleetjax",
            kind="not yet",
        ),
        field(9, "enable_send_recv_overlap", bool, False, note=_XLA_OVERLAP, kind="not yet"),
        field(10, "job_schedule_profiler_start", int, -1, note=_PROFILER, kind="not yet"),
        field(11, "job_schedule_profiler_stop", int, -1, note=_PROFILER, kind="not yet"),
        field(
            12, "program_runtimes", int, [61, 72, 71, 34, 3], note=_SCHEDULE_HINT, kind="not yet"
        ),
        field(13, "memory_limit_times", int, -1, note=_SCHEDULE_HINT, kind="not yet"),
        field(
            14,
            "split_backward",
            bool,
            False,
            note=(
                "the schedule_mode decides whether the backward is split into its input and "
                "weight gradients: ZBH1 and ZBVPP split it, the others do not; this flag changes "
                "nothing"
            ),
        ),
        field(15, "auto_parallel_sync_shared_params", bool, False, note=_SPMD_SYNC, kind="not yet"),
    ],
)

AUTO_AMP = message(
    "AmpSection",
    "amp",
    [
        field(
            1,
            "enable",
            bool,
            False,
            doc=_AMP,
        ),
        field(
            2,
            "dtype",
            str,
            "float16",
            check=one_of("float16", "bfloat16"),
            doc="`float16` or `bfloat16`.",
        ),
        field(
            3,
            "level",
            str,
            "o1",
            check=one_of("o1", "o2", "O1", "O2"),
            doc=(
                "O1 (per-operation casts) or O2 (half-precision parameters, float32 "
                "master weights)."
            ),
        ),
        *_loss_scaling(4, default=0.8),
        field(
            9,
            "use_dynamic_loss_scaling",
            bool,
            True,
            doc="Dynamic loss scaling (skip non-finite steps).",
        ),
        field(10, "custom_white_list", str, [], doc="Operations added to the half-precision list."),
        field(11, "custom_black_list", str, [], doc="Operations kept in float32."),
        field(
            12, "custom_black_varnames", str, [], doc="Named values whose consumers stay float32."
        ),
        field(
            13,
            "use_fp16_guard",
            bool,
            False,
            doc=(
                "Under O2 float16, only code inside `fleetjax.fp16_guard` runs in half precision."
            ),
        ),
        field(14, "use_bf16_guard", bool, False, doc="Under O2 bfloat16, likewise."),
        field(
            15,
            "use_master_grad",
            bool,
            False,
            doc=(
                "The optimizer always sees float32 gradients of float32 master weights "
                "(`fleetjax.transforms.amp`)."
            ),
        ),
        field(
            16,
            "use_promote",
            bool,
            True,
            doc=(
                "O1 operations with mixed inputs run in the widest dtype; False: in half precision."
            ),
        ),
    ],
)

AUTO_RECOMPUTE = message(
    "RecomputeSection",
    "recompute",
    [
        field(
            1,
            "enable",
            bool,
            False,
            doc="`jax.checkpoint` of the layers marked with `fleetjax.recompute`.",
        ),
        field(
            2,
            "checkpoints",
            str,
            [],
            doc=("The activations (named with `fleetjax.checkpoint_name`) that recompute keeps."),
        ),
        field(3, "no_recompute_segments", int, [], note=_RECOMPUTE_POLICY, kind="not yet"),
        field(4, "sr", int, 0, check=_non_negative, note=_RECOMPUTE_POLICY, kind="not yet"),
        field(
            5,
            "refined_ops_patterns",
            REFINED_OPS_PATTERN,
            [],
            note=_RECOMPUTE_POLICY,
            kind="not yet",
        ),
        field(6, "enable_tuning", bool, False, note=_STATIC),
        field(
            7,
            "policy",
            str,
            "",
            check=_remat_policy,
            doc="fleetjax extension: a `jax.checkpoint_policies` name.",
        ),
    ],
)

_ENGINE = "a setting of Paddle's auto-parallel Engine; fleetjax has no Engine"

AUTO_DP_OPTIMIZATION = message(
    "DPOptimizationSection",
    "dp_optimization",
    [
        field(1, "enable", bool, False),
        field(2, "fuse_all_reduce_ops", bool, True),
        field(3, "fuse_grad_size_in_MB", int, 32, check=_non_negative),
        field(4, "overlap_comm_cacl", bool, True),
        field(5, "gradient_sync_after_accumulate", bool, False),
    ],
)

AUTO_MP_OPTIMIZATION = message(
    "MPOptimizationSection",
    "mp_optimization",
    [
        field(1, "allreduce_matmul_grad_overlapping", bool, False),
        field(2, "replace_with_c_embedding", bool, False),
        field(3, "replace_with_parallel_cross_entropy", bool, False),
    ],
)

AUTO_SP_OPTIMIZATION = message(
    "SPOptimizationSection", "sp_optimization", [field(1, "enable", bool, True)]
)

# The top-level keys of both auto-parallel strategies (Paddle's constants.BASE).
_AUTO_BASE_FIELDS = (
    field(
        101,
        "auto_mode",
        str,
        "semi",
        note=(
            "Paddle's fully automatic search; fleetjax places arrays as the degrees and the "
            "model's logical axes say, and XLA's GSPMD propagates the rest"
        ),
    ),
    field(
        102,
        "gradient_scale",
        bool,
        True,
        check=Check(
            lambda v: v is True,
            "True: the step averages gradients over the data-parallel replicas (scale the loss "
            "by the replica count to sum them)",
        ),
        doc=(
            "Only True: the step averages gradients over the data-parallel replicas; "
            "False (Paddle: sum them) is refused with a ValueError saying to scale "
            "the loss by the replica count instead."
        ),
    ),
    field(
        103,
        "gradient_scale_using_allreduce_avg",
        bool,
        False,
        note="the step averages gradients with one all-reduce (pmean) already",
    ),
    field(104, "use_cache", bool, True, note=_ENGINE + " (jax.jit caches compiled steps)"),
    field(105, "return_numpy", bool, True, note=_ENGINE + " (steps return jax.Array)"),
    field(106, "all_ranks", bool, False, note=_ENGINE),
    field(
        107,
        "split_data",
        bool,
        True,
        note="a fleetjax step always splits the global batch over the data axes",
    ),
    field(
        108,
        "seed",
        int,
        None,
        note="parameters and PRNG keys come from the user's code, with its own jax.random keys",
    ),
    field(109, "reinit", bool, False, note=_ENGINE),
)

_DP_PASSES = (
    "Paddle's data-parallel passes; XLA combines the step's all-reduces and overlaps them itself"
    " (set the combining threshold with XLA_FLAGS=--xla_gpu_all_reduce_combine_threshold_bytes)"
)
_MP_PASSES = (
    "Paddle's tensor-parallel rewrites; XLA's SPMD partitioner places these operations from the"
    " shardings itself"
)
_SP = (
    "Paddle's sequence-parallel rewrites; XLA's SPMD partitioner places the all-gathers and "
    "reduce-scatters of sequence parallelism (fleetjax.layers.sequence_parallel) from the "
    "shardings itself"
)
# The passes sections both auto-parallel strategies have.
_AUTO_OPTIMIZATION_SECTIONS = (
    field(11, "dp_optimization", AUTO_DP_OPTIMIZATION, note=_DP_PASSES),
    field(12, "mp_optimization", AUTO_MP_OPTIMIZATION, note=_MP_PASSES),
    field(13, "sp_optimization", AUTO_SP_OPTIMIZATION, note=_SP),
)

AUTO_STRATEGY = message(
    "Strategy",
    "Strategy",
    [
        field(1, "sharding", AUTO_SHARDING),
        field(2, "fused_passes", AUTO_FUSED_PASSES),
        field(3, "gradient_merge", AUTO_GRADIENT_MERGE),
        field(4, "pipeline", AUTO_PIPELINE),
        field(5, "amp", AUTO_AMP),
        field(6, "recompute", AUTO_RECOMPUTE),
        field(7, "qat", AUTO_QAT),  # qat.enable raises (read_plan); the settings do nothing
        *_AUTO_OPTIMIZATION_SECTIONS,
        *_AUTO_BASE_FIELDS,
        field(
            110,
            "full_graph",
            bool,
            True,
            note="jax.jit always traces the whole step; there is no partial-graph mode",
        ),
    ],
    hints={"explain": _EXPLAIN_REMOVED},
)

# -- paddle.distributed.fleet.auto.Strategy (the older auto-parallel strategy) ----------------
# Section keys and defaults are Paddle's constants.py; fleetjax trains with the newer Strategy
# (`Strategy._from_legacy_strategy` converts, as Paddle's does).

AUTO_TUNING = message(
    "TuningSection",
    "tuning",
    [
        field(1, "enable", bool, False),
        field(2, "profile_start_step", int, 1, check=_non_negative),
        field(3, "profile_end_step", int, 1, check=_non_negative),
        field(4, "run_after_tuning", bool, True),
        field(5, "debug", bool, False),
    ],
)

AUTO_DATASET = message(
    "DatasetSection",
    "dataset",
    [field(1, "enable", bool, False), field(2, "num_shards", int, 1, check=_positive)],
)

AUTO_FUSED_LINEAR_PROMOTION = message(
    "FusedLinearPromotionSection", "fused_linear_promotion", [field(1, "enable", bool, False)]
)

AUTO_LEGACY_FUSED_PASSES = message(
    "LegacyFusedPassesSection",
    "fused_passes",
    [field(1, "enable", bool, False), field(2, "fused_passes_list", str, [])],
)

LEGACY_AUTO_STRATEGY = message(
    "LegacyAutoStrategy",
    "fleet.auto.Strategy",
    [
        field(1, "recompute", AUTO_RECOMPUTE),
        field(2, "amp", AUTO_AMP),
        field(3, "sharding", AUTO_SHARDING),
        field(4, "gradient_merge", AUTO_GRADIENT_MERGE),
        field(5, "pipeline", AUTO_PIPELINE),
        field(6, "qat", AUTO_QAT, note=_NO_QAT),
        field(7, "tuning", AUTO_TUNING, note="there is no auto-tuner in fleetjax"),
        field(
            8,
            "dataset",
            AUTO_DATASET,
            note="a fleetjax step splits the global batch over the data axes itself",
        ),
        field(9, "fused_passes", AUTO_LEGACY_FUSED_PASSES),
        field(
            10,
            "fused_linear_promotion",
            AUTO_FUSED_LINEAR_PROMOTION,
            note="XLA fuses a linear layer's bias add into the matmul itself",
        ),
        *_AUTO_OPTIMIZATION_SECTIONS,
        *_AUTO_BASE_FIELDS,
    ],
)


def seed_default_differences() -> list[tuple[str, object, object]]:
    """(field path, fleetjax default = the seeds', Paddle 3.3.1's proto default) for each field
    whose default fleetjax takes from the seed documents rather than from Paddle's code."""
    out = []

    def walk(spec: MessageSpec, prefix: str) -> None:
        for f in spec.fields:
            if f.is_message and not f.repeated:
                walk(f.type, f"{prefix}{f.name}.")
            elif f.paddle_default is not None:
                out.append((prefix + f.name, f.default, f.paddle_default))

    walk(DISTRIBUTED_STRATEGY, "")
    return out
