"""Sending each token to its experts over the expert mesh axes and their outputs back.

The layer's tokens ``[T, H]`` (a global array) and each token's ``k`` experts go into a
`shard_map` over the context mesh, the tokens split over the axes they arrive split on (the
data and sequence axes) and then over every other axis: tokens that every rank of an axis
holds (an expert axis, a tensor-parallel axis) are first split among those ranks (Megatron's
EP with TP), so that no two devices dispatch the same token, and gathered back after. The
``E`` experts split in ``P`` contiguous blocks over the expert axes (``E / P`` on each rank,
the linear index of the axes as a `PartitionSpec` splits them); an expert's hidden dimension
may be split ``Q`` ways over the expert tensor axes.

On each device, ``T`` tokens and ``A = T k`` assignments (an assignment is a token and one of
its experts):

* ``alltoall``, dropless (the default): the assignments are sorted by expert; the rows for rank
  ``d`` go in chunks of ``S = ceil((1 + buffer) A / P)`` rows (a receive buffer of ``P S``, the
  balanced ``A`` rows and ``buffer`` more), one ``[P, S, H]`` all-to-all a round, the experts
  run on what arrived (sorted by local expert, a grouped matmul), an all-to-all sends the
  outputs back. When routing is skewed, a rank's rows for one peer exceed ``S``: the overflow
  goes in further rounds (a loop, as many rounds as the fullest chunk needs, the same on every
  device), so nothing is dropped and the buffer stays ``(1 + buffer)`` times the balanced size.
  The first round keeps its activations for the backward pass; the overflow rounds recompute
  theirs (a `jax.custom_vjp`: the backward pass sends the rows and their output gradients in
  one all-to-all and the input gradients back in a second). The experts' counts per rank go
  once in a small ``[P, E / P]`` int32 all-to-all, so that receivers know whose rows are whose.
  (``jax.lax.ragged_all_to_all``, which sends exactly the rows, is not implemented by XLA:CPU.)
* ``alltoall`` with ``capacity_factor`` (Megatron's capacity): each expert takes at most
  ``C = ceil(capacity_factor A / E)`` of a device's assignments, chosen by the routing
  probability (``drop_policy="probs"``) or by position (``"position"``); the rest are dropped
  (counted). One round of ``[P, (E / P) C, H]``: ``capacity_factor T k H`` elements each way.
* ``allgather`` (Megatron's allgather dispatcher, MaxText's ring of experts): the tokens are
  all-gathered over the expert (and expert tensor) axes, each rank runs its experts on every
  assignment that is theirs, and a reduce-scatter sums the outputs back to the tokens' ranks.

With ``Q > 1`` (expert tensor parallelism) the rows a rank receives are all-gathered over the
expert tensor axes, each rank computes partial sums over its slice of the hidden dimension, and
a reduce-scatter sums them and returns each rank its own rows.

`all_to_all_bytes` is the formula for the bytes a device sends each way in the first round.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec

from fleetjax.layers.moe.experts import apply_grouped
from fleetjax.layers.moe.routing import inverse_permutation, rank_within_expert, routing_key
from fleetjax.layers.partitioning import free_axes, logical_to_spec

__all__ = [
    "DISPATCHERS",
    "DROP_POLICIES",
    "Dispatch",
    "Layout",
    "all_to_all_bytes",
    "dispatch",
    "join_tokens",
    "split_tokens",
]

DISPATCHERS = ("alltoall", "allgather")
DROP_POLICIES = ("probs", "position")


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """How a MoE layer sends tokens to its experts (Megatron's token dispatcher options).

    Attributes:
      dispatcher: ``"alltoall"`` or ``"allgather"`` (Megatron's ``--moe-token-dispatcher-type``).
      capacity_factor: None for dropless; else each expert takes at most ``ceil(capacity_factor
        x T k / E)`` of a device's ``T`` tokens' assignments (``--moe-expert-capacity-factor``).
      drop_policy: which assignments an expert keeps when over capacity: the highest routing
        probabilities (``"probs"``) or the first (``"position"``); ``--moe-token-drop-policy``.
      buffer: dropless's receive buffer is ``1 + buffer`` times the balanced size.
      grouped_gemm: the experts' grouped matmul where their class has one (``--moe-grouped-gemm``),
        else the loop over tiles.
      recompute: recompute the experts' activations in the backward pass (Paddle's
        ``recompute_interval``).
    """

    dispatcher: str = "alltoall"
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    buffer: float = 0.25
    grouped_gemm: bool = True
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(
                f"MoELayer: dispatcher must be one of {DISPATCHERS}, got {self.dispatcher!r}"
            )
        if self.drop_policy not in DROP_POLICIES:
            raise ValueError(
                f"MoELayer: drop_policy must be one of {DROP_POLICIES}, got {self.drop_policy!r}"
            )
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or cf <= 0):
            raise ValueError(
                f"MoELayer: capacity_factor must be None (dropless) or a number > 0, got {cf!r}"
            )
        if cf is not None and self.dispatcher != "alltoall":
            raise ValueError(
                "MoELayer: capacity_factor drops tokens in the alltoall dispatcher only; the "
                f"{self.dispatcher!r} dispatcher is dropless"
            )
        if (
            isinstance(self.buffer, bool)
            or not isinstance(self.buffer, (int, float))
            or self.buffer < 0
        ):
            raise ValueError(f"MoELayer: buffer must be a number >= 0, got {self.buffer!r}")


class Layout(NamedTuple):
    """Where a MoE layer's dispatch runs: the mesh and its axes' roles (`layout` works them
    out).

    Attributes:
      mesh: the context mesh, or None (one device: no communication).
      experts: the expert axes, over which the experts split (``P`` their sizes' product).
      tensor: the expert tensor axes, over which an expert's hidden dimension splits (``Q``).
      tokens: the axes the tokens split over inside the dispatch.
      arrival: the axes the tokens arrive split over (the first of `tokens`).
    """

    mesh: AbstractMesh | None
    experts: tuple[str, ...] = ()
    tensor: tuple[str, ...] = ()
    tokens: tuple[str, ...] = ()
    arrival: tuple[str, ...] = ()

    def size(self, axes: Sequence[str]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes) if self.mesh is not None else 1


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def layout(
    stacked: nnx.Module,
    num_experts: int,
    token_names: tuple[str, ...],
    expert_axes: tuple[str, ...] | None,
    grouped: bool,
) -> Layout:
    """The layout of the context mesh (`jax.set_mesh`, or a `shard_map`'s) for a dispatch:
    the expert axes (`expert_axes`, else where the rules put the logical ``"expert"``), the
    expert tensor axes (the axes the rules split the stacked experts' other dimensions over;
    none for experts applied tile by tile, which run whole), and the token axes: where the
    logical `token_names` split the tokens, then every other axis, so that no two devices
    dispatch the same token. Axes the mesh lacks, or has as manual axes, are left out.

    Raises:
      ValueError: if the expert axes do not divide `num_experts`.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not free_axes(mesh):
        return Layout(None)
    free = set(free_axes(mesh))
    if expert_axes is None:
        expert_axes = _axes(logical_to_spec(("expert",), mesh=mesh)[0])
    experts = tuple(a for a in expert_axes if a in free)
    tensor: tuple[str, ...] = ()
    if grouped:
        for names in _Parameters.of(stacked).names:
            spec = logical_to_spec(names[1:], mesh=mesh, taken=experts)
            tensor += tuple(a for e in spec for a in _axes(e) if a not in tensor)
    arrival: tuple[str, ...] = ()
    for entry in logical_to_spec(token_names, mesh=mesh):
        arrival += _axes(entry)
    tokens = arrival + tuple(a for a in free_axes(mesh) if a not in arrival)
    found = Layout(mesh, experts, tensor, tokens, arrival)
    ways = found.size(experts)
    if num_experts % ways:
        split = " x ".join(f"{a}={mesh.shape[a]}" for a in experts)
        raise ValueError(
            f"MoELayer: {num_experts} experts do not split over the expert axes {split}: "
            "the number of experts must be a multiple of their size (moe_group, or the "
            "rule for 'expert')"
        )
    return found


def split_tokens(tokens: jax.Array, where: Layout) -> jax.Array:
    """`tokens` ``[T, H]`` split over the dispatch's token axes, so that the gate routes each
    token where it is dispatched from (not on gathered copies)."""
    return _split(tokens, where, where.tokens)


def join_tokens(tokens: jax.Array, where: Layout) -> jax.Array:
    """The layer's output ``[T, H]`` back on the axes its input arrived split over. On Auto
    axes XLA places it as the model asks; on Explicit axes the array's type must say so."""
    if where.mesh is None or AxisType.Explicit not in where.mesh.axis_types:
        return tokens
    return _split(tokens, where, where.arrival)


def _split(tokens: jax.Array, where: Layout, axes: tuple[str, ...]) -> jax.Array:
    if where.mesh is None:
        return tokens
    sharding = NamedSharding(where.mesh, PartitionSpec(axes or None))
    if AxisType.Explicit in where.mesh.axis_types:
        return jax.sharding.reshard(tokens, sharding)
    return jax.lax.with_sharding_constraint(tokens, sharding)


class _Parameters(NamedTuple):
    """The stacked experts taken apart: their graph, their parameters' values (in one order)
    and logical names, and everything else they hold (nothing that a dispatch reads)."""

    graphdef: Any
    structure: Any  # of the parameters' pure dict
    rest: Any
    values: list[jax.Array]
    names: list[tuple[str | None, ...]]

    @classmethod
    def of(cls, stacked: nnx.Module) -> _Parameters:
        graphdef, params, rest = nnx.split(stacked, nnx.Param, ...)
        variables = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        names = [tuple(v.get_metadata().get("out_sharding") or ()) for v in variables]
        values, structure = jax.tree.flatten(nnx.to_pure_dict(params))
        return cls(graphdef, structure, rest, values, names)

    def module(self, values: list[jax.Array]) -> nnx.Module:
        """The stacked experts with the parameters `values` (a device's slices)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.structure, values), self.rest)


class _Static(NamedTuple):
    """A dispatch's static facts, per device."""

    layout: Layout
    config: Dispatch
    parameters: _Parameters  # the stacked experts' structure (no values)
    experts: int  # E
    local: int  # E / P
    chunk: int  # S: rows per peer and round
    capacity: int  # C (capacity mode), else 0

    @property
    def ranks(self) -> int:
        return self.layout.size(self.layout.experts)

    @property
    def tensor_ways(self) -> int:
        return self.layout.size(self.layout.tensor)

    @property
    def overflows(self) -> bool:
        """Whether rows may take more than one round (dropless over several ranks)."""
        return self.config.capacity_factor is None and self.ranks > 1


class _Plan(NamedTuple):
    """Where a device's assignments go: each one's peer rank and its position in the rows this
    device sends that peer (-1: not sent), the rows each peer sends for each local expert
    (dropless), and the rounds the rows take."""

    token: jax.Array
    peer: jax.Array
    position: jax.Array
    received: jax.Array | None
    rounds: jax.Array


def dispatch(
    stacked: nnx.Module,
    tokens: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    where: Layout,
    config: Dispatch,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every assignment's expert output: ``out[t, j] = expert_{experts[t, j]}(tokens[t])`` (0
    where ``experts[t, j]`` is -1 or the capacity dropped it), ``[T, k, H]``, with the number
    of assignments dropped and the rounds taken.

    Args:
      stacked: the experts, stacked (`stack_experts`).
      tokens: ``[T, H]``.
      experts: ``[T, k]`` int32 expert ids, -1 for none.
      weights: ``[T, k]`` the routing weights (the ``"probs"`` drop policy ranks by them).
      where: the layout (`layout`).
      config: how to dispatch.

    Raises:
      ValueError: if the token axes do not divide the tokens.
    """
    parameters = _Parameters.of(stacked)
    leaves = parameters.values
    num_experts = leaves[0].shape[0]
    token_ways = where.size(where.tokens)
    count = tokens.shape[0]
    if count % token_ways:
        split = " x ".join(f"{a}={where.mesh.shape[a]}" for a in where.tokens)
        raise ValueError(
            f"MoELayer: {count} tokens do not split over the axes its dispatch splits them "
            f"over, {split}: the tokens (batch x sequence) must be a multiple of {token_ways}"
        )
    local_tokens, top_k = count // token_ways, experts.shape[1]
    ranks = where.size(where.experts)
    assignments = local_tokens * top_k
    capacity = 0
    if config.capacity_factor is not None:
        capacity = math.ceil(config.capacity_factor * assignments / num_experts)
        chunk = capacity * (num_experts // ranks)
    else:
        chunk = math.ceil((1 + config.buffer) * assignments / ranks) if ranks > 1 else assignments
    static = _Static(
        where,
        config,
        parameters._replace(values=[]),
        num_experts,
        num_experts // ranks,
        chunk,
        capacity,
    )
    body = functools.partial(_local, static)
    if where.mesh is None:
        return body(leaves, tokens, experts, weights)
    token_spec = PartitionSpec(where.tokens or None)
    leaf_specs = [
        _leaf_spec(names, where, grouped=bool(where.tensor)) for names in parameters.names
    ]
    run = jax.shard_map(
        body,
        mesh=where.mesh,
        in_specs=(leaf_specs, token_spec, token_spec, token_spec),
        out_specs=(token_spec, PartitionSpec(), PartitionSpec()),
        axis_names=set(free_axes(where.mesh)),
        check_vma=False,
    )
    specs = (leaf_specs, token_spec, token_spec, token_spec)
    args = _placed(where.mesh, (leaves, tokens, experts, weights), specs)
    return run(*args)


def _leaf_spec(names: tuple, where: Layout, grouped: bool) -> PartitionSpec:
    """A stacked parameter's split inside the dispatch: the expert dimension over the expert
    axes, the others as the rules say (expert tensor parallelism) or, for experts that run
    whole, not at all."""
    rest = (
        logical_to_spec(names[1:], mesh=where.mesh, taken=where.experts)
        if grouped
        else (None,) * (len(names) - 1)
    )
    return PartitionSpec(where.experts or None, *rest)


def _placed(mesh: AbstractMesh, args: Any, specs: Any) -> Any:
    """`args` resharded to `specs` on Explicit axes (a `shard_map` takes them as they are
    there); on Auto axes the `shard_map` reshards them itself."""
    if AxisType.Explicit not in mesh.axis_types:
        return args
    return jax.tree.map(
        lambda x, s: jax.sharding.reshard(x, NamedSharding(mesh, s)),
        args,
        specs,
        is_leaf=lambda s: isinstance(s, PartitionSpec),
    )


# -- on each device -------------------------------------------------------------------------


def _local(
    static: _Static, leaves: list, x: jax.Array, experts: jax.Array, weights: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    count, top_k = experts.shape
    if static.config.dispatcher == "allgather":
        return _gathered(static, leaves, x, experts), jnp.int32(0), jnp.int32(1)
    plan, dropped = _plan(static, experts, weights)
    sent = x[plan.token]
    out = _round(static, leaves, sent, plan, 0)
    if static.overflows:
        out = out + _overflow(static, leaves, sent, plan)
    return out.reshape(count, top_k, -1), dropped, plan.rounds


def _plan(static: _Static, experts: jax.Array, weights: jax.Array) -> tuple[_Plan, jax.Array]:
    """Where each assignment goes, and how many assignments this dispatch drops (summed over
    the devices): those over capacity, or in dropless mode any the rounds would miss (none)."""
    flat = experts.reshape(-1)
    token = jnp.arange(flat.shape[0], dtype=jnp.int32) // experts.shape[1]
    valid = flat >= 0
    peer = jnp.where(valid, flat // static.local, static.ranks)
    if static.capacity:
        policy = static.config.drop_policy
        priority = weights.reshape(-1).astype(jnp.float32) if policy == "probs" else None
        rank = rank_within_expert(flat, static.experts, priority)
        kept = valid & (rank < static.capacity)
        position = jnp.where(kept, (flat % static.local) * static.capacity + rank, -1)
        lost = valid & ~kept
        plan = _Plan(token, peer, position, None, jnp.int32(1))
        return plan, _total(static, jnp.sum(lost))
    key = routing_key(flat, static.experts)
    sorted_rank = inverse_permutation(jnp.argsort(key, stable=True).astype(jnp.int32))
    per_expert = jnp.bincount(key, length=static.experts + 1)[: static.experts].astype(jnp.int32)
    per_peer = per_expert.reshape(static.ranks, static.local).sum(axis=1)
    first = jnp.cumsum(per_peer) - per_peer
    position = jnp.where(valid, sorted_rank - first[jnp.minimum(peer, static.ranks - 1)], -1)
    rounds = jnp.maximum(jnp.max(-(-per_peer // static.chunk)), 1).astype(jnp.int32)
    received = _exchange(static, per_expert.reshape(static.ranks, static.local))
    if static.overflows:
        rounds = lax.pmax(rounds, tuple(free_axes(static.layout.mesh)))
    missed = valid & (position >= rounds * static.chunk)
    return _Plan(token, peer, position, received, rounds), _total(static, jnp.sum(missed))


def _total(static: _Static, count: jax.Array) -> jax.Array:
    count = count.astype(jnp.int32)
    mesh = static.layout.mesh
    return (
        lax.psum(count, tuple(static.layout.tokens))
        if mesh is not None and static.layout.tokens
        else count
    )


def _exchange(static: _Static, buffer: jax.Array) -> jax.Array:
    """Chunk ``d`` of `buffer` ``[P, ...]`` to expert rank ``d``; chunk ``s`` of the result is
    what rank ``s`` sent."""
    if static.ranks == 1:
        return buffer
    return lax.all_to_all(buffer, static.layout.experts, 0, 0, tiled=True)


def _slots(static: _Static, plan: _Plan, round_: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each assignment's (peer, slot) in round `round_`'s send buffer ``[P, S]``, and whether
    it goes in this round."""
    slot = plan.position - round_ * static.chunk
    active = (plan.position >= 0) & (slot >= 0) & (slot < static.chunk)
    return jnp.where(active, plan.peer, static.ranks), jnp.where(active, slot, 0), active


def _pack(static: _Static, rows: jax.Array, plan: _Plan, round_: Any) -> jax.Array:
    peer, slot, _ = _slots(static, plan, round_)
    buffer = jnp.zeros((static.ranks, static.chunk, rows.shape[-1]), rows.dtype)
    return buffer.at[peer, slot].set(rows, mode="drop")


def _unpack(static: _Static, buffer: jax.Array, plan: _Plan, round_: Any) -> jax.Array:
    peer, slot, active = _slots(static, plan, round_)
    rows = buffer.at[peer, slot].get(mode="fill", fill_value=0)
    return jnp.where(active[:, None], rows, 0)


def _received_experts(static: _Static, plan: _Plan, round_: Any) -> jax.Array:
    """The local expert of each row received in round `round_` ``[P, S]`` (``E / P``: none).
    Capacity mode: slot ``e C + i`` is expert ``e``'s; dropless: from each sender's counts
    (its rows for this rank are sorted by expert)."""
    if static.capacity:
        slots = jnp.arange(static.chunk, dtype=jnp.int32) // static.capacity
        return jnp.broadcast_to(slots, (static.ranks, static.chunk))
    row = round_ * static.chunk + jnp.arange(static.chunk, dtype=jnp.int32)
    ends = jnp.cumsum(plan.received, axis=1)
    return jax.vmap(lambda e: jnp.searchsorted(e, row, side="right"))(ends).astype(jnp.int32)


def _experts_side(
    static: _Static, leaves: list, rows: jax.Array, local_experts: jax.Array
) -> jax.Array:
    """The experts on the rows this rank received ``[P, S, H]`` (their local experts
    `local_experts` ``[P, S]``), over the expert tensor axes if any."""
    tensor = static.layout.tensor
    if static.tensor_ways > 1:
        rows = lax.all_gather(rows, tensor, axis=0, tiled=True)
        local_experts = lax.all_gather(local_experts, tensor, axis=0, tiled=True)
    shape = rows.shape
    out = _grouped(static, leaves, rows.reshape(-1, shape[-1]), local_experts.reshape(-1))
    out = out.reshape(shape)
    if static.tensor_ways > 1:
        out = lax.psum_scatter(out, tensor, scatter_dimension=0, tiled=True)
    return out


def _grouped(static: _Static, leaves: list, rows: jax.Array, keys: jax.Array) -> jax.Array:
    """The local experts on `rows`, row ``i`` to expert ``keys[i]`` (``E / P``: none, 0)."""

    def run(leaves: list, rows: jax.Array) -> jax.Array:
        stacked = static.parameters.module(leaves)
        order = jnp.argsort(keys, stable=True)
        sizes = jnp.bincount(keys, length=static.local + 1)[: static.local].astype(jnp.int32)
        out = apply_grouped(stacked, rows[order], sizes, grouped_gemm=static.config.grouped_gemm)
        return out[inverse_permutation(order.astype(jnp.int32))]

    return (jax.checkpoint(run) if static.config.recompute else run)(leaves, rows)


def _round(static: _Static, leaves: list, sent: jax.Array, plan: _Plan, round_: Any) -> jax.Array:
    """Round `round_`: its rows to their experts and the outputs back, per assignment."""
    received = _exchange(static, _pack(static, sent, plan, round_))
    out = _experts_side(static, leaves, received, _received_experts(static, plan, round_))
    return _unpack(static, _exchange(static, out), plan, round_)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _overflow(static: _Static, leaves: list, sent: jax.Array, plan: _Plan) -> jax.Array:
    """Rounds 1, 2, ... (the rows past the first round's chunks), per assignment."""
    body = lambda r, out: out + _round(static, leaves, sent, plan, r)  # noqa: E731
    return lax.fori_loop(1, plan.rounds, body, jnp.zeros_like(sent))


def _overflow_forward(static: _Static, leaves: list, sent: jax.Array, plan: _Plan) -> tuple:
    return _overflow(static, leaves, sent, plan), (leaves, sent, plan)


def _overflow_backward(static: _Static, kept: tuple, grad: jax.Array) -> tuple:
    """Each round again: the rows and their output gradients in one all-to-all, the experts'
    backward pass (their forward recomputed), the rows' gradients back in a second."""
    leaves, sent, plan = kept
    width = sent.shape[-1]

    def body(round_: jax.Array, sums: tuple[list, jax.Array]) -> tuple[list, jax.Array]:
        leaf_sums, sent_sum = sums
        both = jnp.concatenate([sent, grad.astype(sent.dtype)], axis=-1)
        received = _exchange(static, _pack(static, both, plan, round_))
        local_experts = _received_experts(static, plan, round_)
        _, backward = jax.vjp(
            lambda lv, rows: _experts_side(static, lv, rows, local_experts),
            leaves,
            received[..., :width],
        )
        leaf_grads, row_grads = backward(received[..., width:])
        back = _unpack(static, _exchange(static, row_grads), plan, round_)
        return jax.tree.map(jnp.add, leaf_sums, leaf_grads), sent_sum + back

    zeros = (jax.tree.map(jnp.zeros_like, leaves), jnp.zeros_like(sent))
    leaf_grads, sent_grad = lax.fori_loop(1, plan.rounds, body, zeros)
    return leaf_grads, sent_grad, None


_overflow.defvjp(_overflow_forward, _overflow_backward)


def _gathered(static: _Static, leaves: list, x: jax.Array, experts: jax.Array) -> jax.Array:
    """The allgather dispatcher: every token of the expert (and expert tensor) group on each
    rank, its experts on theirs, a reduce-scatter of the outputs back."""
    group = (*static.layout.experts, *static.layout.tensor)
    ways = static.ranks * static.tensor_ways
    top_k = experts.shape[1]
    if ways > 1:
        x = lax.all_gather(x, group, axis=0, tiled=True)
        experts = lax.all_gather(experts, group, axis=0, tiled=True)
    flat = experts.reshape(-1)
    rank = lax.axis_index(static.layout.experts) if static.ranks > 1 else 0
    mine = (flat >= 0) & (flat // static.local == rank)
    keys = jnp.where(mine, flat % static.local, static.local)
    token = jnp.arange(flat.shape[0]) // top_k
    out = _grouped(static, leaves, x[token], keys).reshape(-1, top_k, x.shape[-1])
    if ways > 1:
        out = lax.psum_scatter(out, group, scatter_dimension=0, tiled=True)
    return out


def all_to_all_bytes(
    tokens: int,
    hidden: int,
    top_k: int,
    num_experts: int,
    ranks: int,
    *,
    itemsize: int = 4,
    capacity_factor: float | None = None,
    buffer: float = 0.25,
) -> int:
    """The bytes one device sends to the other expert ranks in one all-to-all of a MoE layer's
    first round: the tokens to their experts, or the outputs back (each way the same).

    Capacity mode: ``E ceil(cf T k / E) H b (P - 1) / P``, that is ``cf T k H b (P - 1) / P``
    when ``cf T k / E`` is whole. Dropless: the receive buffer, ``P ceil((1 + buffer) T k / P)
    H b (P - 1) / P``, about ``(1 + buffer) T k H b (P - 1) / P``; each overflow round (skewed
    routing) sends as much again. A training step sends it 4 times (dispatch and combine,
    forward and backward); an overflow round 5 times (its backward pass sends the rows again
    with their gradients, ``2 H`` wide). Dropless mode also exchanges the experts' counts once
    a call, ``E`` int32 (``4 E (P - 1) / P`` bytes).

    Args:
      tokens: ``T``, the tokens a device dispatches (its share after the split over the data,
        expert and expert tensor axes).
      hidden: ``H``, the model width.
      top_k: ``k``, experts a token.
      num_experts: ``E``.
      ranks: ``P``, the expert axes' size.
      itemsize: ``b``, bytes an element.
      capacity_factor: ``cf``; None for dropless.
      buffer: dropless's receive buffer over the balanced size, less 1.
    """
    if ranks == 1:
        return 0
    assignments = tokens * top_k
    if capacity_factor is not None:
        rows = num_experts * math.ceil(capacity_factor * assignments / num_experts)
    else:
        rows = ranks * math.ceil((1 + buffer) * assignments / ranks)
    return rows * hidden * itemsize * (ranks - 1) // ranks
