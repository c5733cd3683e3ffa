"""`paddle.distributed.fleet.utils.sequence_parallel_utils`: Megatron's sequence parallelism
over ``mp`` (see `fleetjax.layers.sequence_parallel`)."""

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
)

__all__ = [
    "AllGatherOp",
    "ColumnSequenceParallelLinear",
    "GatherOp",
    "ReduceScatterOp",
    "RowSequenceParallelLinear",
    "ScatterOp",
    "is_sequence_parallel_parameter",
    "mark_as_sequence_parallel_parameter",
    "register_sequence_parallel_allreduce_hooks",
]
