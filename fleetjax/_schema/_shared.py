"""What the schema's families share: the pipeline schedules' Paddle spellings, the value checks
and the notes of knobs that several families have (the axes' and remat policies' names are
`fleetjax.vocabulary`'s)."""

from __future__ import annotations

from fleetjax._config import Check, at_least, one_of
from fleetjax.vocabulary import REMAT_POLICIES

# Paddle spellings of pipeline schedules (static fleet, auto-parallel and dygraph registries).
PADDLE_SCHEDULE_MODES = ("1F1B", "F-then-B", "FThenB", "VPP", "Eager1F1B", "ZBH1", "ZBVPP")

remat_policy = one_of("", *REMAT_POLICIES)
half = one_of("float16", "bfloat16")
merge_mode = one_of("across_calls", "in_step")

PS = (
    "a setting of Paddle's parameter-server runtime (its server processes, trainer dumps, "
    "file system client, heterogeneous workers); fleetjax's parameter-server step is one SPMD "
    "program and reads only a_sync, a_sync_configs.k_steps and the sparse table configs"
)
STATIC = "a Paddle static-graph executor setting; XLA compiles and schedules the whole step"
SPMD_SYNC = (
    "SPMD keeps a replicated array identical on every device; there is nothing to "
    "broadcast or synchronise"
)
XLA_OVERLAP = "XLA's scheduler decides how communication overlaps computation"
XLA_LAYOUT = "XLA fuses kernels and lays out buffers itself"
XLA_FREES = "XLA frees each buffer as soon as the step no longer needs it"
PROFILER = "a Paddle timer; profile with jax.profiler"
SCHEDULE_HINT = "a hint for Paddle's pipeline scheduler; fleetjax's schedules are fixed tables"
RECOMPUTE_POLICY = (
    "Paddle's recompute selection; choose what to keep with recompute 'checkpoints' or 'policy'"
)

# Effects several knobs share (docs/knobs.md).
COMM_BUFFER = (
    "`--xla_gpu_all_gather_combine_threshold_bytes` and "
    "`--xla_gpu_reduce_scatter_combine_threshold_bytes` = this many MiB: ZeRO's communication "
    "buckets."
)
AMP = "Mixed precision: per-operation autocast and loss scaling (`fleetjax.transforms.amp`)."

positive = at_least(1)
non_negative = at_least(0)
sparsity = Check(lambda v: 0 <= v < 1, "in [0, 1)")

# Names fleetjax had and removed: their errors name the replacement.
EXPLAIN_REMOVED = (
    "strategy.explain() was removed (fleetjax's redesign, issue 17); "
    "print(fleetjax.applied_strategy(strategy)) shows what a strategy does, and "
    "fleet.applied_strategy() what the fleet's does on its mesh"
)
