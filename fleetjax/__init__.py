"""fleetjax: PaddlePaddle Fleet's distributed training strategies on JAX/XLA.

from fleetjax import fleet
import fleetjax

strategy = fleetjax.DistributedStrategy()
fleet.init(is_collective=True, strategy=strategy)
optimizer = fleet.distributed_optimizer(optax.adam(1e-3))
step = fleetjax.make_train_step(loss_fn, optimizer)
state = step.init(params)
state, metrics = step(state, batch)
"""

from fleetjax import (
    auto,
    checkpoint,
    export,
    fleet,
    layers,
    mesh,
    optimizers,
    targets,
    transforms,
    xla_flags,
)
from fleetjax._applied import AppliedStrategy, applied_strategy
from fleetjax._config import UnknownFieldError
from fleetjax._explain import Explanation, explain
from fleetjax._prototxt import PrototxtError
from fleetjax._support import StrategyWarning
from fleetjax.checkpoint import CheckpointManager
from fleetjax.mesh import build_mesh
from fleetjax.optimizers import DistributedOptimizer, distributed_optimizer
from fleetjax.step import TrainState, TrainStep, make_train_step
from fleetjax.strategy import (
    BuildStrategy,
    DistributedStrategy,
    ExecutionStrategy,
    Strategy,
    seed_default_differences,
)
from fleetjax.transforms._schedules import PipelineSchedule, pipeline_schedule
from fleetjax.transforms.amp import fp16_guard
from fleetjax.transforms.pipeline import PipelineLayer, PipelineParams
from fleetjax.transforms.recompute import checkpoint_name, recompute

__version__ = "0.1.0"

__all__ = [
    "AppliedStrategy",
    "BuildStrategy",
    "CheckpointManager",
    "DistributedOptimizer",
    "DistributedStrategy",
    "ExecutionStrategy",
    "Explanation",
    "PipelineLayer",
    "PipelineParams",
    "PipelineSchedule",
    "PrototxtError",
    "Strategy",
    "StrategyWarning",
    "TrainState",
    "TrainStep",
    "UnknownFieldError",
    "applied_strategy",
    "auto",
    "build_mesh",
    "checkpoint",
    "checkpoint_name",
    "distributed_optimizer",
    "explain",
    "export",
    "fleet",
    "fp16_guard",
    "layers",
    "make_train_step",
    "mesh",
    "optimizers",
    "pipeline_schedule",
    "recompute",
    "seed_default_differences",
    "targets",
    "transforms",
    "xla_flags",
]
