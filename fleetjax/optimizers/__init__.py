"""Optimizers: Paddle's optimizers as optax transformations (also as Paddle's classes, with its
gradient clips and `L2Decay`), the large-batch and communication-efficient ones Paddle's
optimizer switches rebuild them as (`rebuild`, from the table `SWITCHES`), and Paddle's sparse
table rules (`sparse_rules`)."""

from fleetjax.optimizers import sparse_rules
from fleetjax.optimizers._basic import PaddleOptimizer, adam, adamw, clip_by_norm, momentum, sgd
from fleetjax.optimizers._classes import (
    SGD,
    Adam,
    AdamW,
    ClipGradByGlobalNorm,
    ClipGradByNorm,
    ClipGradByValue,
    L2Decay,
    Momentum,
)
from fleetjax.optimizers._dgc import (
    DGCState,
    dgc,
    dgc_reducer,
    is_eligible,
    sparse_allreduce,
    sparsity_at,
    top_k_count,
)
from fleetjax.optimizers._geo import GeoState, geo_merge, geo_sgd
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
from fleetjax.optimizers._switches import (
    GEO,
    STEP_SWITCHES,
    SWITCHES,
    Switch,
    check_combination,
    rebuild,
)

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
    # ... as Paddle's classes, with Paddle's arguments
    "SGD",
    "Momentum",
    "Adam",
    "AdamW",
    "ClipGradByNorm",
    "ClipGradByGlobalNorm",
    "ClipGradByValue",
    "L2Decay",
    # per-replica wrappers, run inside shard_map
    "localsgd",
    "adaptive_localsgd",
    "geo_sgd",
    "geo_merge",
    "GeoState",
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
    # Paddle's sparse table rules, row-wise
    "sparse_rules",
    # Paddle's optimizer switches: the table, their rebuild, and which switches combine
    "SWITCHES",
    "STEP_SWITCHES",
    "GEO",
    "Switch",
    "check_combination",
    "rebuild",
]
