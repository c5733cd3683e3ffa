"""What a gate decides for each token (`Routing`), the gates' common base (Paddle's `BaseGate`)
and the pieces every gate shares: the top-k, ranking assignments within their expert, and
dropping those beyond an expert's capacity.

A gate sees the layer's tokens as one global array ``[T, d_model]`` (however they are split over
the mesh) and returns, for each token, the ``k`` experts it goes to (``-1`` where the gate
dropped it) and their combine weights. Everything a gate computes over the batch (its losses,
its capacity, the expert load) is therefore over the global batch: the same under every layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

from fleetjax.layers._params import check_sizes
from fleetjax.layers.partitioning import free_axes

__all__ = [
    "BaseGate",
    "GateLoss",
    "Routing",
    "drop_beyond_capacity",
    "on_auto_axes",
    "rank_within_expert",
    "routing_key",
]


class Routing(NamedTuple):
    """A gate's decision for ``T`` tokens and ``k`` experts a token.

    Attributes:
      experts: ``[T, k]`` int32 expert ids; ``-1`` where the gate dropped the assignment (its
        capacity, GShard's random routing): it adds nothing to the token's output.
      weights: ``[T, k]`` the combine weights: the layer's output for a token is
        ``sum_j weights[t, j] * expert_{experts[t, j]}(x_t)``.
      losses: the gate's auxiliary losses by name, each already weighted by its coefficient
        (what the training loss adds).
    """

    experts: jax.Array
    weights: jax.Array
    losses: dict[str, jax.Array]


class GateLoss(nnx.Variable):
    """The auxiliary loss of a gate's last call (Paddle's ``BaseGate.loss``), read with
    `BaseGate.get_loss`; not trained."""


class BaseGate(nnx.Module):
    """Paddle's ``BaseGate(num_expert, world_size)``: a gate over ``tot_expert = num_expert x
    world_size`` experts.

    Subclasses implement `route`. ``__call__`` is Paddle's ``forward``: ``(top-k values, top-k
    expert ids)``. ``deterministic`` is Paddle's ``not self.training`` (``model.eval()`` sets
    it, as for flax's ``Dropout``).
    """

    def __init__(self, num_expert: int, world_size: int, top_k: int) -> None:
        check_sizes(type(self).__name__, num_expert=num_expert, world_size=world_size, topk=top_k)
        self.num_expert, self.world_size = num_expert, world_size
        self.tot_expert = num_expert * world_size
        if top_k > self.tot_expert:
            raise ValueError(
                f"{type(self).__name__}: topk={top_k} is more than the {self.tot_expert} experts "
                "(num_expert x world_size) a token can go to"
            )
        self.top_k = top_k
        self.deterministic = False
        self.loss = GateLoss(jnp.zeros((), jnp.float32))

    def route(self, x: jax.Array, *, sequences: int = 1, rngs: RngsLike = None) -> Routing:
        """The routing of the tokens `x` ``[T, d_model]``, which are `sequences` sequences of
        ``T / sequences`` tokens each (for sequence-wise losses); `rngs` for a random gate."""
        raise NotImplementedError

    def __call__(self, x: jax.Array, *, rngs: RngsLike = None) -> tuple[jax.Array, jax.Array]:
        """Paddle's ``forward``: the top-k combine weights and expert ids of the tokens `x`."""
        routing = self.route(x, rngs=rngs)
        return routing.weights, routing.experts

    def set_loss(self, loss: jax.Array) -> None:
        """Paddle's ``set_loss``: keep `loss` as the gate's loss."""
        self.loss[...] = jnp.asarray(loss, jnp.float32)

    def get_loss(self, clear: bool = True) -> jax.Array:
        """Paddle's ``get_loss``: the loss of the gate's last call (0 where it has none; Paddle
        returns None), reset to 0 with `clear`."""
        loss = self.loss[...]
        if clear:
            self.loss[...] = jnp.zeros((), jnp.float32)
        return loss

    def _record(self, losses: dict[str, jax.Array]) -> dict[str, jax.Array]:
        self.set_loss(sum(losses.values(), jnp.zeros((), jnp.float32)))
        return losses


RngsLike = nnx.Rngs | nnx.RngStream | jax.Array | None


def stream(rngs: nnx.Rngs | nnx.RngStream | None, layer: str) -> nnx.RngStream | None:
    """The gate's own ``"routing"`` stream (or the default one) from its constructor's `rngs`, as
    flax's ``Dropout`` keeps its stream; None where `rngs` has neither."""
    if rngs is None:
        return nnx.data(None)
    if isinstance(rngs, nnx.Rngs):
        names = [name for name in ("routing", "default") if name in rngs]
        return rngs[names[0]].fork() if names else nnx.data(None)
    if isinstance(rngs, nnx.RngStream):
        return rngs.fork()
    raise TypeError(f"{layer}: rngs must be an nnx.Rngs, an nnx.RngStream or None, got {rngs!r}")


