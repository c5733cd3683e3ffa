"""The words the strategy and the code share, each defined here once: the mesh axes (their
names, Paddle's order, which carry the batch, which split the sequence) and the plain remat
policies. Plain data at the bottom layer, so that the schema can check a strategy against them
and the mesh, the placement and the transforms can use them without reading the schema."""

# Every axis a fleetjax mesh may have, in the order messages and tables list them.
AXES = ("dp", "sharding", "pp", "sep", "cp", "mp")

# Paddle's hybrid topology order (`hybrid_configs["order"]`'s default), slowest-varying first:
# `mp` varies fastest, so tensor-parallel neighbours share a host.
PADDLE_ORDER = ("dp", "pp", "sharding", "sep", "cp", "mp")

# The axes every mesh has; the others (the sequence axes) only where their degree is above 1.
REQUIRED_AXES = ("dp", "sharding", "pp", "mp")

# The batch is split over these; ZeRO shards the state over `sharding`.
DATA_AXES = ("dp", "sharding")

# A sequence's split, major first: `cp` (context parallelism, ring attention) outside `sep`
# (segment parallelism, heads exchanged around attention); see fleetjax.layers.attention.
SEQUENCE_AXES = ("cp", "sep")

# The plain policies of `jax.checkpoint_policies`, for recompute's `policy` extension key.
REMAT_POLICIES = (
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
)
