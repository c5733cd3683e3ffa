"""Paddle's `paddle.distributed.fleet` on JAX: `from fleetjax import fleet; fleet.init()`.

The module-level functions are bound to one `Fleet` instance, as in Paddle. `fleet.mesh` and
`fleet.strategy` read that instance's current mesh and strategy.
"""

from typing import Any

from fleetjax.fleet import role_maker
from fleetjax.fleet._fleet import Fleet
from fleetjax.fleet._util import UtilBase
from fleetjax.fleet.role_maker import (
    JaxProcessRoleMaker,
    PaddleCloudRoleMaker,
    Role,
    RoleMakerBase,
    UserDefinedRoleMaker,
)
from fleetjax.strategy import BuildStrategy, DistributedStrategy, ExecutionStrategy, Strategy

fleet = Fleet()

init = fleet.init
distributed_optimizer = fleet.distributed_optimizer
worker_index = fleet.worker_index
worker_num = fleet.worker_num
is_first_worker = fleet.is_first_worker
is_worker = fleet.is_worker
worker_endpoints = fleet.worker_endpoints
node_num = fleet.node_num
server_num = fleet.server_num
server_index = fleet.server_index
server_endpoints = fleet.server_endpoints
is_server = fleet.is_server
barrier_worker = fleet.barrier_worker
save_persistables = fleet.save_persistables
load_persistables = fleet.load_persistables
save_inference_model = fleet.save_inference_model
load_inference_model = fleet.load_inference_model
init_worker = fleet.init_worker
init_server = fleet.init_server
run_server = fleet.run_server
stop_worker = fleet.stop_worker
util = fleet.util


def __getattr__(name: str) -> Any:
    if name in ("mesh", "strategy"):
        return getattr(fleet, name)
    raise AttributeError(f"module 'fleetjax.fleet' has no attribute {name!r}")


__all__ = [
    "BuildStrategy",
    "DistributedStrategy",
    "ExecutionStrategy",
    "Fleet",
    "JaxProcessRoleMaker",
    "PaddleCloudRoleMaker",
    "Role",
    "RoleMakerBase",
    "Strategy",
    "UserDefinedRoleMaker",
    "UtilBase",
    "barrier_worker",
    "distributed_optimizer",
    "fleet",
    "init",
    "init_server",
    "init_worker",
    "is_first_worker",
    "is_server",
    "is_worker",
    "load_inference_model",
    "load_persistables",
    "node_num",
    "role_maker",
    "run_server",
    "save_inference_model",
    "save_persistables",
    "server_endpoints",
    "server_index",
    "server_num",
    "stop_worker",
    "util",
    "worker_endpoints",
    "worker_index",
    "worker_num",
]