def draw_key(layer: str, call: RngsLike, own: nnx.RngStream | None, why: str) -> jax.Array:
    """A PRNG key for a random gate: from the call's `call` (a key, stream or Rngs), else the
    gate's own stream; a ValueError naming `why` the gate needs one without either."""
    if isinstance(call, nnx.Rngs):
        return call["routing"]() if "routing" in call else call.default()
    if isinstance(call, nnx.RngStream):
        return call()
    if call is not None:
        return call
    if own is None:
        raise ValueError(
            f"{layer} needs a PRNG key ({why}): build it with rngs=nnx.Rngs(...) or pass "
            "rngs= to the call"
        )
    return own()


def routing_key(experts: jax.Array, num_experts: int) -> jax.Array:
    """Each assignment's expert, with the dropped ones (``-1``) as `num_experts`: a sort key
    that puts them last."""
    return jnp.where(experts >= 0, experts, num_experts)


def inverse_permutation(order: jax.Array) -> jax.Array:
    """The permutation that undoes `order` (``x[order][inverse] == x``)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def on_auto_axes(fn: Callable[..., Any], out_specs: Any) -> Callable[..., Any]:
    """`fn` run with the context mesh's Explicit axes as Auto (`jax.sharding.auto_axes`), its
    outputs split as `out_specs` says; `fn` itself on Auto axes or with no mesh. For the
    computations over the global batch (a sort of every assignment, a loss per sequence) whose
    split is XLA's to choose: on Explicit axes JAX asks for each step's sharding."""
    mesh = jax.sharding.get_abstract_mesh()
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True)) if not mesh.empty else {}
    if not any(types[a] == AxisType.Explicit for a in (free_axes(mesh) if types else ())):
        return fn
    return jax.sharding.auto_axes(fn, out_sharding=out_specs)


def spec_of(x: jax.Array) -> Any:
    """`x`'s PartitionSpec on Explicit axes (its type carries it)."""
    return jax.typeof(x).sharding.spec


def rank_within_expert(
    experts: jax.Array, num_experts: int, priority: jax.Array | None = None
) -> jax.Array:
    """Each assignment's rank among the assignments of its expert (0 first), in the order of
    the flat `experts` (position) or of descending `priority`, ties by position. Dropped
    assignments (``-1``) get ranks of their own that mean nothing.

    This is the order in which an expert's capacity is filled: Paddle's
    ``prune_gate_by_capacity`` (by position) and Megatron's ``--moe-token-drop-policy``
    (``position``, or ``probs`` with the routing probabilities as `priority`)."""

    def ranks(experts: jax.Array, priority: jax.Array | None) -> jax.Array:
        key = routing_key(experts, num_experts)
        by_position = priority is None
        order = jnp.argsort(key, stable=True) if by_position else jnp.lexsort((-priority, key))
        counts = jnp.bincount(key, length=num_experts + 1)
        first = jnp.cumsum(counts) - counts
        return (inverse_permutation(order.astype(jnp.int32)) - first[key]).astype(jnp.int32)

    return on_auto_axes(ranks, spec_of(experts))(experts, priority)


def drop_beyond_capacity(
    experts: jax.Array, num_experts: int, capacity: int, priority: jax.Array | None = None
) -> jax.Array:
    """`experts` ``[T, k]`` with ``-1`` for every assignment beyond its expert's `capacity`
    (ranked by `rank_within_expert` over the flat ``[T k]`` order)."""
    flat = experts.reshape(-1)
    flat_priority = None if priority is None else priority.reshape(-1)
    rank = rank_within_expert(flat, num_experts, flat_priority).reshape(experts.shape)
    return jnp.where(rank < capacity, experts, -1).astype(jnp.int32)


def top_k(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The `k` largest of each row of `scores`, largest first (ties: the lower index first),
    and their indices (int32): `jax.lax.top_k`'s result, by a sort of each row. XLA's
    partitioner gathers every row onto each device for ``top_k``'s custom call; a sort of the
    last dimension it runs where the rows are."""
    index = jnp.zeros_like(scores, jnp.int32) + jnp.arange(scores.shape[-1], dtype=jnp.int32)
    negated, index = jax.lax.sort((-scores, index), dimension=-1, num_keys=1, is_stable=True)
    return -negated[..., :k], index[..., :k]


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
    """``[num_experts]`` float32: the assignments each expert receives (dropped ones
    excluded)."""
    # A compare and a sum (one fused reduction), which XLA splits over the tokens like any
    # sum; a scatter (bincount) would need its output's sharding spelled out on Explicit axes.
    hits = experts.reshape(-1)[:, None] == jnp.arange(num_experts, dtype=experts.dtype)
    return jnp.sum(hits, axis=0, dtype=jnp.float32)
