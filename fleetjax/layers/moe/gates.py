"""Paddle's MoE gates (``paddle.incubate.distributed.models.moe.gate``, from FastMoE):
`NaiveGate`, `GShardGate` and `SwitchGate`, at Paddle 3.3.1's formulas.

All three score a token with a linear layer with a bias (``weight [d_model, tot_expert]``,
Paddle's ``gate.weight`` / ``gate.bias``) and keep Paddle's quirks:

* `NaiveGate`: the top-k of the raw scores; the combine weights are the raw scores (no
  softmax);
* `GShardGate` (top-2): the same weights; the loss ``mean_e(c[e] m[e]) num_expert^2`` with
  ``c`` the top-k counts over the tokens (both choices) and ``m`` the mean softmax; each expert
  keeps the first ``ceil(capacity x T / world_size)`` assignments in token order (``capacity``
  is ``(train, eval)``); random routing drops a token's second expert where ``2 x its score <
  u``, ``u ~ U[0, 1)``, in training and evaluation alike (as Paddle, which applies it whenever
  ``random_routing``);
* `SwitchGate` (top-1): in training uniform noise in ``[1 - eps, 1 + eps]`` is *added* to the
  scores; the weight is the softmax probability; the same capacity; the loss ``tot_expert
  sum_e f[e] p[e]`` with ``f`` the share of the kept assignments and ``p`` the summed
  probabilities divided by the number kept.

Paddle counts a rank's tokens; here the gate sees the global batch, so the capacity is per
expert over the whole batch, ``ceil(rate x T / world_size)``: what Paddle gives when
``world_size`` ranks each hold ``T / world_size`` of the tokens in order. Paddle's
``group`` (the ranks that share the capacity) has no meaning here and warns.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax._warnings import warn_once
from fleetjax.layers._params import DEFAULT_WEIGHT_INIT, logical_param
from fleetjax.layers.moe.routing import (
    BaseGate,
    RngsLike,
    Routing,
    draw_key,
    drop_beyond_capacity,
    expert_counts,
    stream,
    top_k,
)

__all__ = ["GShardGate", "NaiveGate", "SwitchGate"]


class NaiveGate(BaseGate):
    """Paddle's ``NaiveGate(d_model, num_expert, world_size, topk=2)``: the top-k of a linear
    layer's scores, which are also the combine weights.

    Attributes:
      weight: ``[d_model, tot_expert]`` (Paddle's ``gate.weight``), logical ``("embed", None)``.
      bias: ``[tot_expert]`` (Paddle's ``gate.bias``).
    """

    def __init__(
        self,
        d_model: int,
        num_expert: int,
        world_size: int = 1,
        topk: int = 2,
        *,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(num_expert, world_size, topk)
        self.d_model = d_model
        self.weight = logical_param(
            DEFAULT_WEIGHT_INIT,
            ("embed", None),
            rngs.params(),
            (d_model, self.tot_expert),
            param_dtype,
        )
        self.bias = logical_param(
            nnx.initializers.zeros, (None,), rngs.params(), (self.tot_expert,), param_dtype
        )

    def scores(self, x: jax.Array) -> jax.Array:
        """The linear layer's scores ``[T, tot_expert]``."""
        return jnp.matmul(x, self.weight[...]) + self.bias[...]

    def route(self, x: jax.Array, *, sequences: int = 1, rngs: RngsLike = None) -> Routing:
        del sequences, rngs
        values, experts = top_k(self.scores(x), self.top_k)
        return Routing(experts, values, self._record({}))


def _capacity(rates: tuple[float, float], gate: BaseGate, tokens: int) -> int:
    """Paddle's per-expert capacity: ``ceil(rate x tokens per rank)``, the train or eval rate."""
    rate = rates[1 if gate.deterministic else 0]
    return math.ceil(rate * tokens / gate.world_size)


def _check_paddle_args(layer: str, topk: int, wanted: int, capacity: tuple, group: object) -> None:
    if topk != wanted:
        raise ValueError(f"{layer}: topk must be {wanted} (Paddle asserts it), got {topk!r}")
    if not (
        isinstance(capacity, (tuple, list))
        and len(capacity) == 2
        and all(isinstance(c, (int, float)) and c > 0 for c in capacity)
    ):
        raise ValueError(
            f"{layer}: capacity must be two positive rates (train, eval), e.g. (1.2, 2.4), "
            f"got {capacity!r}"
        )
    if group is not None:
        warn_once(
            f"{layer}: group has no effect in fleetjax: the gate sees the global batch and "
            "counts each expert's capacity over it"
        )


class GShardGate(NaiveGate):
    """Paddle's ``GShardGate(d_model, num_expert, world_size, topk=2, capacity=(1.2, 2.4),
    random_routing=True, group=None)``: top-2 with GShard's balance loss, a capacity per
    expert, and random routing of the second expert (see the module docstring).

    The random routing draws from the ``"routing"`` stream of `rngs` (or its default stream),
    or from ``rngs=`` given to the call.
    """

    def __init__(
        self,
        d_model: int,
        num_expert: int,
        world_size: int = 1,
        topk: int = 2,
        capacity: tuple[float, float] = (1.2, 2.4),
        random_routing: bool = True,
        group: object = None,
        *,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        _check_paddle_args("GShardGate", topk, 2, capacity, group)
        super().__init__(d_model, num_expert, world_size, topk, param_dtype=param_dtype, rngs=rngs)
        self.capacity = tuple(capacity)
        self.random_routing = random_routing
        self.rngs = stream(rngs, "GShardGate") if random_routing else nnx.data(None)

    def route(self, x: jax.Array, *, sequences: int = 1, rngs: RngsLike = None) -> Routing:
        del sequences
        scores = self.scores(x)
        values, experts = top_k(scores, self.top_k)
        tokens = x.shape[0]
        chosen = expert_counts(experts, self.tot_expert) / tokens  # Paddle's c_e: both choices
        mean_probs = jnp.mean(jax.nn.softmax(scores.astype(jnp.float32), axis=1), axis=0)
        loss = jnp.mean(chosen * mean_probs) * self.num_expert**2
        capacity = _capacity(self.capacity, self, tokens)
        experts = drop_beyond_capacity(experts, self.tot_expert, capacity)
        if self.random_routing:
            key = draw_key("GShardGate", rngs, self.rngs, "random routing of the 2nd expert")
            u = jax.random.uniform(key, (tokens,), jnp.float32)
            dropped = (2 * values[:, 1] < u)[:, None] & (jnp.arange(2) == 1)
            experts = jnp.where(dropped, -1, experts)
        return Routing(experts, values, self._record({"gshard": loss}))


class SwitchGate(NaiveGate):
    """Paddle's ``SwitchGate(d_model, num_expert, world_size, topk=1, switch_eps=0.1,
    capacity=(1.2, 2.4), group=None)``: top-1 of the softmax, with jitter in training, the
    Switch Transformer's loss and a capacity per expert (see the module docstring).

    The jitter draws from the ``"routing"`` stream of `rngs` (or its default stream), or from
    ``rngs=`` given to the call.
    """

    def __init__(
        self,
        d_model: int,
        num_expert: int,
        world_size: int = 1,
        topk: int = 1,
        switch_eps: float = 0.1,
        capacity: tuple[float, float] = (1.2, 2.4),
        group: object = None,
        *,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        _check_paddle_args("SwitchGate", topk, 1, capacity, group)
        super().__init__(d_model, num_expert, world_size, 1, param_dtype=param_dtype, rngs=rngs)
        self.switch_eps = switch_eps
        self.capacity = tuple(capacity)
        self.rngs = stream(rngs, "SwitchGate")

    def route(self, x: jax.Array, *, sequences: int = 1, rngs: RngsLike = None) -> Routing:
        del sequences
        scores = self.scores(x).astype(jnp.float32)
        if not self.deterministic:
            key = draw_key("SwitchGate", rngs, self.rngs, "its jitter in training")
            noise = jax.random.uniform(key, scores.shape, jnp.float32)
            scores = scores + noise * 2 * self.switch_eps + 1.0 - self.switch_eps
        probs = jax.nn.softmax(scores, axis=-1)
        values, experts = top_k(probs, 1)
        experts = drop_beyond_capacity(
            experts, self.tot_expert, _capacity(self.capacity, self, x.shape[0])
        )
        kept = jnp.sum(experts >= 0).astype(jnp.float32)
        share = expert_counts(experts, self.tot_expert) / kept
        loss = jnp.sum(share * probs.sum(axis=0) / kept) * self.tot_expert
        return Routing(experts, values.astype(x.dtype), self._record({"switch": loss}))
