"""Paddle's static-graph `BuildStrategy` (also `DistributedStrategy.build_strategy`) and
`ExecutionStrategy` (`DistributedStrategy.execution_strategy`)."""

from __future__ import annotations

from fleetjax._config import field, message, one_of
from fleetjax._schema._shared import PS, non_negative, positive

_XLA_SCHEDULES = "XLA compiles the whole step into one program and schedules it itself"
_XLA_BUFFERS = (
    "XLA's buffer assignment already reuses buffers in place (and the train step "
    "donates its state); there is nothing to switch"
)
_ATTENTION = (
    "XLA does not rewrite attention into a fused kernel; call "
    "jax.nn.dot_product_attention(..., implementation='cudnn') in the model"
)
_XLA_FUSES = (
    "XLA fuses these operations by itself (elementwise chains; bias and activation epilogues "
    "where the backend supports them). False cannot be honoured and warns once."
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
        check=positive,
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
        check=non_negative,
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
    field(1006, "num_trainers", int, 1, paddle=False, check=positive, note=_FROM_ROLE),
    field(1007, "trainer_id", int, 0, paddle=False, check=non_negative, note=_FROM_ROLE),
    field(1008, "trainers_endpoints", str, [], paddle=False, note=_FROM_ROLE),
    field(
        1009,
        "bkcl_comm_num",
        int,
        1,
        paddle=False,
        check=positive,
        note="the number of BKCL communicators on Kunlun XPUs; JAX has no Kunlun backend",
    ),
    field(1010, "async_mode", bool, False, paddle=False, note=PS),
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
            check=positive,
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
            check=positive,
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
            check=positive,
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
