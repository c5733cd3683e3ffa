"""Automatic mixed precision (Paddle's `amp`, `amp_configs`): per-operation casting and dynamic
loss scaling.

`autocast(fn, policy)` re-runs `fn` operation by operation (a jaxpr interpreter; no maintained
JAX library casts per operation, so this is written here): operations on the white list run in
float16/bfloat16, those on the black list in float32, and the rest ("gray") follow their inputs
(O1) or run in half precision too (O2).
Lists hold JAX primitive names; Paddle's operator names are translated by `PADDLE_OPS` (the
table is in docs/amp.md). By default `dot_general` and `conv_general_dilated` are white and the
black list is the primitives of Paddle's default black operators (exponentials, logarithms,
reductions, powers, cumulative and hyperbolic functions), so softmax, layer norm and losses run
in float32. Operations called through `jax.custom_jvp`/`custom_vjp` functions (such as
`jax.nn.relu`) run at the dtypes they were written for; a custom function written for mixed
precision asks `fleetjax.layers.precision.traced_dtype` while it is traced and casts its
inputs itself.

Loss scaling, the other half of Paddle's AMP, is `fleetjax.transforms.loss_scale`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax import lax
from jax.extend.core.primitives import remat_p

from fleetjax.layers.precision import tracing

PADDLE_OPS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        (
            "matmul",
            "matmul_v2",
            "mul",
            "linear_v2",
            "einsum",
            "bmm",
            "fused_gemm_epilogue",
            "fused_attention",
            "fused_feedforward",
            "flash_attn",
        ),
        ("dot_general",),
    ),
    **dict.fromkeys(
        ("conv2d", "conv3d", "depthwise_conv2d", "conv2d_transpose", "conv3d_transpose"),
        ("conv_general_dilated",),
    ),
    "exp": ("exp", "exp2"),
    "expm1": ("expm1",),
    **dict.fromkeys(("log", "log2", "log10"), ("log",)),
    "log1p": ("log1p",),
    "square": ("integer_pow", "square"),
    "pow": ("pow", "integer_pow"),
    "sqrt": ("sqrt",),
    "rsqrt": ("rsqrt",),
    **dict.fromkeys(("mean", "reduce_mean", "sum", "reduce_sum"), ("reduce_sum",)),
    "reduce_prod": ("reduce_prod",),
    "reduce_max": ("reduce_max",),
    "reduce_min": ("reduce_min",),
    "cumsum": ("cumsum",),
    "cumprod": ("cumprod",),
    **dict.fromkeys(
        (
            "softmax",
            "log_softmax",
            "softmax_with_cross_entropy",
            "cross_entropy",
            "cross_entropy2",
            "c_softmax_with_cross_entropy",
            "sigmoid_cross_entropy_with_logits",
        ),
        ("exp", "log", "log1p", "reduce_sum", "reduce_max"),
    ),
    "layer_norm": ("reduce_sum", "rsqrt"),
    "tanh": ("tanh",),
    "sigmoid": ("logistic",),
    "relu": ("max",),
    "gelu": ("erf", "tanh"),
    **{name: (name,) for name in ("sin", "cos", "tan", "sinh", "cosh", "asin", "acos", "atanh")},
    "erf": ("erf",),
    "erfinv": ("erf_inv",),
    **dict.fromkeys(("lookup_table", "lookup_table_v2"), ("gather",)),
    "scatter": ("scatter", "scatter-add"),
}

DEFAULT_WHITE = frozenset({"dot_general", "conv_general_dilated"})
DEFAULT_BLACK = frozenset(
    {
        "exp",
        "exp2",
        "expm1",
        "log",
        "log1p",
        "reduce_sum",
        "reduce_prod",
        "reduce_max",
        "reduce_min",
        "cumsum",
        "cumprod",
        "cumlogsumexp",
        "rsqrt",
        "pow",
        "integer_pow",
        "square",
        "erf_inv",
        "tan",
        "sinh",
        "cosh",
        "asin",
        "acos",
        "atanh",
    }
)
GUARD_SCOPE = "fleetjax_fp16_guard"
_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call"})
_HALF = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}


def _primitive_names() -> frozenset[str]:
    prims = vars(jex.core.primitives).values()
    return frozenset(p.name for p in prims if isinstance(p, jex.core.Primitive))


def _expand(names: Iterable[str], label: str) -> dict[str, frozenset[str]]:
    """Each list entry (a Paddle operator or a JAX primitive name) and its primitives."""
    known = _primitive_names()
    out = {}
    for name in names:
        if name in PADDLE_OPS:
            out[name] = frozenset(PADDLE_OPS[name])
        elif name in known:
            out[name] = frozenset({name})
        else:
            raise ValueError(
                f"{label} entry {name!r} is neither a Paddle operator fleetjax maps (see "
                "fleetjax.transforms.amp.PADDLE_OPS) nor a JAX primitive name"
            )
    return out


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which primitives run in which precision.

    Attributes:
      dtype: the half-precision dtype (float16 or bfloat16).
      level: "O1" (white ops in half, gray ops follow their inputs) or "O2" (parameters and
        every non-black op in half).
      white, black: JAX primitive names run in half / float32.
      black_names: names given with `checkpoint_name` whose values, and the operations that
        consume them, stay float32 (Paddle's `custom_black_varnames`).
      guard: only operations inside `fp16_guard()` scopes use half precision
        (Paddle's `use_fp16_guard`).
      promote: O1 gray operations with mixed inputs run in the widest dtype (Paddle's
        `use_promote`); if False, in half precision.
    """

    dtype: Any
    level: str = "O1"
    white: frozenset[str] = DEFAULT_WHITE
    black: frozenset[str] = DEFAULT_BLACK
    black_names: frozenset[str] = frozenset()
    guard: bool = False
    promote: bool = True


