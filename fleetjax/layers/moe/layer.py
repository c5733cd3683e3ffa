"""Paddle's ``MoELayer`` (``paddle.incubate.distributed.models.moe``) as a flax nnx module, with
Megatron-Core's and MaxText's options.

``MoELayer(d_model, experts, gate, moe_group, mp_group, recompute_interval, recompute_ctx)``
takes Paddle's arguments:

* ``experts``: *every* expert of the layer, a list of nnx modules of one shape (Paddle passes
  each rank its own experts, ``E = len(experts) x moe_group.nranks``); they are stacked into
  one module whose parameters have a leading ``"expert"`` dimension (`stack_experts`), split
  over the expert mesh axes;
* ``gate``: a dict ``{"type": "naive" | "gshard" | "switch", "top_k": k}`` (Paddle's; default
  ``"gshard"``, top-2), ``{"type": "topk", "top_k": k, ...}`` (a `TopKRouter`, the other keys
  its keyword arguments), or a gate module (`BaseGate`: Paddle's gates, `TopKRouter`, your own);
* ``moe_group``: Paddle's communication group of the expert ranks; here the mesh axis name(s)
  the experts split over (``"ep"``, or a tuple such as ``("ep", "mp")``). None: where the rules
  put the logical ``"expert"`` (``"ep"`` by default);
* ``mp_group``: Paddle's tensor-parallel group, whose ranks each dispatch a slice of the
  tokens and gather the outputs back; here mesh axis name(s), accepted for Paddle's calls: the
  layer splits the tokens over every mesh axis they are whole on (this one too), so that no
  two devices dispatch the same token;
* ``recompute_interval > 0``: the experts' activations are recomputed in the backward pass
  (``jax.checkpoint``); ``recompute_ctx``'s ``offload`` and ``partition`` have no effect and
  warn (its ``mp_group`` is the mesh's business).

`MoELayer.__call__` is Paddle's ``forward``: it returns the output and records the call's
`MoEStats` (the weighted auxiliary losses, the expert load, MaxVio, dropped assignments) with
``self.sow(MoEAux, "stats", ...)``; ``nnx.capture(model, MoEAux)`` collects them and `moe_aux`
adds them up. `MoELayer.call_with_stats` returns them instead, for pure functions (a
``jax.checkpoint`` body). The gate's own loss is also Paddle's ``layer.gate.get_loss()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax._warnings import warn_once
from fleetjax.layers._params import check_sizes
from fleetjax.layers.moe import dispatch as dispatch_
from fleetjax.layers.moe.experts import has_grouped, stack_experts
from fleetjax.layers.moe.gates import GShardGate, NaiveGate, SwitchGate
from fleetjax.layers.moe.losses import MoEAux, MoEStats, max_violation
from fleetjax.layers.moe.router import TopKRouter
from fleetjax.layers.moe.routing import BaseGate, RngsLike, expert_counts

__all__ = ["GATES", "MoELayer"]

# Paddle's gate types (None is "naive", as Paddle reads it), and fleetjax's router.
GATES = ("naive", "gshard", "switch", "topk")
_RECOMPUTE_CTX = ("mp_group", "offload", "partition")
# How the tokens of a [batch, sequence, d_model] or [tokens, d_model] input are split.
_TOKENS = {3: ("activation_batch", "activation_length"), 2: ("activation_batch",)}


class MoELayer(nnx.Module):
    """A mixture-of-experts layer: each token goes to the ``k`` experts its gate picks, and its
    output is their outputs weighted by the gate (see the module docstring for Paddle's
    arguments).

    Args:
      d_model: the model width.
      experts: every expert, nnx modules of one shape (`ExpertMLP` runs as a grouped matmul;
        other modules run tile by tile).
      gate: a dict (Paddle's, or ``"topk"``), a `BaseGate`, or None (``{"type": "gshard"}``).
      moe_group: the expert mesh axes (a name or tuple of names); None: the rules' ``"expert"``.
      mp_group: mesh axes (a name or tuple); the tokens split over every axis anyway.
      recompute_interval: > 0 recomputes the experts' activations in the backward pass.
      recompute_ctx: Paddle's recompute context (``mp_group``, ``offload``, ``partition``).
      shared_expert: a module every token also goes through, added to the output (DeepSeek's
        and Qwen's shared experts, Megatron's ``--moe-shared-expert-intermediate-size``).
      dispatcher: ``"alltoall"`` or ``"allgather"`` (`Dispatch`).
      capacity_factor: None for dropless, else the experts' capacity (`Dispatch`).
      drop_policy: ``"probs"`` or ``"position"``: which assignments an expert over capacity
        keeps.
      buffer: dropless's receive buffer over the balanced size, less 1 (0.25: 25% more).
      grouped_gemm: the experts' grouped matmul where their class has one; False: the tile loop.
      rngs: keys for a gate built from a dict.

    Attributes:
      gate: the gate module.
      experts: the experts, stacked: parameters ``[E, ...]``, logical ``("expert", ...)``.
      num_expert: ``E``.
      top_k: ``k``.
    """

    def __init__(
        self,
        d_model: int,
        experts: Sequence[nnx.Module],
        gate: dict[str, Any] | BaseGate | None = None,
        moe_group: str | Sequence[str] | None = None,
        mp_group: str | Sequence[str] | None = None,
        recompute_interval: int = 0,
        recompute_ctx: dict[str, Any] | None = None,
        *,
        shared_expert: nnx.Module | None = None,
        dispatcher: str = "alltoall",
        capacity_factor: float | None = None,
        drop_policy: str = "probs",
        buffer: float = 0.25,
        grouped_gemm: bool = True,
        rngs: nnx.Rngs | None = None,
    ) -> None:
        check_sizes("MoELayer", d_model=d_model)
        self.d_model = d_model
        self.experts = stack_experts(experts)
        self.num_expert = len(experts)
        self.gate = _gate(gate, d_model, self.num_expert, rngs)
        if self.gate.tot_expert != self.num_expert:
            raise ValueError(
                f"MoELayer: the gate routes to {self.gate.tot_expert} experts (num_expert x "
                f"world_size) but experts has {self.num_expert}: give the layer all its experts"
            )
        self.top_k = self.gate.top_k
        self.moe_group = _mesh_axes("moe_group", moe_group)
        self.mp_group = _mesh_axes("mp_group", mp_group) or ()
        if not isinstance(recompute_interval, int) or recompute_interval < 0:
            raise ValueError(
                f"MoELayer: recompute_interval must be an int >= 0, got {recompute_interval!r}"
            )
        _check_recompute_ctx(recompute_ctx)
        self.shared_expert = shared_expert
        self.dispatch = dispatch_.Dispatch(
            dispatcher,
            capacity_factor,
            drop_policy,
            buffer,
            grouped_gemm,
            recompute=recompute_interval > 0,
        )

    def __call__(self, inp: jax.Array, *, rngs: RngsLike = None) -> jax.Array:
        """Paddle's ``forward``: the layer's output for `inp` ``[batch, seq, d_model]`` (or
        ``[tokens, d_model]``); under ``nnx.capture`` the call's `MoEStats` are sown as `MoEAux`
        ``"stats"``."""
        out, stats = self.call_with_stats(inp, rngs=rngs)
        # Only under nnx.capture (which gives modules their captures): elsewhere flax's sow is
        # deprecated and would add the stats to the module's state, changing its structure.
        if hasattr(self, "__captures__"):
            self.sow(MoEAux, "stats", stats)
        return out

    def call_with_stats(
        self, inp: jax.Array, *, rngs: RngsLike = None
    ) -> tuple[jax.Array, MoEStats]:
        """The layer's output for `inp` and the call's `MoEStats`, sowing nothing.

        Raises:
          ValueError: for an input that is not ``[..., d_model]`` of rank 2 or 3, experts the
            expert axes do not divide, or tokens the dispatch's axes do not divide.
        """
        if inp.ndim not in _TOKENS or inp.shape[-1] != self.d_model:
            raise ValueError(
                f"MoELayer takes [batch, seq, d_model] or [tokens, d_model] with d_model="
                f"{self.d_model}, got shape {inp.shape}"
            )
        grouped = self.dispatch.grouped_gemm and has_grouped(self.experts)
        where = dispatch_.layout(
            self.experts, self.num_expert, _TOKENS[inp.ndim], self.moe_group, grouped
        )
        tokens = dispatch_.split_tokens(inp.reshape(-1, self.d_model), where)
        sequences = inp.shape[0] if inp.ndim == 3 else 1
        routing = self.gate.route(tokens, sequences=sequences, rngs=rngs)
        per_assignment, dropped, rounds = dispatch_.dispatch(
            self.experts, tokens, routing.experts, routing.weights, where, self.dispatch
        )
        out = jnp.einsum("tk,tkh->th", routing.weights.astype(per_assignment.dtype), per_assignment)
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        counts = expert_counts(routing.experts, self.num_expert)
        gate_dropped = jnp.sum(routing.experts < 0).astype(jnp.int32)
        stats = MoEStats(
            loss=sum(routing.losses.values(), jnp.zeros((), jnp.float32)),
            losses=routing.losses,
            tokens_per_expert=counts,
            max_violation=max_violation(counts),
            dropped=gate_dropped + dropped,
            rounds=rounds,
        )
        out = dispatch_.join_tokens(out.astype(inp.dtype), where)
        return out.reshape(inp.shape), stats

    def expert(self, index: int) -> nnx.Module:
        """Expert `index` as a module of its own (a copy of its parameters)."""
        graphdef, state = nnx.split(self.experts)
        return nnx.merge(graphdef, jax.tree.map(lambda v: v[index], state))


def _gate(
    gate: dict[str, Any] | BaseGate | None, d_model: int, experts: int, rngs: nnx.Rngs | None
) -> BaseGate:
    """The gate module a `MoELayer`'s ``gate`` argument asks for."""
    if isinstance(gate, BaseGate):
        return gate
    if gate is None:
        gate = {}
    if not isinstance(gate, dict):
        raise TypeError(
            "MoELayer: gate must be a dict ({'type': 'naive' | 'gshard' | 'switch' | 'topk', "
            f"'top_k': k}}), a BaseGate module or None, got {gate!r}"
        )
    options = dict(gate)
    kind = options.pop("type", "gshard")
    kind = "naive" if kind is None else kind
    if kind not in GATES:
        raise ValueError(f"MoELayer: gate['type'] must be one of {GATES} or None, got {kind!r}")
    top_k = options.pop("top_k", 2)
    if kind != "topk" and options:
        raise ValueError(
            f"MoELayer: a {kind!r} gate takes the keys 'type' and 'top_k' only, got "
            f"{sorted(options)}"
        )
    if rngs is None:
        raise ValueError(f"MoELayer: building its {kind!r} gate needs rngs=nnx.Rngs(...)")
    if isinstance(top_k, int) and top_k > experts:
        raise ValueError(f"MoELayer: gate top_k={top_k} is more than the {experts} experts")
    if kind == "topk":
        return TopKRouter(d_model, experts, top_k, rngs=rngs, **options)
    paddle = {"naive": NaiveGate, "gshard": GShardGate, "switch": SwitchGate}[kind]
    return paddle(d_model, experts, 1, top_k, rngs=rngs)


def _mesh_axes(name: str, axes: Any) -> tuple[str, ...] | None:
    if axes is None:
        return None
    if isinstance(axes, str):
        return (axes,)
    if isinstance(axes, (tuple, list)) and axes and all(isinstance(a, str) for a in axes):
        return tuple(axes)
    raise TypeError(
        f"MoELayer: {name} must be mesh axis names (a name such as 'ep' or a tuple of names): "
        f"the ranks of Paddle's communication group are the mesh axes they span; got {axes!r}"
    )


def _check_recompute_ctx(ctx: dict[str, Any] | None) -> None:
    if ctx is None:
        return
    if not isinstance(ctx, dict) or set(ctx) - set(_RECOMPUTE_CTX):
        raise ValueError(
            f"MoELayer: recompute_ctx must be a dict with keys from {_RECOMPUTE_CTX}, got {ctx!r}"
        )
    for key in ("offload", "partition"):
        if ctx.get(key):
            warn_once(
                f"MoELayer: recompute_ctx[{key!r}] has no effect: the experts' inputs stay on "
                "the device, split as the dispatch splits them (offload a whole layer's "
                "activations with fleetjax.recompute's offload)"
            )
