"""Paddle 3's `paddle.distributed` auto-parallel API on JAX: `import fleetjax.distributed as
dist`, then Paddle's names (`dist.ProcessMesh`, `dist.shard_tensor`, `dist.Shard`, ...).

A distributed tensor is a `jax.Array` placed by a `NamedSharding`; importing this module gives
`jax.Array` Paddle's read-only `placements` and `process_mesh` (`placements_of`,
`process_mesh_of` are the same as functions). The training front ends (`shard_optimizer`,
`shard_dataloader`, `to_static`, `parallelize`, ...) translate the user's request into the
train step's inputs: each mesh dimension's role, each parameter's `PartitionSpec`, the
`Strategy`; docs/auto_parallel.md maps each name.
"""

from fleetjax.auto_parallel import (
    Partial,
    Placement,
    ProcessMesh,
    ReduceType,
    Replicate,
    Shard,
    dtensor_from_fn,
    dtensor_from_local,
    dtensor_to_local,
    get_mesh,
    install_tensor_attributes,
    load_state_dict,
    local_map,
    placements_of,
    process_mesh_of,
    reshard,
    save_state_dict,
    set_mesh,
    shard_tensor,
    unshard_dtensor,
)
from fleetjax.distributed._dist_model import DistModel, to_static
from fleetjax.distributed._parallelize import parallelize
from fleetjax.distributed._pipeline import SplitPoint
from fleetjax.distributed._plans import (
    ColWiseParallel,
    PrepareLayerInput,
    PrepareLayerOutput,
    RowWiseParallel,
    SequenceParallelBegin,
    SequenceParallelDisable,
    SequenceParallelEnable,
    SequenceParallelEnd,
)
from fleetjax.distributed._shard import (
    ShardingStage1,
    ShardingStage2,
    ShardingStage3,
    shard_dataloader,
    shard_layer,
    shard_optimizer,
    shard_scaler,
)
from fleetjax.strategy import Strategy

install_tensor_attributes()

__all__ = [
    "ProcessMesh",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "ReduceType",
    "shard_tensor",
    "reshard",
    "unshard_dtensor",
    "dtensor_from_fn",
    "dtensor_from_local",
    "dtensor_to_local",
    "local_map",
    "set_mesh",
    "get_mesh",
    "save_state_dict",
    "load_state_dict",
    "Strategy",
    "shard_layer",
    "shard_optimizer",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "shard_scaler",
    "shard_dataloader",
    "to_static",
    "DistModel",
    "parallelize",
    "ColWiseParallel",
    "RowWiseParallel",
    "SequenceParallelBegin",
    "SequenceParallelEnd",
    "SequenceParallelEnable",
    "SequenceParallelDisable",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "SplitPoint",
    # fleetjax's own: Paddle's `t.placements` / `t.process_mesh` as functions
    "placements_of",
    "process_mesh_of",
]
