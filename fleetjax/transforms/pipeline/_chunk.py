"""A model chunk's layers run forward, keeping each layer's `jax.vjp` residuals, and backward
from them, adding each layer's parameter gradients into the stage's accumulator in place.

The layer's forward is traced once, here, and that one jaxpr runs in every tick: tracing
`jax.vjp` again (inside `cond`, `scan`, `shard_map`) may give its residuals in another order,
or more of them (constants lifted), than the buffers were made for. Residuals that are the
layer's parameters (or model state) themselves are not kept; the backward takes them from the
parameters. Under recompute (`jax.checkpoint` around the stage) a layer's residuals are its
input alone.

The backward is a reverse `lax.scan` over the chunk's layers whose carry is the cotangent and
the accumulator: each layer's gradient is added where it belongs as soon as it is made, so no
stack of a whole chunk's gradients is ever materialised (Megatron-LM fuses its weight-gradient
accumulation likewise). Under a zero-bubble schedule it runs in two halves
(`_split.SplitBackward`): `backward_input` (B, the reverse scan for the input's gradient, which
also stacks each layer's carry) and `backward_weight` (W, each layer's weight gradients from its
residuals and carry, added into the accumulator); `carry_homes` says which residuals, dead once
B has run, can keep the carry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import jaxpr_as_fun

from fleetjax.transforms.pipeline._split import SplitBackward

Layer = Callable[[Any, Any, Any, jax.Array], tuple[Any, Any]]
_shape = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731


class Chunk:
    """One layer's vjp, traced once; `forward` and `backward` run it over a chunk's layers."""

    def __init__(self, stage: Layer, params: Any, state: Any, x: Any, key: jax.Array) -> None:
        """Traces ``stage(params, state, x, key) -> (y, new_state)`` for one layer, with values
        (or shapes) like one layer's `params` and `state`, the activations `x` and a `key`."""

        def forward(w: Any, s: Any, x: Any, key: jax.Array) -> tuple[Any, list[jax.Array]]:
            # The state rebuilt inside the vjp, so that flax Variables in it belong to its trace
            # (nnx refuses to update a Variable made at another trace level).
            layer = lambda w, x: stage(w, jax.tree.map(lambda v: v, s), x, key)  # noqa: E731
            y, vjp_fn, new_s = jax.vjp(layer, w, x, has_aux=True)
            leaves, treedef = jax.tree.flatten(vjp_fn)
            kept = jax.tree.leaves((w, s))
            # Per residual: the index of the parameter (or state) it is, or None.
            where = [next((j for j, p in enumerate(kept) if r is p), None) for r in leaves]
            self._vjp_def = (treedef, where)
            return (y, new_s), [r for r, j in zip(leaves, where, strict=True) if j is None]

        trace = jax.make_jaxpr(forward, return_shape=True)
        jaxpr, (out, residuals) = trace(params, state, x, key)
        self._forward = jaxpr_as_fun(jaxpr)
        self._out_def = jax.tree.structure(out)
        self.shapes: list[jax.ShapeDtypeStruct] = residuals  # one layer's residuals
        self._example = _shape((params, state, x))
        self._split: SplitBackward | None = None

    def _layer(self, w: Any, s: Any, x: Any, key: jax.Array) -> tuple[tuple[Any, Any], list]:
        out = self._forward(*jax.tree.leaves((w, s, x, key)))
        split = self._out_def.num_leaves
        return jax.tree.unflatten(self._out_def, out[:split]), list(out[split:])

    def forward(self, w: Any, s: Any, x: Any, keys: jax.Array) -> tuple[tuple[Any, Any], list]:
        """The chunk's output and its layers' new states (stacked), and its layers' residuals
        (each stacked on a leading layer axis), for its layers' parameters `w` and states `s`
        (stacked) and their `keys`."""

        def layer(h: Any, one: tuple[Any, Any, jax.Array]) -> tuple[Any, tuple]:
            (y, new_s), residuals = self._layer(*one[:2], h, one[2])
            return y, (new_s, residuals)

        y, (new_s, residuals) = lax.scan(layer, x, (w, s, keys))
        return (y, new_s), residuals

    def _layer_grads(self, inputs: tuple[Any, Any, list[jax.Array]], dy: Any) -> tuple[Any, Any]:
        """One layer's (parameter gradients, input gradient) from its parameters, state and
        kept residuals, and its output's cotangent `dy`."""
        treedef, where = self._vjp_def
        w_l, s_l, kept = inputs
        params, stored = jax.tree.leaves((w_l, s_l)), iter(kept)
        leaves = [next(stored) if j is None else params[j] for j in where]
        return jax.tree.unflatten(treedef, leaves)(dy)

    def split(self) -> SplitBackward:
        """A layer's backward cut into B and W (traced once, when first asked for)."""
        if self._split is None:
            w, s, x = self._example
            self._split = SplitBackward(self._layer_grads, (w, s, self.shapes), x)
        return self._split

    def carry_homes(self) -> list[int | None]:
        """Per leaf of the split backward's carry, the residual B overwrites with it: one that W
        does not read (dead once B has run) of its shape and dtype; None where there is none
        (the carry buffer keeps it). Where B frees enough, W's carry costs nothing beyond the
        residuals, as Qi et al.'s ZB-H1 keeps 1F1B's peak."""
        split = self.split()
        first = len(split.read_by_weight) - len(self.shapes)  # the residuals follow w and s
        free = [j for j in range(len(self.shapes)) if not split.read_by_weight[first + j]]
        homes: list[int | None] = []
        for carried in split.carry_shapes:
            like = (carried.shape, carried.dtype)
            home = next(
                (j for j in free if (self.shapes[j].shape, self.shapes[j].dtype) == like), None
            )
            if home is not None:
                free.remove(home)
            homes.append(home)
        return homes

    def backward(
        self,
        w: Any,
        s: Any,
        residuals: list[jax.Array],
        dy: Any,
        grads: Any,
        at: jax.Array,
        running: jax.Array,
    ) -> tuple[Any, Any]:
        """The chunk's backward from its `residuals` and its output's cotangent `dy`: `grads`
        (an accumulator [chunks, layers per chunk, ...]) with each layer's parameter gradient
        added at ``[at, layer]`` in its dtype, and the cotangent of the chunk's input. Where
        `running` is false nothing is computed: zeros are added and returned."""

        def layer(carry: tuple[Any, Any], one: tuple) -> tuple[tuple[Any, Any], None]:
            dy, grads = carry
            index, w_l, s_l, kept = one
            zeros = lambda *_: jax.tree.map(jnp.zeros_like, (w_l, dy))  # noqa: E731
            dw, dx = lax.cond(running, self._layer_grads, zeros, (w_l, s_l, kept), dy)
            add = lambda g, d: g.at[at, index].add(d.astype(g.dtype))  # noqa: E731
            return (dx, jax.tree.map(add, grads, dw)), None

        size = jax.tree.leaves(w)[0].shape[0]
        steps = (jnp.arange(size), w, s, residuals)
        (dx, grads), _ = lax.scan(layer, (dy, grads), steps, reverse=True)
        return grads, dx

    def backward_input(
        self, w: Any, s: Any, residuals: list[jax.Array], dy: Any, running: jax.Array
    ) -> tuple[Any, list[jax.Array]]:
        """B: the cotangent of the chunk's input, and each layer's carry for its W (stacked on
        a leading layer axis), from the layers' `residuals` and the output's cotangent `dy`.
        Where `running` is false nothing is computed: zeros are returned."""
        split = self.split()

        def layer(dy: Any, one: tuple) -> tuple[Any, list[jax.Array]]:
            w_l, s_l, kept = one
            zeros = lambda *_: (jax.tree.map(jnp.zeros_like, dy), _zeros(split.carry_shapes))  # noqa: E731
            return lax.cond(running, split.input_grad, zeros, (w_l, s_l, kept), dy)

        dx, carries = lax.scan(layer, dy, (w, s, residuals), reverse=True)
        return dx, carries

    def backward_weight(
        self,
        w: Any,
        s: Any,
        residuals: list[jax.Array],
        carries: list[jax.Array],
        grads: Any,
        at: jax.Array,
        running: jax.Array,
    ) -> Any:
        """W: `grads` (an accumulator [chunks, layers per chunk, ...]) with each layer's
        parameter gradients, from its residuals and the carry its B made, added at
        ``[at, layer]``. Where `running` is false zeros are added."""
        split = self.split()

        def layer(grads: Any, one: tuple) -> tuple[Any, None]:
            index, w_l, s_l, kept, carry = one
            zeros = lambda *_: jax.tree.map(jnp.zeros_like, w_l)  # noqa: E731
            dw = lax.cond(running, split.weight_grad, zeros, (w_l, s_l, kept), carry)
            add = lambda g, d: g.at[at, index].add(d.astype(g.dtype))  # noqa: E731
            return jax.tree.map(add, grads, dw), None

        size = jax.tree.leaves(w)[0].shape[0]
        grads, _ = lax.scan(layer, grads, (jnp.arange(size), w, s, residuals, carries))
        return grads


def _zeros(shapes: list[jax.ShapeDtypeStruct]) -> list[jax.Array]:
    return [jnp.zeros(a.shape, a.dtype) for a in shapes]
