"""The words the strategy and the code share, each defined here once: the mesh axes (their
names, Paddle's order, which carry the batch, which ZeRO splits over, where experts live, which
split the sequence) and the plain remat policies. Plain data at the bottom layer, so that the
schema can check a strategy against them and the mesh, the placement, the layers' partitioning
rules and the transforms can use them without reading the schema."""

# Every axis a fleetjax mesh may have, in the order messages and tables list them.
AXES = ("dp", "sharding", "ep", "pp", "sep", "cp", "mp")

# Paddle's hybrid topology order (`hybrid_configs["order"]`'s default), slowest-varying first:
# `mp` varies fastest, so tensor-parallel neighbours share a host.
PADDLE_ORDER = ("dp", "pp", "sharding", "sep", "cp", "mp")

# The names Paddle's order adds for expert parallelism: with `ep_degree > 1` Paddle builds its
# expert topology from an order that names all eight (`moe_sharding` is the experts' sharding
# group, the mesh's `sharding` axis; Paddle's `sharding` group is then `sharding` x `ep`).
PADDLE_EXPERT_ORDER = ("ep", "moe_sharding")

# fleetjax's default mesh order: Paddle's, with `ep` right after `sharding`, the group it is
# carved out of (as Paddle's dense topology puts `dense_sharding` after `moe_sharding`), so the
# experts' ranks (`ep` x `mp`) are neighbours.
MESH_ORDER = ("dp", "pp", "sharding", "ep", "sep", "cp", "mp")

# The axes every mesh has; the others only where their degree is above 1.
REQUIRED_AXES = ("dp", "sharding", "pp", "mp")

# The batch is split over these. `ep` carries data outside the MoE layers (Paddle's dense
# topology has it as part of the sharding group; MaxText's `expert` axis is a batch axis too).
DATA_AXES = ("dp", "sharding", "ep")

# ZeRO splits a tensor's state over these (Paddle's sharding group, `moe_sharding` x
# `dense_sharding`): an expert's, which `ep` splits already, over `sharding` alone (Paddle's
# `moe_sharding` group).
ZERO_AXES = ("sharding", "ep")

# A MoE layer's experts split over these (Paddle's expert group, `dense_sharding` x `model`;
# Megatron's parallel folding of experts over the data and tensor ranks).
EXPERT_AXES = ("ep", "mp")

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
