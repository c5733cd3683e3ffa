"""Hybrid parallelism and the pipeline: `hybrid_configs` (degrees, order, and its `mp_configs`,
`pp_configs`, `sharding_configs` sub-messages), the static `sharding_configs`,
`pipeline_configs` and `tensor_parallel_configs` of `DistributedStrategy`."""

from __future__ import annotations

from fleetjax._config import Check, MessageSpec, field, greater_than, message, one_of
from fleetjax._schema._shared import (
    COMM_BUFFER,
    PADDLE_SCHEDULE_MODES,
    PROFILER,
    SCHEDULE_HINT,
    SPMD_SYNC,
    STATIC,
    XLA_FREES,
    XLA_LAYOUT,
    XLA_OVERLAP,
    positive,
)
from fleetjax.vocabulary import PADDLE_ORDER

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


PIPELINE_CONFIG = message(
    "PipelineConfig",
    "pipeline_configs",
    [
        field(1, "micro_batch_size", int, 1, check=positive, doc="The size of one micro-batch."),
        field(
            2,
            "accumulate_steps",
            int,
            1,
            check=positive,
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
            check=positive,
            doc=("The `sharding` mesh axis size (Paddle's default 8) when `sharding` is on."),
        ),
        field(
            5,
            "mp_degree",
            int,
            1,
            check=positive,
            doc="The `mp` mesh axis size when `sharding` is on.",
        ),
        field(
            6,
            "dp_degree",
            int,
            1,
            check=positive,
            doc="The `dp` mesh axis size when `sharding` is on.",
        ),
        field(7, "hybrid_dp", bool, False, note="deprecated in Paddle: dp_degree >= 2 implies it"),
        field(
            8,
            "gradient_merge_acc_step",
            int,
            1,
            check=positive,
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
            check=positive,
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
        field(13, "_dp_as_optimizer_sharding", bool, False, note=STATIC),
        field(
            14,
            "stage",
            int,
            1,
            check=one_of(1, 2, 3),
            doc="The ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters.",
        ),
        field(15, "enable_tuning", bool, False, note=STATIC),
        field(16, "use_calc_stream", bool, False, note=STATIC),
    ],
)

MP_CONFIG = message(
    "MpConfig",
    "mp_configs",
    [
        field(1, "sync_param", bool, True, note=SPMD_SYNC, kind="not yet"),
        field(2, "sync_grad", bool, False, note=SPMD_SYNC, kind="not yet"),
        field(3, "sync_moment", bool, False, note=SPMD_SYNC, kind="not yet"),
        field(
            4,
            "sync_mode",
            str,
            "broadcast",
            check=one_of("broadcast", "average"),
            note=SPMD_SYNC,
            kind="not yet",
        ),
        field(5, "mp_async_allreduce", bool, False, note=XLA_OVERLAP, kind="not yet"),
        field(6, "mp_skip_c_identity", bool, False, note=XLA_LAYOUT, kind="not yet"),
        field(7, "mp_fused_linear_param_grad_add", bool, False, note=XLA_LAYOUT, kind="not yet"),
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
            note=SPMD_SYNC,
            kind="not yet",
        ),
    ],
)

PP_CONFIG = message(
    "PpConfig",
    "pp_configs",
    [
        field(1, "dp_comm_overlap", bool, False, note=XLA_OVERLAP, kind="not yet"),
        field(
            2,
            "delay_scale_loss",
            bool,
            False,
            note="the pipeline's loss is the exact mean over micro-batches whenever it is scaled",
            kind="not yet",
        ),
        field(3, "enable_timer", bool, False, note=PROFILER, kind="not yet"),
        field(4, "sharding_comm_overlap", bool, False, note=XLA_OVERLAP, kind="not yet"),
        field(5, "profiling", bool, False, note=PROFILER, kind="not yet"),
        field(6, "release_gradients", bool, False, note=XLA_FREES, kind="not yet"),
        field(7, "overlap_p2p_comm", bool, False, note=XLA_OVERLAP, kind="not yet"),
        field(8, "clear_every_step_cache", bool, False, note=XLA_FREES, kind="not yet"),
        field(9, "use_batch_p2p_comm", bool, True, note=XLA_OVERLAP, kind="not yet"),
        field(10, "best_unbalanced_scheduler", bool, False, note=SCHEDULE_HINT, kind="not yet"),
        field(11, "enable_offload_queue", bool, False, note=XLA_FREES, kind="not yet"),
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
            14, "forward_backward_overlap_scheduler", bool, False, note=XLA_OVERLAP, kind="not yet"
        ),
        field(15, "coll_nccl_config", NCCL_CONFIG, note=_NCCL_NOTE),
        field(16, "p2p_nccl_config", NCCL_CONFIG, note=_NCCL_NOTE),
        field(17, "shared_nccl_config", NCCL_CONFIG, note=_NCCL_NOTE),
        field(18, "sync_param", bool, False, note=SPMD_SYNC, kind="not yet"),
        field(19, "sync_moment", bool, False, note=SPMD_SYNC, kind="not yet"),
        field(
            20,
            "sync_mode",
            str,
            "broadcast",
            check=one_of("broadcast", "average"),
            note=SPMD_SYNC,
            kind="not yet",
        ),
    ],
)

DYGRAPH_SHARDING_CONFIG = message(
    "DygraphShardingConfig",
    "hybrid_configs.sharding_configs",
    [
        field(1, "tensor_fusion", bool, False, note=XLA_LAYOUT, kind="not yet"),
        field(
            2,
            "accumulate_steps",
            int,
            1,
            check=positive,
            note="a hint that the user accumulates gradients; merge them with gradient_merge",
            kind="not yet",
        ),
        field(3, "comm_overlap", bool, False, note=XLA_OVERLAP, kind="not yet"),
        field(
            4,
            "split_param",
            bool,
            False,
            doc="With `sharding_degree > 1`: ZeRO stage 2 instead of 1.",
        ),
        field(5, "fuse_optimizer", bool, True, note=XLA_LAYOUT, kind="not yet"),
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
            check=positive,
            kind="XLA flag",
            doc=COMM_BUFFER,
        ),
        field(8, "release_gradients", bool, False, note=XLA_FREES, kind="not yet"),
        field(9, "free_grads_in_comm", bool, False, note=XLA_FREES, kind="not yet"),
        field(10, "enable_fuse_optimizer_states", bool, False, note=XLA_LAYOUT, kind="not yet"),
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
            check=positive,
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
            check=positive,
            doc="The `pp` mesh axis size; above 1 the step is a pipeline.",
        ),
        field(
            4,
            "sharding_degree",
            int,
            1,
            check=positive,
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
            check=positive,
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
        field(9, "enable_optimizer_timer", bool, False, note=PROFILER, kind="not yet"),
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
            check=positive,
            kind="not yet",
            doc="Above 1: the mesh has no expert-parallel axis yet.",
        ),
        field(
            12,
            "moe_sharding_degree",
            int,
            1,
            check=positive,
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
            check=positive,
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
            check=positive,
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
            check=one_of(*PADDLE_ORDER),
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
            check=positive,
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
