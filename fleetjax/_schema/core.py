"""The core strategy: `DISTRIBUTED_STRATEGY`, `message DistributedStrategy` of Paddle's
`distributed_strategy.proto` (3.3.1, plus the 2.x fields it dropped), so that Paddle prototxt
files load and ours load in Paddle; and the configs of its optimizer switches (LocalSGD,
Adaptive LocalSGD, DGC, LARS, LAMB), so that a switch's flag and configs are in one file.
Defaults are Paddle's, except where the seed documents say otherwise; those fields carry
`paddle_default` and are listed by `seed_default_differences()`."""

from __future__ import annotations

from fleetjax._config import Enum, MessageSpec, field, greater_than, message, one_of
from fleetjax._schema._shared import (
    AMP,
    EXPLAIN_REMOVED,
    PS,
    STATIC,
    half,
    non_negative,
    positive,
    sparsity,
)
from fleetjax._schema.build import BUILD_STRATEGY, EXECUTION_STRATEGY
from fleetjax._schema.hybrid import (
    HYBRID_CONFIG,
    PIPELINE_CONFIG,
    SHARDING_CONFIG,
    TENSOR_PARALLEL_CONFIG,
)
from fleetjax._schema.parameter_server import (
    ASYNC_CONFIG,
    FS_CLIENT_PARAMETER,
    TABLE_PARAMETER,
    TRAINER_DESC_CONFIG,
)
from fleetjax._schema.transforms import (
    AMP_CONFIG,
    GRADIENT_MERGE_CONFIG,
    GRADIENT_SCALE_CONFIG,
    QAT_CONFIG,
    RECOMPUTE_CONFIG,
)

LOCALSGD_CONFIG = message(
    "LocalSGDConfig",
    "localsgd_configs",
    [
        field(1, "k_steps", int, 1, check=positive, doc="Steps between parameter averages."),
        field(
            2,
            "begin_step",
            int,
            1,
            check=non_negative,
            doc="Every step is averaged before this step.",
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
            check=non_negative,
            doc="Dense momentum before this step.",
        ),
        field(
            2,
            "rampup_step",
            int,
            1,
            check=positive,
            doc="Steps over which the sparsity list is walked.",
        ),
        field(
            3,
            "sparsity",
            float,
            [0.999],
            check=sparsity,
            paddle_default=[],
            doc="The sparsity schedule.",
        ),
    ],
)

LARS_CONFIG = message(
    "LarsConfig",
    "lars_configs",
    [
        field(1, "lars_coeff", float, 0.001, check=non_negative, doc="LARS trust coefficient."),
        field(2, "lars_weight_decay", float, 0.0005, check=non_negative, doc="LARS weight decay."),
        field(3, "epsilon", float, 0.0, check=non_negative, doc="LARS denominator epsilon."),
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
        field(1, "lamb_weight_decay", float, 0.01, check=non_negative, doc="LAMB weight decay."),
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
        field(1, "init_k_steps", int, 1, check=positive, doc="The first averaging interval."),
        field(
            2,
            "begin_step",
            int,
            1,
            check=non_negative,
            doc="Every step is averaged before this step.",
        ),
    ],
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
            doc=AMP,
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
        field(4, "localsgd", bool, False),
        field(5, "dgc", bool, False),
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
        field(7, "lars", bool, False),
        field(8, "lamb", bool, False),
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
                "and model state; not with the per-replica optimizer switches (an error: "
                "[the switch table](#optimizer-switches))."
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
            check=positive,
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
            doc="`fleetjax.transforms.grad_allreduce.hierarchical_mean`",
        ),
        field(
            16,
            "hierarchical_allreduce_inter_nranks",
            int,
            1,
            check=positive,
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
            check=non_negative,
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
            check=non_negative,
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
            check=non_negative,
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
        field(24, "adaptive_localsgd", bool, False),
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
        field(30, "without_graph_optimization", bool, True, note=STATIC),
        field(
            31,
            "fuse_grad_size_in_num",
            int,
            8,
            check=positive,
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
        field(36, "adam_d2sum", bool, False, note=PS),
        field(
            37,
            "auto_search",
            bool,
            False,
            kind="not yet",
            doc="Raises, pointing to `fleetjax.auto.search` (the search is a call).",
        ),
        field(38, "heter_ccl_mode", bool, False, note=PS),
        field(39, "is_fl_ps_mode", bool, False, note=PS),
        field(40, "with_coordinator", bool, False, note=PS),
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
            check=half,
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
    hints={"explain": EXPLAIN_REMOVED},
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
