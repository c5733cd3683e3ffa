"""A MoE layer's experts: stacked into one module, and applied to rows grouped by expert.

`stack_experts` turns a list of expert modules of one shape into one module whose parameters
carry a leading expert dimension, logical axis ``"expert"`` (the rules map it to the expert mesh
axes). `apply_grouped` runs a stacked module's experts on rows sorted by expert, ``group_sizes``
rows each (rows past the groups give 0):

* a grouped matmul where the expert class says how: a method ``grouped(x, group_sizes)``
  called on the stacked module, as `ExpertMLP` has (``jax.lax.ragged_dot``: Megatron's
  ``GroupedMLP``, MaxText's megablox / ``ragged_dot``);
* otherwise, any expert module: a loop over tiles of rows, each tile within one expert, that
  calls the expert module on it (Paddle's and Megatron's ``SequentialMLP`` loop over experts,
  with static shapes): about ``rows + experts x tile`` rows of work.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax.layers._params import DEFAULT_WEIGHT_INIT, check_sizes, logical_param

__all__ = ["ACTIVATIONS", "ExpertMLP", "apply_grouped", "has_grouped", "stack_experts"]

ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "gelu": jax.nn.gelu,
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}


class ExpertMLP(nnx.Module):
    """One expert's feed-forward network, with a grouped matmul for many experts at once:
    ``down(act(x up))``, or with ``gated`` ``down(act(x gate) * (x up))`` (SwiGLU with
    ``"silu"``: Mixtral, DeepSeek, Megatron's ``--swiglu``). No biases, as Megatron's
    ``GroupedMLP``, MaxText's and DeepSeek's experts.

    Its hidden dimension has the logical axis ``"expert_mlp"``, which the rules map to ``mp``
    (expert tensor parallelism, Megatron's ``--expert-tensor-parallel-size``); rule it to None
    for experts whole on each expert rank.

    Attributes:
      up: ``[d_model, d_hidden]``, logical ``("embed", "expert_mlp")``.
      gate: the same, with ``gated``; else None.
      down: ``[d_hidden, d_model]``, logical ``("expert_mlp", "embed")``.
    """

    def __init__(
        self,
        d_model: int,
        d_hidden: int,
        *,
        activation: str | Callable[[jax.Array], jax.Array] = "gelu",
        gated: bool = False,
        weight_init: nnx.Initializer = DEFAULT_WEIGHT_INIT,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        check_sizes("ExpertMLP", d_model=d_model, d_hidden=d_hidden)
        if isinstance(activation, str) and activation not in ACTIVATIONS:
            raise ValueError(
                f"ExpertMLP: activation must be one of {sorted(ACTIVATIONS)} or a function, "
                f"got {activation!r}"
            )
        self.activation = ACTIVATIONS[activation] if isinstance(activation, str) else activation
        hidden, wide = ("embed", "expert_mlp"), (d_model, d_hidden)
        self.up = logical_param(weight_init, hidden, rngs.params(), wide, param_dtype)
        self.gate = (
            logical_param(weight_init, hidden, rngs.params(), wide, param_dtype)
            if gated
            else nnx.data(None)
        )
        self.down = logical_param(
            weight_init, ("expert_mlp", "embed"), rngs.params(), (d_hidden, d_model), param_dtype
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        """The expert on rows `x` ``[..., d_model]``."""
        return self._mlp(x, lambda rows, w: jnp.matmul(rows, w[...]))

    def grouped(self, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """On a stacked module (parameters ``[experts, ...]``): expert ``e`` on its
        ``group_sizes[e]`` rows of `x` ``[rows, d_model]`` (sorted by expert), by
        ``jax.lax.ragged_dot``. With the hidden dimension split, the partial sums over it."""
        return self._mlp(x, lambda rows, w: jax.lax.ragged_dot(rows, w[...], group_sizes))

    def _mlp(self, x: jax.Array, dot: Callable[[jax.Array, nnx.Param], jax.Array]) -> jax.Array:
        hidden = dot(x, self.up)
        if self.gate is not None:
            hidden = self.activation(dot(x, self.gate)) * hidden
        else:
            hidden = self.activation(hidden)
        return dot(hidden, self.down)


def stack_experts(experts: Sequence[nnx.Module]) -> nnx.Module:
    """One module whose Variables hold `experts`' values stacked on a new leading dimension
    with the logical axis ``"expert"`` (the other dimensions keep their names).

    Raises:
      ValueError: for no experts, experts of different classes or structures, an expert's
        parameter of another shape or dtype than expert 0's (naming both), or an expert
        holding anything but parameters (``nnx.Param``).
    """
    if isinstance(experts, nnx.Module) or not isinstance(experts, Sequence) or not experts:
        raise ValueError(
            "MoELayer: experts must be a non-empty list of flax nnx modules of one shape, got "
            f"{experts!r}"
        )
    graphdef, first = nnx.split(experts[0])
    flat_first = dict(nnx.to_flat_state(first))
    states = [first]
    for i, expert in enumerate(experts):
        if not isinstance(expert, nnx.Module):
            raise ValueError(f"MoELayer: experts[{i}] is not a flax nnx module: {expert!r}")
        definition, state = nnx.split(expert)
        flat = dict(nnx.to_flat_state(state))
        if definition != graphdef or flat.keys() != flat_first.keys():
            raise ValueError(
                f"MoELayer: experts[{i}] ({type(expert).__name__}) does not have experts[0]'s "
                f"structure ({type(experts[0]).__name__}): every expert must be built alike"
            )
        for path, variable in flat.items():
            _check_alike(i, path, variable, flat_first[path])
        if i:
            states.append(state)
    stacked = jax.tree.map(_stacked, *states, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, stacked)


def _check_alike(i: int, path: tuple, variable: nnx.Variable, first: nnx.Variable) -> None:
    where = "/".join(str(p) for p in path)
    if not isinstance(variable, nnx.Param):
        raise ValueError(
            f"MoELayer: experts[{i}] holds {type(variable).__name__} {where!r}: experts must "
            "hold parameters (nnx.Param) only"
        )
    value, expected = variable.get_value(), first.get_value()
    if (value.shape, value.dtype) != (expected.shape, expected.dtype):
        raise ValueError(
            f"MoELayer: experts of different shapes: experts[{i}]'s {where!r} is "
            f"{value.dtype}{list(value.shape)}, experts[0]'s {expected.dtype}"
            f"{list(expected.shape)}"
        )


def _stacked(*variables: nnx.Variable) -> nnx.Variable:
    first = variables[0]
    names = first.get_metadata().get("out_sharding") or (None,) * first.get_value().ndim
    value = jnp.stack([v.get_value() for v in variables])
    return first.replace(value, out_sharding=("expert", *names))


def has_grouped(module: nnx.Module) -> bool:
    """Whether `module`'s class has a grouped matmul (a ``grouped(x, group_sizes)`` method)."""
    return callable(getattr(type(module), "grouped", None))


def apply_grouped(
    stacked: nnx.Module, x: jax.Array, group_sizes: jax.Array, *, grouped_gemm: bool = True
) -> jax.Array:
    """The experts of `stacked` (``[experts, ...]`` parameters) on the rows `x` ``[rows,
    d_model]`` sorted by expert, ``group_sizes[e]`` rows for expert ``e``; rows past the groups
    give 0. The expert class's grouped matmul where it has one and `grouped_gemm`, else the
    loop over tiles (see the module docstring)."""
    if grouped_gemm and has_grouped(stacked):
        return stacked.grouped(x, group_sizes)
    return _tiles(stacked, x, group_sizes)


def _tiles(stacked: nnx.Module, x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The experts applied tile by tile: tile ``i`` holds up to ``tile`` rows of one expert
    (each group is cut into ``ceil(size / tile)`` tiles), so ``(rows + experts (tile - 1)) /
    tile`` tiles cover any grouping. A tile's forward pass is recomputed in the backward pass,
    so that each tile keeps only its expert and first row."""
    rows, width = x.shape
    experts = group_sizes.shape[0]
    tile = max(1, min(512, math.ceil(rows / experts)))
    count = (rows + experts * (tile - 1)) // tile
    graphdef, state = nnx.split(stacked)
    per_expert = -(-group_sizes // tile)
    ends = jnp.cumsum(per_expert)
    first_row = jnp.cumsum(group_sizes) - group_sizes
    index = jnp.arange(count)
    expert = jnp.minimum(jnp.searchsorted(ends, index, side="right"), experts - 1)
    live = index < ends[-1]
    start = first_row[expert] + (index - (ends[expert] - per_expert[expert])) * tile
    start = jnp.where(live, start, rows)
    stop = jnp.where(live, first_row[expert] + group_sizes[expert], rows)
    padded = jnp.concatenate([x, jnp.zeros((tile, width), x.dtype)])

    @jax.checkpoint
    def one(job: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        e, begin, end = job
        module = nnx.merge(graphdef, jax.tree.map(lambda v: v[e], state))
        y = module(jax.lax.dynamic_slice_in_dim(padded, begin, tile))
        return jnp.where((begin + jnp.arange(tile) < end)[:, None], y, 0).astype(x.dtype)

    out = jax.lax.map(one, (expert, start, stop))
    where = (start[:, None] + jnp.arange(tile)).reshape(-1)
    return jnp.zeros((rows + tile, width), x.dtype).at[where].add(out.reshape(-1, width))[:rows]
