"""Attention over a sequence split on the mesh: Paddle's segment parallelism (`sep_degree`,
Ulysses-style) and context parallelism (`cp_degree`, ring attention).

`attention(q, k, v)` is softmax(q k^T / sqrt(d)) v over global arrays ``[batch, length, heads,
head_dim]``, and communicates as the context mesh (`jax.set_mesh`, or a `shard_map` over other
axes) asks:

* no ``sep`` or ``cp`` axis: XLA's attention as `jax.nn.dot_product_attention` computes it,
  keeping only its probabilities (in the inputs' dtype) for the backward pass, as Megatron's
  fused softmax does (`fleetjax.layers._dense`), or `jax.nn.dot_product_attention` itself
  with an ``implementation``; the heads split over ``mp`` as they arrive (Megatron's
  attention needs no communication);
* ``sep``: the sequence arrives split over ``sep``; an all-to-all over ``sep`` trades it for a
  split of the heads (over ``mp`` x ``sep``), each device attends its heads over the whole
  sequence, and a second all-to-all trades back (DeepSpeed-Ulysses, Paddle's
  `SegmentParallel`): the heads must divide by ``mp`` x ``sep``;
* ``cp``: the sequence is split over ``cp`` and attention runs as a ring over ``cp``
  (`fleetjax.layers._ring`), causal and load-balanced, keeping 1/cp of the keys and values per
  device and no ``length x length`` scores;
* both: the all-to-all over ``sep`` within each ``cp`` block, then the ring over ``cp``.

The sequence is split over ``("cp", "sep")`` (the logical name ``"activation_length"``): a
model's activations are split so wherever they are named so. Under ``cp`` the ring needs the
load-balanced order (`to_load_balanced`): a model that keeps its sequence in that order from the
start (tokens, positions and labels reordered once: the loss is a mean over tokens) passes
``load_balanced=True``; otherwise `attention` reorders ``q``, ``k`` and ``v`` and the output,
which moves half of them between devices each call.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import PartitionSpec

from fleetjax.layers import _ring
from fleetjax.layers._dense import dense_attention
from fleetjax.layers.partitioning import LogicalNames, constrain, free_axes, logical_to_spec
from fleetjax.layers.precision import traced_dtype

__all__ = ["attention", "axis_ways", "to_load_balanced", "to_natural"]

# q, k, v and the output as they arrive: the sequence split, the heads over mp.
HEADS: LogicalNames = ("activation_length", "activation_heads", "activation_kv")
# Inside Ulysses' all-to-all: the sequence whole within a cp block, the heads over mp x sep.
ULYSSES: LogicalNames = ("activation_attention_length", "activation_attention_heads", None)
RING: LogicalNames = ("activation_batch", *ULYSSES)
# Where the sequence is whole: fleetjax's (None), or jax.nn.dot_product_attention's.
IMPLEMENTATIONS = (None, "xla", "cudnn")


def axis_ways(axis: str) -> int:
    """The size of the mesh axis `axis` in the context mesh (1 without it, or where it is
    manual: inside a `shard_map` over it)."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[axis] if not mesh.empty and axis in free_axes(mesh) else 1


def to_load_balanced(x: jax.Array, axis: int = 1) -> jax.Array:
    """`x` (e.g. tokens [batch, length]) with its dimension `axis` in the order ring attention
    over ``cp`` balances: cut into ``2 cp`` chunks, ``cp`` block ``j`` holds chunks ``j`` and
    ``2 cp - 1 - j``. Without a ``cp`` axis, `x` in its order. `x` is kept whole along the
    sequence: this is for a model's inputs (tokens, positions, labels)."""
    ways = axis_ways(_ring.AXIS)
    # Whole along the sequence (a model's tokens, labels and positions are small): reordering
    # a split sequence would send half of it between devices, and slicing one (tokens[:, :-1])
    # would exchange halos.
    whole = lambda x: constrain(x, (None,), axis=axis)  # noqa: E731
    if ways == 1:
        return whole(x)
    _check_length(x.shape[axis], 2 * ways * axis_ways("sep"))
    return whole(_ring.load_balanced(whole(x), axis % x.ndim, ways))


