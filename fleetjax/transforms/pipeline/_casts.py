"""Parameters cast once per step: the narrowing casts a model part makes of its parameters.

Under AMP a part converts a float32 weight to bfloat16 (or float16) before each matmul that uses
it; in a pipeline that happens in every tick, for every micro-batch and again when the backward
pass recomputes the layer. `narrowing_casts` reads, from the part's jaxpr, which parameters are
converted to one narrower float dtype before every use, so that the pipeline casts those once
per step and runs its ticks on the half-precision copies. The values are the same (the part
would have cast them anyway); the gradient of a copy is converted back to the parameter's
dtype before it is accumulated, as the cast's own transpose would.

No maintained library reads this from a jaxpr, so it is written here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Jaxpr, Literal
from jax.extend.core.primitives import (
    closed_call_p,
    convert_element_type_p,
    jit_p,
    remat_p,
    scan_p,
)

# Operations whose sub-jaxpr takes the operation's operands one to one, in order.
_PASS_THROUGH = {remat_p: "jaxpr", closed_call_p: "call_jaxpr", jit_p: "jaxpr", scan_p: "jaxpr"}


def narrowing_casts(fn: Callable[..., Any], params: Any, *rest: Any) -> Any:
    """For each leaf of `params`: the narrower float dtype that ``fn(params, *rest)`` converts
    it to before every use (through `jax.checkpoint`, `lax.scan` and nested jits), or None
    where it uses the leaf otherwise (or not at all). `params` and `rest` may be abstract."""
    flat, treedef = jax.tree.flatten(params)
    closed = jax.make_jaxpr(lambda p, *r: fn(jax.tree.unflatten(treedef, p), *r))(flat, *rest)
    targets = _targets(closed.jaxpr)[: len(flat)]
    return jax.tree.unflatten(
        treedef,
        [
            t if t is not None and _narrower(t, x.dtype) else None
            for t, x in zip(targets, flat, strict=True)
        ],
    )


def cast(params: Any, dtypes: Any) -> Any:
    """`params` with each leaf converted to its dtype in `dtypes` (None: as it is)."""
    return jax.tree.map(lambda x, d: x if d is None else x.astype(d), params, dtypes)


def _narrower(target: Any, dtype: Any) -> bool:
    floating = jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(target, jnp.floating)
    return floating and jnp.dtype(target).itemsize < jnp.dtype(dtype).itemsize


def _targets(jaxpr: Jaxpr) -> list[Any]:
    """Per input variable of `jaxpr`: the one dtype every use converts it to, else None."""
    found: dict[Any, set] = {v: set() for v in jaxpr.invars}
    for v in jaxpr.outvars:
        if not isinstance(v, Literal) and v in found:
            found[v].add(None)  # returned as it is
    for eqn in jaxpr.eqns:
        inner = _sub_jaxpr(eqn)
        inner_targets = _targets(inner) if inner is not None else None
        for i, v in enumerate(eqn.invars):
            if isinstance(v, Literal) or v not in found:
                continue
            if eqn.primitive is convert_element_type_p:
                found[v].add(jnp.dtype(eqn.params["new_dtype"]))
            elif inner_targets is not None and not _is_carry(eqn, i):
                found[v].add(inner_targets[i])
            else:
                found[v].add(None)
    return [next(iter(t)) if len(t) == 1 else None for t in (found[v] for v in jaxpr.invars)]


def _is_carry(eqn: Any, i: int) -> bool:
    """Whether operand `i` of a `lax.scan` is a loop carry (its body gives it a new value)."""
    if eqn.primitive is not scan_p:
        return False
    consts = eqn.params["num_consts"]
    return consts <= i < consts + eqn.params["num_carry"]


def _sub_jaxpr(eqn: Any) -> Jaxpr | None:
    """The jaxpr an operation runs on its operands one to one, if it is one of those."""
    name = _PASS_THROUGH.get(eqn.primitive)
    if name is None:
        return None
    inner = eqn.params[name]
    inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's
    return inner if len(inner.invars) == len(eqn.invars) else None