def policy(
    dtype: str = "float16",
    level: str = "O1",
    custom_white_list: Sequence[str] = (),
    custom_black_list: Sequence[str] = (),
    custom_black_varnames: Sequence[str] = (),
    use_guard: bool = False,
    promote: bool = True,
) -> Policy:
    """A `Policy` from Paddle's `amp_configs` terms.

    Custom white entries move operators from the black list to the white list, custom black
    entries the other way. Raises `ValueError` for an unknown dtype, level or operator, and when
    the two custom lists name the same operator or primitive (as Paddle does).
    """
    if dtype not in _HALF:
        raise ValueError(f"dtype must be one of {', '.join(_HALF)}, got {dtype!r}")
    level = level.upper()
    if level not in ("O1", "O2"):
        raise ValueError(f"level must be 'O1' or 'O2', got {level!r}")
    white = _expand(custom_white_list, "custom_white_list")
    black = _expand(custom_black_list, "custom_black_list")
    for w, w_prims in white.items():
        for b, b_prims in black.items():
            if w == b or w_prims & b_prims:
                shared = ", ".join(sorted(w_prims & b_prims)) or w
                raise ValueError(
                    f"The given custom_white_list overlaps custom_black_list with < {w} > "
                    f"and < {b} > (JAX primitives: {shared})"
                )
    white_prims = frozenset().union(*white.values()) if white else frozenset()
    black_prims = frozenset().union(*black.values()) if black else frozenset()
    return Policy(
        dtype=_HALF[dtype],
        level=level,
        white=(DEFAULT_WHITE - black_prims) | white_prims,
        black=(DEFAULT_BLACK - white_prims) | black_prims,
        black_names=frozenset(custom_black_varnames),
        guard=use_guard,
        promote=promote,
    )


# Whether the code being traced runs inside fp16_guard().
_IN_GUARD: contextvars.ContextVar[bool] = contextvars.ContextVar("amp_guard", default=False)


@contextlib.contextmanager
def fp16_guard() -> Iterator[None]:
    """Mark the operations traced inside as the ones to run in half precision when the policy
    has `guard=True` (Paddle's `paddle.static.amp.fp16_guard`)."""
    token = _IN_GUARD.set(True)
    try:
        with jax.named_scope(GUARD_SCOPE):
            yield
    finally:
        _IN_GUARD.reset(token)


def _dtype_for(policy: Policy, primitive: str) -> Any | None:
    """The dtype `policy` runs `primitive` at on float32 inputs, where the code being traced
    is (`fleetjax.layers.precision.traced_dtype`), or None where it keeps its inputs'."""
    if (policy.guard and not _IN_GUARD.get()) or primitive in policy.black:
        return None
    return policy.dtype if primitive in policy.white or policy.level == "O2" else None