def to_natural(x: jax.Array, axis: int = 1) -> jax.Array:
    """The inverse of `to_load_balanced`."""
    ways = axis_ways(_ring.AXIS)
    return x if ways == 1 else _ring.natural(x, axis % x.ndim, ways)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    is_causal: bool = True,
    load_balanced: bool = False,
    implementation: str | None = None,
) -> jax.Array:
    """softmax(q k^T / sqrt(head_dim)) v (causal with `is_causal`) for `q`, `k`, `v`
    [batch, length, heads, head_dim], split over the context mesh's ``sep`` and ``cp`` as the
    module docstring says.

    Args:
      q, k, v: the queries, keys and values (the same shapes and dtypes).
      is_causal: each position attends to itself and those before it only.
      load_balanced: under ``cp``, whether the sequence is already in `to_load_balanced`'s
        order (else it is reordered here, and the output back).
      implementation: where no ``cp`` axis splits the sequence, None: XLA's attention
        keeping its probabilities alone for the backward pass (2 bytes a score under bf16);
        ``"xla"`` or ``"cudnn"``: `jax.nn.dot_product_attention`'s (its XLA path's autodiff
        keeps float32 scores too, about 10 bytes a score; cuDNN's flash attention on NVIDIA
        GPUs keeps none).

    Raises:
      TypeError: for q, k and v of different dtypes (outside AMP, which casts them to one).
      ValueError: for an `implementation` not in `IMPLEMENTATIONS`, shapes that differ, a
        length that the sequence axes do not divide (``sep`` x ``cp``, or ``sep`` x 2 ``cp``
        under ``cp``), or heads that ``mp`` x ``sep`` do not divide under ``sep``.
    """
    if not q.shape == k.shape == v.shape or q.ndim != 4:
        raise ValueError(
            "attention takes q, k and v of one shape [batch, length, heads, head_dim], got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    half = traced_dtype("dot_general")  # under AMP all three are cast to it below
    if half is None and not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"attention takes q, k and v of one dtype, got {q.dtype}, {k.dtype}, {v.dtype}: "
            "cast them to one (else each mesh's split would promote them its own way)"
        )
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention's implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    sep, cp = axis_ways("sep"), axis_ways(_ring.AXIS)
    _check_length(q.shape[1], sep * cp * (2 if cp > 1 else 1))
    if sep > 1:
        _check_heads(q.shape[2], sep * axis_ways("mp"))
    # Custom-gradient functions run as traced under AMP: cast here as the policy casts matmuls.
    q, k, v = (constrain(x if half is None else x.astype(half), HEADS) for x in (q, k, v))
    if sep > 1:
        q, k, v = (constrain(x, ULYSSES) for x in (q, k, v))
    if cp == 1 and implementation is None:
        out = dense_attention(q, k, v, is_causal)
    elif cp == 1:
        out = jax.nn.dot_product_attention(
            q, k, v, is_causal=is_causal, implementation=implementation
        )
    else:
        if not load_balanced:
            q, k, v = (_ring.load_balanced(x, 1, cp) for x in (q, k, v))
        out = _ring.ring_attention(q, k, v, is_causal, _ring_spec(q.shape))
        out = out if load_balanced else _ring.natural(out, 1, cp)
    return constrain(out, HEADS)


def _ring_spec(shape: tuple[int, ...]) -> PartitionSpec:
    """Where the ring's `shard_map` takes q, k, v and gives the output: the batch over the
    data axes, the length over ``cp``, the heads over ``mp`` (x ``sep``), each where it
    divides (else that dimension is whole over them)."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = logical_to_spec(RING, mesh=mesh)

    def divides(size: int, entry: Any) -> Any:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        return entry if size % math.prod(mesh.shape[a] for a in axes) == 0 else None

    return PartitionSpec(*(divides(n, e) for n, e in zip(shape, spec, strict=True)))


def _check_length(length: int, ways: int) -> None:
    if length % ways:
        raise ValueError(
            f"a sequence of {length} tokens does not split over the sequence axes: its length "
            f"must be a multiple of {ways} (sep_degree x cp_degree, and x 2 under cp: ring "
            "attention's load balance cuts each cp block in two)"
        )


def _check_heads(heads: int, ways: int) -> None:
    if heads % ways:
        raise ValueError(
            f"{heads} attention heads do not split over mp x sep = {ways}: segment "
            "parallelism (sep_degree) exchanges the sequence for the heads, so the number "
            f"of heads must be a multiple of {ways}"
        )
