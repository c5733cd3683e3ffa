"""Megatron tensor-parallel layers (Paddle's `fleet.meta_parallel`) and sparse embedding tables
(Paddle's parameter-server `sparse_embedding`) as flax nnx modules, and the logical-axis rules
that place their parameters and activations on the mesh.

    specs = partition_specs(nnx.state(model), mesh=mesh)      # logical names -> mesh axes
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    state = jax.device_put(nnx.state(model), shardings)       # each device holds its slices
    with jax.set_mesh(mesh):                                   # Auto or Explicit axes
        loss = jax.jit(loss_fn, in_shardings=(shardings, batch_sharding))(state, batch)

`MoELayer` is Paddle's mixture-of-experts layer (``paddle.incubate.distributed.models.moe``)
with its gates and Megatron-Core's, MaxText's and DeepSeek-V3's routing, dispatching tokens over
the expert axis ``ep`` (`fleetjax.layers.moe`).

`attention` splits the sequence over Paddle's ``sep`` (all-to-all) and ``cp`` (ring attention)
axes; the sequence-parallel layers (`ColumnSequenceParallelLinear`, ...) are Megatron's sequence
parallelism over ``mp``.

Parameters name their dimensions with logical axes (``"vocab"``, ``"embed"``, ``"mlp"``); the
rules (`DEFAULT_RULES`, overridable) map the split ones to ``mp``, a sparse table's rows
(``"table_rows"``) to every mesh axis, and activations' batch to ``dp`` x ``sharding``.
"""

from fleetjax.layers._params import logical_param
from fleetjax.layers.attention import attention, to_load_balanced, to_natural
from fleetjax.layers.batch_norm import BatchNorm
from fleetjax.layers.cross_entropy import ParallelCrossEntropy, parallel_cross_entropy
from fleetjax.layers.embedding import VocabParallelEmbedding
from fleetjax.layers.linear import ColumnParallelLinear, RowParallelLinear
from fleetjax.layers.moe import (
    BaseGate,
    ExpertBias,
    ExpertMLP,
    GShardGate,
    MoEAux,
    MoELayer,
    MoEStats,
    NaiveGate,
    Routing,
    SwitchGate,
    TopKRouter,
    all_to_all_bytes,
    moe_aux,
)
from fleetjax.layers.partitioning import (
    DEFAULT_RULES,
    LogicalNames,
    LogicalRules,
    constrain,
    current_rules,
    logical_to_spec,
    partition_specs,
)
from fleetjax.layers.sequence_parallel import (
    AllGatherOp,
    ColumnSequenceParallelLinear,
    GatherOp,
    ReduceScatterOp,
    RowSequenceParallelLinear,
    ScatterOp,
    is_sequence_parallel_parameter,
    mark_as_sequence_parallel_parameter,
    register_sequence_parallel_allreduce_hooks,
    sequence_parallel_options,
)
from fleetjax.layers.sparse_embedding import (
    SparseEmbedding,
    SparseTable,
    is_table,
    lookup,
    sparse_table,
)

__all__ = [
    "AllGatherOp",
    "BaseGate",
    "BatchNorm",
    "ColumnParallelLinear",
    "ColumnSequenceParallelLinear",
    "ExpertBias",
    "ExpertMLP",
    "GShardGate",
    "GatherOp",
    "MoEAux",
    "MoELayer",
    "MoEStats",
    "NaiveGate",
    "ReduceScatterOp",
    "RowSequenceParallelLinear",
    "Routing",
    "ScatterOp",
    "ParallelCrossEntropy",
    "RowParallelLinear",
    "SparseEmbedding",
    "SparseTable",
    "SwitchGate",
    "TopKRouter",
    "VocabParallelEmbedding",
    "parallel_cross_entropy",
    "all_to_all_bytes",
    "attention",
    "is_sequence_parallel_parameter",
    "mark_as_sequence_parallel_parameter",
    "moe_aux",
    "register_sequence_parallel_allreduce_hooks",
    "sequence_parallel_options",
    "to_load_balanced",
    "to_natural",
    "DEFAULT_RULES",
    "LogicalNames",
    "LogicalRules",
    "constrain",
    "current_rules",
    "is_table",
    "logical_param",
    "logical_to_spec",
    "lookup",
    "partition_specs",
    "sparse_table",
]