# -- the interpreter ---------------------------------------------------------------------------
def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _traced_mesh(eqn: Any) -> contextlib.AbstractContextManager[Any]:
    """The mesh context `eqn` was traced under, where it differs from the current one.

    On `Explicit` meshes jnp runs some operations (a gather with ``out_sharding``) inside
    `jax.sharding.auto_axes`, on values retyped to `Auto` axes; a jaxpr keeps the types but not
    the context, so re-binding such an operation needs it back.
    """
    current = jax.sharding.get_abstract_mesh()
    for var in eqn.invars:
        mesh = getattr(getattr(var.aval, "sharding", None), "mesh", None)
        if mesh is not None and not mesh.empty and mesh != current:
            return jax.sharding.use_abstract_mesh(mesh)
    return contextlib.nullcontext()


def _cast(x: Any, dtype: Any) -> Any:
    if not _is_float(x) or jnp.result_type(x) == dtype:
        return x
    return lax.convert_element_type(x, dtype)


class _Interpreter:
    """Evaluates a jaxpr, re-emitting each operation at the precision the policy gives it."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.guard_seen = False

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        black: set[Any] = set()  # vars holding values named in black_names

        def read(v: Any) -> Any:
            return v.val if isinstance(v, jex.core.Literal) else env[v]

        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = value
        for var, value in zip(jaxpr.invars, args, strict=True):
            env[var] = value
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            keep_f32 = any(not isinstance(v, jex.core.Literal) and v in black for v in eqn.invars)
            if eqn.primitive.name == "name" and eqn.params["name"] in self.policy.black_names:
                keep_f32 = True
                black.update(eqn.outvars)
            outs = self._apply(eqn, ins, keep_f32)
            for var, value in zip(eqn.outvars, outs, strict=True):
                if not isinstance(var, jex.core.DropVar):
                    env[var] = value
        return [read(v) for v in jaxpr.outvars]

    def _apply(self, eqn: Any, ins: list[Any], keep_f32: bool) -> list[Any]:
        name, params = eqn.primitive.name, eqn.params
        if name in _CALLS:
            closed = params["jaxpr"]
            return self.run(closed.jaxpr, closed.consts, ins)
        if eqn.primitive is remat_p:  # jax.checkpoint (named "remat2" in recent JAX)
            fn = jax.checkpoint(
                lambda *a: self.run(params["jaxpr"], (), a),
                prevent_cse=params["prevent_cse"],
                policy=params["policy"],
            )
            return fn(*ins)
        if name == "scan":
            return self._scan(eqn, ins)
        if name == "while":
            return self._while(eqn, ins)
        if name == "cond":
            return self._cond(eqn, ins)
        if any(jex.core.jaxprs_in_params(params)):
            # Custom-derivative and other higher-order operations run as written.
            traced = [_cast(x, v.aval.dtype) for x, v in zip(ins, eqn.invars, strict=True)]
            with _traced_mesh(eqn):
                return _as_list(_bind_as_written(eqn, traced), eqn)
        ins, params = self._cast_inputs(eqn, ins, keep_f32)
        with _traced_mesh(eqn):
            return _as_list(eqn.primitive.bind(*ins, **params), eqn)

    def _target(self, eqn: Any, ins: list[Any], keep_f32: bool) -> Any | None:
        """The dtype for this operation's float inputs, or None to leave them as they are."""
        policy, name = self.policy, eqn.primitive.name
        in_guard = GUARD_SCOPE in str(eqn.source_info.name_stack)
        self.guard_seen |= in_guard
        if policy.guard and not in_guard:
            return jnp.float32 if any(_is_float(x) for x in ins) else None
        if keep_f32 or name in policy.black:
            return jnp.float32
        if name in policy.white or policy.level == "O2":
            return policy.dtype
        strong = [
            jnp.result_type(x)
            for x, v in zip(ins, eqn.invars, strict=True)
            if _is_float(x) and not v.aval.weak_type
        ]
        if not strong:
            return None
        if not policy.promote and policy.dtype in strong:
            return policy.dtype
        # Mixed inputs run in the widest of them; weakly typed literals adopt the others' dtype.
        return jnp.result_type(*strong)

    def _cast_inputs(self, eqn: Any, ins: list[Any], keep_f32: bool) -> tuple[list[Any], dict]:
        target = self._target(eqn, ins, keep_f32)
        params = dict(eqn.params)
        if target is None:
            return ins, params
        if params.get("preferred_element_type") is not None and any(_is_float(x) for x in ins):
            params["preferred_element_type"] = jnp.dtype(target)
        return [_cast(x, target) for x in ins], params

    def _scan(self, eqn: Any, ins: list[Any]) -> list[Any]:
        p = eqn.params
        n_consts, n_carry = p["num_consts"], p["num_carry"]
        consts, carry, xs = (
            ins[:n_consts],
            ins[n_consts : n_consts + n_carry],
            ins[n_consts + n_carry :],
        )
        carry_dtypes = [v.aval.dtype for v in eqn.invars[n_consts : n_consts + n_carry]]
        body = p["jaxpr"]

        def step(c: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            outs = self.run(body.jaxpr, body.consts, [*consts, *c, *x])
            # The carry keeps its dtype from one iteration to the next.
            return [_cast(o, d) for o, d in zip(outs[:n_carry], carry_dtypes, strict=True)], outs[
                n_carry:
            ]

        init = [_cast(c, d) for c, d in zip(carry, carry_dtypes, strict=True)]
        final, ys = lax.scan(
            step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
        )
        return [*final, *ys]

    def _while(self, eqn: Any, ins: list[Any]) -> list[Any]:
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, carry = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
        dtypes = [v.aval.dtype for v in eqn.invars[nc + nb :]]
        cond, body = p["cond_jaxpr"], p["body_jaxpr"]

        def cond_fn(c: list[Any]) -> Any:
            return self.run(cond.jaxpr, cond.consts, [*cond_consts, *c])[0]

        def body_fn(c: list[Any]) -> list[Any]:
            outs = self.run(body.jaxpr, body.consts, [*body_consts, *c])
            return [_cast(o, d) for o, d in zip(outs, dtypes, strict=True)]

        return lax.while_loop(
            cond_fn, body_fn, [_cast(c, d) for c, d in zip(carry, dtypes, strict=True)]
        )

    def _cond(self, eqn: Any, ins: list[Any]) -> list[Any]:
        index, ops = ins[0], ins[1:]
        dtypes = [v.aval.dtype for v in eqn.outvars]

        def branch(closed: Any) -> Callable[..., list[Any]]:
            def fn(*args: Any) -> list[Any]:
                outs = self.run(closed.jaxpr, closed.consts, args)
                return [_cast(o, d) for o, d in zip(outs, dtypes, strict=True)]

            return fn

        return lax.switch(index, [branch(b) for b in eqn.params["branches"]], *ops)


def _bind_as_written(eqn: Any, args: list[Any]) -> Any:
    """Bind a higher-order operation from its jaxpr params, as `jax.core.eval_jaxpr` does."""
    bound = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bound, tuple):  # older JAX: (subfuns, params)
        subfuns, params = bound
        return eqn.primitive.bind(*subfuns, *args, **params)
    return eqn.primitive.bind(*args, **bound)


