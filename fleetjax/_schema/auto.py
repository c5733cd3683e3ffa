"""Auto parallel's strategies: the sections of the newer `paddle.distributed.Strategy`
(`AUTO_STRATEGY`) and of the older `paddle.distributed.fleet.auto.Strategy`
(`LEGACY_AUTO_STRATEGY`)."""

from __future__ import annotations

from fleetjax._config import Check, field, message, one_of
from fleetjax._schema._shared import (
    AMP,
    COMM_BUFFER,
    EXPLAIN_REMOVED,
    PADDLE_SCHEDULE_MODES,
    PROFILER,
    RECOMPUTE_POLICY,
    SCHEDULE_HINT,
    SPMD_SYNC,
    STATIC,
    XLA_FREES,
    XLA_LAYOUT,
    XLA_OVERLAP,
    merge_mode,
    non_negative,
    positive,
    remat_policy,
)
from fleetjax._schema.transforms import REFINED_OPS_PATTERN, loss_scaling

_ZERO_EVEN = (
    "ZeRO here splits every large tensor evenly over the sharding axis (zero_spec) "
    "instead of assigning whole tensors to ranks"
)
_AUTO_QAT_OFF = "Quantization-aware training is not implemented (`qat.enable` raises)."

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
            check=positive,
            kind="not yet",
            when="silent",
            doc=_AUTO_QAT_OFF,
        ),
        field(
            4,
            "activation_bits",
            int,
            8,
            check=positive,
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
        field(3, "degree", int, 8, check=positive, doc="The `sharding` mesh axis size."),
        field(4, "enable_overlap", bool, False, note=XLA_OVERLAP, kind="not yet"),
        field(5, "param_comm_stream_num", int, 1, check=positive, note=XLA_OVERLAP, kind="not yet"),
        field(6, "grad_comm_stream_num", int, 1, check=positive, note=XLA_OVERLAP, kind="not yet"),
        field(
            7,
            "param_bucket_size_numel",
            int,
            1,
            check=positive,
            note="XLA combines collectives by bytes (comm_buffer_size_MB), not by element count",
            kind="not yet",
        ),
        field(
            8,
            "grad_bucket_size_numel",
            int,
            1,
            check=positive,
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
        field(11, "enable_tuning", bool, False, note=STATIC),
        field(
            12,
            "tuning_range",
            int,
            [],
            note="there is no sharding tuner in fleetjax",
            kind="not yet",
        ),
        field(13, "release_gradients", bool, False, note=XLA_FREES, kind="not yet"),
        field(
            14,
            "comm_buffer_size_MB",
            int,
            256,
            check=positive,
            kind="XLA flag",
            doc=COMM_BUFFER,
        ),
        field(15, "enable_tensor_fusion", bool, False, note=XLA_LAYOUT, kind="not yet"),
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
        field(2, "k_steps", int, 1, check=positive, doc="Micro-steps merged into one update."),
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
            check=merge_mode,
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
        field(3, "pp_degree", int, 1, check=positive, doc="The `pp` mesh axis size."),
        field(
            4, "vpp_degree", int, 1, check=positive, doc="Virtual stages per device under `VPP`."
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
        field(6, "micro_batch_size", int, 1, check=positive, doc="The size of one micro-batch."),
        field(
            7,
            "accumulate_steps",
            int,
            1,
            check=positive,
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
            check=positive,
            note="generation is not in fleetjax",
            kind="not yet",
        ),
        field(9, "enable_send_recv_overlap", bool, False, note=XLA_OVERLAP, kind="not yet"),
        field(10, "job_schedule_profiler_start", int, -1, note=PROFILER, kind="not yet"),
        field(11, "job_schedule_profiler_stop", int, -1, note=PROFILER, kind="not yet"),
        field(12, "program_runtimes", int, [61, 72, 71, 34, 3], note=SCHEDULE_HINT, kind="not yet"),
        field(13, "memory_limit_times", int, -1, note=SCHEDULE_HINT, kind="not yet"),
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
        field(15, "auto_parallel_sync_shared_params", bool, False, note=SPMD_SYNC, kind="not yet"),
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
            doc=AMP,
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
        *loss_scaling(4, default=0.8),
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
        field(3, "no_recompute_segments", int, [], note=RECOMPUTE_POLICY, kind="not yet"),
        field(4, "sr", int, 0, check=non_negative, note=RECOMPUTE_POLICY, kind="not yet"),
        field(
            5,
            "refined_ops_patterns",
            REFINED_OPS_PATTERN,
            [],
            note=RECOMPUTE_POLICY,
            kind="not yet",
        ),
        field(6, "enable_tuning", bool, False, note=STATIC),
        field(
            7,
            "policy",
            str,
            "",
            check=remat_policy,
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
        field(3, "fuse_grad_size_in_MB", int, 32, check=non_negative),
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
    hints={"explain": EXPLAIN_REMOVED},
)

# -- paddle.distributed.fleet.auto.Strategy (the older auto-parallel strategy) ----------------
# Section keys and defaults are Paddle's constants.py; fleetjax trains with the newer Strategy
# (`Strategy._from_legacy_strategy` converts, as Paddle's does).

AUTO_TUNING = message(
    "TuningSection",
    "tuning",
    [
        field(1, "enable", bool, False),
        field(2, "profile_start_step", int, 1, check=non_negative),
        field(3, "profile_end_step", int, 1, check=non_negative),
        field(4, "run_after_tuning", bool, True),
        field(5, "debug", bool, False),
    ],
)

AUTO_DATASET = message(
    "DatasetSection",
    "dataset",
    [field(1, "enable", bool, False), field(2, "num_shards", int, 1, check=positive)],
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
