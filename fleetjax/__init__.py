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
    auto_parallel,
    checkpoint,
    distributed,
    export,
    fleet,
    hlo,
    layers,
    mesh,
    nn,
    optimizers,
    placement,
    plan,
    targets,
    transforms,
    xla_flags,
)
from fleetjax._applied import AppliedStrategy, Setting, applied_strategy
from fleetjax._config import UnknownFieldError
from fleetjax._explain import Explanation, explain
from fleetjax._prototxt import PrototxtError
from fleetjax._warnings import StrategyWarning
from fleetjax.checkpoint import CheckpointManager
from fleetjax.distributed_model import distributed_model
from fleetjax.distributed_optimizer import DistributedOptimizer, distributed_optimizer
from fleetjax.mesh import build_mesh
from fleetjax.placement import Placement
from fleetjax.plan import Plan, read_plan
from fleetjax.step import StepSpec, TrainStep, make_train_step
from fleetjax.strategy import (
    BuildStrategy,
    DistributedStrategy,
    ExecutionStrategy,
    Strategy,
    seed_default_differences,
)
from fleetjax.train_state import TrainState
from fleetjax.transforms.amp import fp16_guard
from fleetjax.transforms.pipeline import (
    LayerDesc,
    PipelineLayer,
    PipelineParams,
    PipelineSchedule,
    SharedLayerDesc,
    pipeline_schedule,
)
from fleetjax.transforms.recompute import checkpoint_name, recompute

# Before JAX starts its backends: with jax's CUDA plugin installed (the `aot` extra) and no
# NVIDIA driver, JAX starts on the CPU and the plugin only compiles, without logging its
# failed check of the CUDA libraries (docs/gpu_targets.md).
targets.compile_only_without_a_driver()

__version__ = "0.1.0"

__all__ = [
    "AppliedStrategy",
    "BuildStrategy",
    "CheckpointManager",
    "DistributedOptimizer",
    "DistributedStrategy",
    "ExecutionStrategy",
    "Explanation",
    "LayerDesc",
    "PipelineLayer",
    "PipelineParams",
    "PipelineSchedule",
    "Placement",
    "Plan",
    "PrototxtError",
    "Setting",
    "SharedLayerDesc",
    "Strategy",
    "StrategyWarning",
    "TrainState",
    "StepSpec",
    "TrainStep",
    "UnknownFieldError",
    "applied_strategy",
    "auto",
    "auto_parallel",
    "build_mesh",
    "checkpoint",
    "checkpoint_name",
    "distributed",
    "distributed_model",
    "distributed_optimizer",
    "explain",
    "export",
    "fleet",
    "fp16_guard",
    "hlo",
    "layers",
    "make_train_step",
    "mesh",
    "nn",
    "optimizers",
    "pipeline_schedule",
    "placement",
    "plan",
    "read_plan",
    "recompute",
    "seed_default_differences",
    "targets",
    "transforms",
    "xla_flags",
]
