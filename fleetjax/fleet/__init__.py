"""Paddle's `paddle.distributed.fleet` on JAX: `from fleetjax import fleet; fleet.init()`.

The module-level functions are bound to one `Fleet` instance, as in Paddle. `fleet.mesh`,
`fleet.strategy` and `fleet.trainer` read that instance's current mesh, strategy and `Trainer`.
"""

from typing import Any

from fleetjax.fleet import auto, base, role_maker, utils
from fleetjax.fleet._dygraph import DeferredLoss, DistributedModel, ModelOutput
from fleetjax.fleet._fleet import Fleet, FleetOptimizer
from fleetjax.fleet._loop import DygraphLoop
from fleetjax.fleet._trainer import Trainer
from fleetjax.fleet.base.util_factory import UtilBase
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
distributed_model = fleet.distributed_model
applied_strategy = fleet.applied_strategy
minimize = fleet.minimize
backward = fleet.backward
step = fleet.step
clear_grad = fleet.clear_grad
state_dict = fleet.state_dict
set_state_dict = fleet.set_state_dict
get_lr = fleet.get_lr
set_lr = fleet.set_lr
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
load_model = fleet.load_model
init_worker = fleet.init_worker
init_server = fleet.init_server
run_server = fleet.run_server
stop_worker = fleet.stop_worker
util = fleet.util


def __getattr__(name: str) -> Any:
    if name in ("mesh", "strategy", "trainer"):
        return getattr(fleet, name)
    raise AttributeError(f"module 'fleetjax.fleet' has no attribute {name!r}")


__all__ = [
    "BuildStrategy",
    "DeferredLoss",
    "DistributedModel",
    "DistributedStrategy",
    "DygraphLoop",
    "ExecutionStrategy",
    "Fleet",
    "FleetOptimizer",
    "JaxProcessRoleMaker",
    "ModelOutput",
    "PaddleCloudRoleMaker",
    "Role",
    "RoleMakerBase",
    "Strategy",
    "Trainer",
    "UserDefinedRoleMaker",
    "UtilBase",
    "applied_strategy",
    "auto",
    "backward",
    "base",
    "barrier_worker",
    "clear_grad",
    "distributed_model",
    "distributed_optimizer",
    "fleet",
    "get_lr",
    "init",
    "init_server",
    "init_worker",
    "is_first_worker",
    "is_server",
    "is_worker",
    "load_inference_model",
    "load_persistables",
    "minimize",
    "node_num",
    "role_maker",
    "run_server",
    "save_inference_model",
    "save_persistables",
    "server_endpoints",
    "server_index",
    "server_num",
    "set_lr",
    "set_state_dict",
    "state_dict",
    "step",
    "stop_worker",
    "util",
    "utils",
    "worker_endpoints",
    "worker_index",
    "worker_num",
]
