"""Optimizers: Paddle's optimizers as optax transformations, the large-batch and
communication-efficient ones the strategy switches to, and the binding of one to a strategy."""

from fleetjax.optimizers._basic import PaddleOptimizer, adam, adamw, clip_by_norm, momentum, sgd
from fleetjax.optimizers._dgc import (
    DGCState,
    dgc,
    dgc_reducer,
    is_eligible,
    sparse_allreduce,
    sparsity_at,
    top_k_count,
)
from fleetjax.optimizers._distributed import DistributedOptimizer, distributed_optimizer
from fleetjax.optimizers._lamb import lamb, scale_by_lamb_trust_ratio
from fleetjax.optimizers._lars import lars, scale_by_lars
from fleetjax.optimizers._localsgd import (
    AdaptiveLocalSGDState,
    LocalSGDState,
    adaptive_localsgd,
    localsgd,
    next_k_steps,
)
from fleetjax.optimizers._lr import get_lr, set_lr
from fleetjax.optimizers._names import param_names
from fleetjax.optimizers._strategy import optimizer_for_strategy

__all__ = [
    # Paddle's optimizers
    "PaddleOptimizer",
    "sgd",
    "momentum",
    "adam",
    "adamw",
    "lars",
    "lamb",
    "dgc",
    "get_lr",
    "set_lr",
    # per-replica wrappers, run inside shard_map
    "localsgd",
    "adaptive_localsgd",
    "LocalSGDState",
    "AdaptiveLocalSGDState",
    # building blocks
    "clip_by_norm",
    "param_names",
    "scale_by_lars",
    "scale_by_lamb_trust_ratio",
    "dgc_reducer",
    "DGCState",
    "is_eligible",
    "sparse_allreduce",
    "sparsity_at",
    "top_k_count",
    "next_k_steps",
    # strategies
    "optimizer_for_strategy",
    "DistributedOptimizer",
    "distributed_optimizer",
]
