"""Paddle 3's auto-parallel values on JAX: `ProcessMesh`, the placements `Shard`, `Replicate`
and `Partial`, distributed tensors as `jax.Array`s (`shard_tensor`, `reshard`, `local_map`,
`dtensor_*`), checkpoints that reshard (`save_state_dict`, `load_state_dict`), and a
`ProcessMesh` seen through a train step's mesh (`MeshView`).

`fleetjax.distributed` is the Paddle-named surface (`paddle.distributed`) over these.
"""

from fleetjax.auto_parallel._local_map import local_map
from fleetjax.auto_parallel._placements import (
    Partial,
    Placement,
    ReduceType,
    Replicate,
    Shard,
    partition_spec,
)
from fleetjax.auto_parallel._process_mesh import ProcessMesh, get_mesh, set_mesh
from fleetjax.auto_parallel._reshard import COLLECTIVE, Layout, Step, plan
from fleetjax.auto_parallel._state_dict import load_state_dict, save_state_dict
from fleetjax.auto_parallel._tensor import (
    dtensor_from_fn,
    dtensor_from_local,
    dtensor_to_local,
    install_tensor_attributes,
    placements_of,
    process_mesh_of,
    reshard,
    reshard_scope,
    shard_tensor,
    unshard_dtensor,
)
from fleetjax.auto_parallel._views import MeshView, register_view, view_of

__all__ = [
    "ProcessMesh",
    "Placement",
    "Shard",
    "Replicate",
    "Partial",
    "ReduceType",
    "partition_spec",
    "shard_tensor",
    "reshard",
    "unshard_dtensor",
    "dtensor_from_fn",
    "dtensor_from_local",
    "dtensor_to_local",
    "placements_of",
    "process_mesh_of",
    "install_tensor_attributes",
    "local_map",
    "set_mesh",
    "get_mesh",
    "save_state_dict",
    "load_state_dict",
    "MeshView",
    "register_view",
    "reshard_scope",
    "view_of",
    "COLLECTIVE",
    "Layout",
    "Step",
    "plan",
]
