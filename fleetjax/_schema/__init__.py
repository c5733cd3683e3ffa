"""The fields of Paddle's strategies: names, types, defaults, proto numbers, value checks, each
knob's kind and its effect in fleetjax (which `fleetjax.knobs` makes docs/knobs.md's tables of).

One module per family of messages:

* `core`: the core strategy, `DISTRIBUTED_STRATEGY` (Paddle's `message DistributedStrategy`,
  3.3.1, plus the 2.x fields it dropped, so that Paddle prototxt files load and ours load in
  Paddle), with its optimizer switches' configs (a switch's flag and configs side by side);
  `seed_default_differences()`.
* `transforms`: the gradient transforms' configs (recompute, AMP, gradient merge, gradient
  scaling, QAT).
* `hybrid`: hybrid parallelism and the pipeline (`hybrid_configs` and its sub-messages, the
  static `sharding_configs`, `pipeline_configs`, `tensor_parallel_configs`).
* `parameter_server`: `a_sync_configs`, the tables (`downpour_table_param`, which
  `sparse_table_configs` sets) and the runtime's messages.
* `build`: `BuildStrategy` and `ExecutionStrategy`.
* `auto`: the sections of the newer `paddle.distributed.Strategy` (`AUTO_STRATEGY`) and of the
  older `paddle.distributed.fleet.auto.Strategy` (`LEGACY_AUTO_STRATEGY`).
* `_shared`: the pipeline schedules' Paddle spellings (`PADDLE_SCHEDULE_MODES`), the value
  checks and the notes the families share. The axes' and remat policies' names are
  `fleetjax.vocabulary`'s.
"""

from fleetjax._schema._shared import PADDLE_SCHEDULE_MODES
from fleetjax._schema.auto import (
    AUTO_AMP,
    AUTO_DATASET,
    AUTO_DP_OPTIMIZATION,
    AUTO_FUSED_LINEAR_PROMOTION,
    AUTO_FUSED_PASSES,
    AUTO_GRADIENT_MERGE,
    AUTO_LEGACY_FUSED_PASSES,
    AUTO_MP_OPTIMIZATION,
    AUTO_PIPELINE,
    AUTO_QAT,
    AUTO_RECOMPUTE,
    AUTO_SHARDING,
    AUTO_SP_OPTIMIZATION,
    AUTO_STRATEGY,
    AUTO_TUNING,
    LEGACY_AUTO_STRATEGY,
)
from fleetjax._schema.build import BUILD_STRATEGY, EXECUTION_STRATEGY
from fleetjax._schema.core import (
    ADAPTIVE_LOCALSGD_CONFIG,
    DGC_CONFIG,
    DISTRIBUTED_STRATEGY,
    LAMB_CONFIG,
    LARS_CONFIG,
    LOCALSGD_CONFIG,
    MODE,
    seed_default_differences,
)
from fleetjax._schema.hybrid import (
    DYGRAPH_SHARDING_CONFIG,
    HYBRID_CONFIG,
    MP_CONFIG,
    NCCL_CONFIG,
    PIPELINE_CONFIG,
    PP_CONFIG,
    SHARDING_CONFIG,
    TENSOR_PARALLEL_CONFIG,
)
from fleetjax._schema.parameter_server import (
    ASYNC_CONFIG,
    CTR_ACCESSOR_PARAMETER,
    FS_CLIENT_PARAMETER,
    GRAPH_SGD_PARAMETER,
    SGD_PARAMETER,
    SPARSE_ADAGRAD_SGD_RULE,
    SPARSE_ADAM_SGD_RULE,
    SPARSE_NAIVE_SGD_RULE,
    TABLE_ACCESSOR_PARAMETER,
    TABLE_ACCESSOR_SAVE_PARAMETER,
    TABLE_PARAMETER,
    TABLE_TYPE,
    TRAINER_DESC_CONFIG,
)
from fleetjax._schema.transforms import (
    AMP_CONFIG,
    GRADIENT_MERGE_CONFIG,
    GRADIENT_SCALE_CONFIG,
    QAT_CONFIG,
    RECOMPUTE_CONFIG,
    REFINED_OPS_PATTERN,
)

__all__ = [
    "ADAPTIVE_LOCALSGD_CONFIG",
    "AMP_CONFIG",
    "ASYNC_CONFIG",
    "AUTO_AMP",
    "AUTO_DATASET",
    "AUTO_DP_OPTIMIZATION",
    "AUTO_FUSED_LINEAR_PROMOTION",
    "AUTO_FUSED_PASSES",
    "AUTO_GRADIENT_MERGE",
    "AUTO_LEGACY_FUSED_PASSES",
    "AUTO_MP_OPTIMIZATION",
    "AUTO_PIPELINE",
    "AUTO_QAT",
    "AUTO_RECOMPUTE",
    "AUTO_SHARDING",
    "AUTO_SP_OPTIMIZATION",
    "AUTO_STRATEGY",
    "AUTO_TUNING",
    "BUILD_STRATEGY",
    "CTR_ACCESSOR_PARAMETER",
    "DGC_CONFIG",
    "DISTRIBUTED_STRATEGY",
    "DYGRAPH_SHARDING_CONFIG",
    "EXECUTION_STRATEGY",
    "FS_CLIENT_PARAMETER",
    "GRADIENT_MERGE_CONFIG",
    "GRADIENT_SCALE_CONFIG",
    "GRAPH_SGD_PARAMETER",
    "HYBRID_CONFIG",
    "LAMB_CONFIG",
    "LARS_CONFIG",
    "LEGACY_AUTO_STRATEGY",
    "LOCALSGD_CONFIG",
    "MODE",
    "MP_CONFIG",
    "NCCL_CONFIG",
    "PADDLE_SCHEDULE_MODES",
    "PIPELINE_CONFIG",
    "PP_CONFIG",
    "QAT_CONFIG",
    "RECOMPUTE_CONFIG",
    "REFINED_OPS_PATTERN",
    "SGD_PARAMETER",
    "SHARDING_CONFIG",
    "SPARSE_ADAGRAD_SGD_RULE",
    "SPARSE_ADAM_SGD_RULE",
    "SPARSE_NAIVE_SGD_RULE",
    "TABLE_ACCESSOR_PARAMETER",
    "TABLE_ACCESSOR_SAVE_PARAMETER",
    "TABLE_PARAMETER",
    "TABLE_TYPE",
    "TENSOR_PARALLEL_CONFIG",
    "TRAINER_DESC_CONFIG",
    "seed_default_differences",
]