def _as_list(out: Any, eqn: Any) -> list[Any]:
    return list(out) if eqn.primitive.multiple_results else [out]


def autocast(fn: Callable[..., Any], policy: Policy) -> Callable[..., Any]:
    """`fn` with each operation run at the precision `policy` gives it.

    Floating outputs keep `fn`'s dtypes (a float32 loss stays float32), so gradients with
    respect to float32 parameters are float32. With `level="O2"` the parameters are cast to half
    precision inside (the float32 values stay the master weights). With `guard=True` the traced
    function must use `fp16_guard()` at least once, or nothing would be cast.
    """

    def wrapped(*args: Any) -> Any:
        flat, tree = jax.tree.flatten(args)
        with tracing(functools.partial(_dtype_for, policy)):
            closed = jax.make_jaxpr(lambda *leaves: fn(*jax.tree.unflatten(tree, leaves)))(*flat)
            out_tree = jax.tree.structure(jax.eval_shape(fn, *args))
        interpreter = _Interpreter(policy)
        outs = interpreter.run(closed.jaxpr, closed.consts, flat)
        if policy.guard and not interpreter.guard_seen:
            raise ValueError(
                "use_fp16_guard is on but the function has no fleetjax.fp16_guard() region, so "
                "nothing would run in half precision: wrap the layers to cast with "
                "fleetjax.fp16_guard(), or set use_fp16_guard=False"
            )
        outs = [_cast(o, v.aval.dtype) for o, v in zip(outs, closed.jaxpr.outvars, strict=True)]
        return jax.tree.unflatten(out_tree, outs)

    return wrapped
