"""A layer's backward pass cut in two, for the zero-bubble schedules (Qi et al. 2023): B, the
gradient of the layer's input, which the previous stage waits for, and W, the gradient of its
weights, which can wait.

The backward (the layer's `jax.vjp`, traced once) is a jaxpr from the layer's parameters, its
kept residuals and the cotangent of its output to the gradients of its parameters and input.
Its calls (`jit`, `jax.checkpoint`'s recomputation, ...) are inlined, and the equations are
sorted by what needs them: B is every equation the input's gradient needs, W every other one
that the parameters' gradients need. What W reads that B computed (each matmul's output
gradient and, under recompute, the recomputed matmul inputs) is B's second output, the *carry*
that the pipeline keeps from B's tick to W's; W reads the parameters and the kept residuals
itself. So W is the weight-gradient matmuls (and the bias and LayerNorm sums), and nothing is
computed twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, Literal

# Call primitives whose bodies are inlined, so that B and W can take their parts of them.
_INLINED = ("jit", "pjit", "remat2", "checkpoint", "closed_call", "core_call", "custom_jvp_call")


class _Eqn(NamedTuple):
    """An equation (a `JaxprEqn`) with its variables renamed to keys unique in the inlined
    program."""

    eqn: Any
    ins: tuple[Any, ...]  # keys, or Literals
    outs: tuple[Any, ...]  # keys, or None for a dropped output


class _Inliner:
    """Flattens a jaxpr into `_Eqn`s, inlining calls, each inlined body's variables keyed by
    (a fresh scope, the variable)."""

    def __init__(self) -> None:
        self.eqns: list[_Eqn] = []
        self.consts: dict[Any, Any] = {}
        self._scopes = itertools.count(1)

    def add(self, jaxpr: Jaxpr, ins: Sequence[Any], scope: int = 0) -> list[Any]:
        """Inline `jaxpr` with its invars bound to `ins` (keys or Literals); its out keys."""
        bound = dict(zip([(scope, v) for v in jaxpr.invars], ins, strict=True))

        def name(v: Any) -> Any:
            return v if isinstance(v, Literal) else bound.get((scope, v), (scope, v))

        for eqn in jaxpr.eqns:
            ins_ = tuple(name(v) for v in eqn.invars)
            body = _body(eqn)
            if body is not None and eqn.primitive.name in _INLINED:
                inner, consts = body
                inner_scope = next(self._scopes)
                for var, value in zip(inner.constvars, consts, strict=True):
                    self.consts[inner_scope, var] = value
                outs = self.add(inner, ins_, inner_scope)
                for out, var in zip(outs, eqn.outvars, strict=True):
                    if not isinstance(var, DropVar):
                        bound[scope, var] = out
                continue
            outs_ = tuple(None if isinstance(v, DropVar) else (scope, v) for v in eqn.outvars)
            self.eqns.append(_Eqn(eqn, ins_, outs_))
        return [name(v) for v in jaxpr.outvars]


def _body(eqn: Any) -> tuple[Jaxpr, Sequence[Any]] | None:
    """The body of a call equation (its jaxpr and constants), or None."""
    for param in ("jaxpr", "call_jaxpr"):
        body = eqn.params.get(param)
        if isinstance(body, ClosedJaxpr):
            return body.jaxpr, body.consts
        if isinstance(body, Jaxpr):
            return body, ()
    return None


def _needed(eqns: Sequence[_Eqn], outs: Iterable[Any]) -> set[int]:
    """The indices of the equations that `outs` (keys) depend on, and of those with effects."""
    live = {k for k in outs if not isinstance(k, Literal)}
    needed = set()
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        if eqn.eqn.effects or live.intersection(k for k in eqn.outs if k is not None):
            needed.add(i)
            live.update(k for k in eqn.ins if not isinstance(k, Literal))
    return needed


def _run(eqns: Iterable[_Eqn], env: dict[Any, Any], outs: Sequence[Any]) -> list[Any]:
    """Evaluate `eqns` in `env` (keys -> values) and read `outs`."""
    read = lambda k: k.val if isinstance(k, Literal) else env[k]  # noqa: E731
    for eqn in eqns:
        primitive = eqn.eqn.primitive
        with eqn.eqn.ctx.manager:  # as jax's own eval_jaxpr binds it
            values = primitive.bind(
                *map(read, eqn.ins), **primitive.get_bind_params(eqn.eqn.params)
            )
        values = values if primitive.multiple_results else [values]
        for key, value in zip(eqn.outs, values, strict=True):
            if key is not None:
                env[key] = value
    return [read(k) for k in outs]


class SplitBackward:
    """``backward(inputs, cotangents) -> (weight gradients, input gradients)``, traced once at
    example arguments and cut into `input_grad` (B) and `weight_grad` (W)."""

    def __init__(self, backward: Callable[..., Any], inputs: Any, cotangents: Any) -> None:
        """`backward(inputs, cotangents)` returns ``(weight_grads, input_grads)``, pytrees;
        `inputs` (parameters, residuals: what both halves may read) and `cotangents` are
        example values or `jax.ShapeDtypeStruct`s."""
        closed, shapes = jax.make_jaxpr(backward, return_shape=True)(inputs, cotangents)
        self._weights_def, self._inputs_def = (jax.tree.structure(s) for s in shapes)
        self._in_def = jax.tree.structure(inputs)
        flat = _Inliner()
        invars = [(0, v) for v in closed.jaxpr.invars]
        for var, value in zip(closed.jaxpr.constvars, closed.consts, strict=True):
            flat.consts[0, var] = value
        outs = flat.add(closed.jaxpr, invars)
        self._eqns, self._consts = flat.eqns, flat.consts
        self._inputs = invars[: self._in_def.num_leaves]
        cotangent_keys = set(invars[self._in_def.num_leaves :])
        self._invars = invars
        count = self._weights_def.num_leaves
        self._weight_outs, self._input_outs = outs[:count], outs[count:]
        b = _needed(self._eqns, self._input_outs)
        w = _needed(self._eqns, self._weight_outs) - b
        self._b = [e for i, e in enumerate(self._eqns) if i in b]
        self._w = [e for i, e in enumerate(self._eqns) if i in w]
        made_by_b = {k for e in self._b for k in e.outs if k is not None} | cotangent_keys
        read_by_w = [
            k
            for k in [*(k for e in self._w for k in e.ins), *self._weight_outs]
            if not isinstance(k, Literal)
        ]
        self._carry = list(dict.fromkeys(k for k in read_by_w if k in made_by_b))
        self.carry_shapes = [
            jax.ShapeDtypeStruct(k[1].aval.shape, k[1].aval.dtype) for k in self._carry
        ]
        # Per leaf of `inputs`: whether W reads it (else only B does: dead once B has run).
        read = set(read_by_w)
        self.read_by_weight = [k in read for k in self._inputs]

    def input_grad(self, inputs: Any, cotangents: Any) -> tuple[Any, list[jax.Array]]:
        """B: the input gradients, and the carry (a list) that `weight_grad` needs."""
        env = {
            **self._consts,
            **dict(zip(self._invars, jax.tree.leaves((inputs, cotangents)), strict=True)),
        }
        values = _run(self._b, env, [*self._input_outs, *self._carry])
        count = len(self._input_outs)
        return jax.tree.unflatten(self._inputs_def, values[:count]), values[count:]

    def weight_grad(self, inputs: Any, carry: Sequence[jax.Array]) -> Any:
        """W: the weight gradients, from the `inputs` and the carry `input_grad` made."""
        env = {**self._consts, **dict(zip(self._inputs, jax.tree.leaves(inputs), strict=True))}
        env.update(zip(self._carry, carry, strict=True))
        return jax.tree.unflatten(self._weights_def, _run(self._w, env, self._weight_outs))
