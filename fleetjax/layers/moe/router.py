"""The router the other anchors use: Megatron-Core's ``TopKRouter``, MaxText's and DeepSeek-V3's
routing, as one gate.

``logits = x W`` (``W [d_model, E]``, no bias, computed in ``dtype``, float32 by default as
Megatron's ``--moe-router-dtype``), then:

* ``score_function="softmax"``: with ``pre_softmax`` the top-k of ``softmax(logits)``, whose
  probabilities are the weights (Megatron's ``--moe-router-pre-softmax``, MaxText); without
  (Megatron's default, Mixtral) the top-k of the logits, the weights a softmax over the k;
* ``score_function="sigmoid"``: the top-k of ``sigmoid(logits)`` (DeepSeek-V3), whose scores
  are the weights;
* ``normalize_top_k``: the k weights divided by their sum (DeepSeek-V3; MaxText's
  ``norm_topk_prob``), then times ``scaling_factor`` (DeepSeek's ``routed_scaling_factor``);
* group-limited routing (``num_groups``, ``group_top_k``): the experts form ``num_groups``
  groups, a group scores the sum of its ``top_k / group_top_k`` best scores, and a token picks
  its k experts from its ``group_top_k`` best groups only (DeepSeek-V3's node-limited routing,
  Megatron's ``--moe-router-num-groups`` / ``--moe-router-group-topk``);
* aux-loss-free balancing (``bias_update_rate`` > 0, DeepSeek-V3; Megatron's
  ``--moe-router-enable-expert-bias``): a per-expert bias is added to the scores to *select*
  experts only (the weights stay the unbiased scores), and after each training step it moves by
  ``rate x sign(mean load - load)``;
* input jitter (``jitter`` = eps): in training the input is multiplied by noise uniform in
  ``[1 - eps, 1 + eps]`` (Megatron's ``--moe-input-jitter-eps``);
* losses (`fleetjax.layers.moe.losses`), each with its coefficient: ``aux_loss_coeff`` x
  `load_balancing_loss` over the batch, ``seq_aux_loss_coeff`` x
  `sequence_load_balancing_loss`, ``z_loss_coeff`` x `z_loss`. Their probabilities are the
  softmax of the logits, or for sigmoid the scores divided by their sum (as Megatron).

The balancing bias is model state, not a parameter: `ExpertBias` variables (a flax
``BatchStat``, so it is carried as batch norm's statistics are). A training call selects with
``bias + rate x sign(mean(load) - load)``, where ``load`` is the previous training call's
expert load, and keeps that bias and its own load: the update DeepSeek makes after step ``t``
is applied when step ``t + 1`` starts. Micro-batches of one step (gradient merge) see the same
state, so they select with the same bias, and their loads average to the step's load.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax.layers._params import DEFAULT_WEIGHT_INIT, logical_param
from fleetjax.layers.moe import losses
from fleetjax.layers.moe.routing import (
    BaseGate,
    RngsLike,
    Routing,
    draw_key,
    expert_counts,
    stream,
    top_k,
)

__all__ = ["SCORE_FUNCTIONS", "ExpertBias", "TopKRouter"]

SCORE_FUNCTIONS = ("softmax", "sigmoid")


class ExpertBias(nnx.BatchStat):
    """Aux-loss-free balancing's state: the per-expert selection bias and the last training
    call's expert load (not trained by gradients)."""


class TopKRouter(BaseGate):
    """A top-k router in Megatron-Core's, MaxText's and DeepSeek-V3's forms (see the module
    docstring for each option's formula).

    Attributes:
      weight: ``[d_model, num_experts]``, logical ``("embed", None)``.
      expert_bias, expert_load: ``[num_experts]`` `ExpertBias` state with
        ``bias_update_rate > 0``, else None.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int = 2,
        *,
        score_function: str = "softmax",
        pre_softmax: bool = False,
        normalize_top_k: bool = False,
        scaling_factor: float = 1.0,
        num_groups: int | None = None,
        group_top_k: int | None = None,
        bias_update_rate: float = 0.0,
        jitter: float = 0.0,
        aux_loss_coeff: float = 0.0,
        seq_aux_loss_coeff: float = 0.0,
        z_loss_coeff: float = 0.0,
        dtype: jnp.dtype = jnp.float32,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(num_experts, 1, top_k)
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"TopKRouter: score_function must be one of {SCORE_FUNCTIONS}, got "
                f"{score_function!r}"
            )
        _check_groups(num_experts, top_k, num_groups, group_top_k)
        for name, value in (
            ("bias_update_rate", bias_update_rate),
            ("jitter", jitter),
            ("aux_loss_coeff", aux_loss_coeff),
            ("seq_aux_loss_coeff", seq_aux_loss_coeff),
            ("z_loss_coeff", z_loss_coeff),
        ):
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"TopKRouter: {name} must be a number >= 0, got {value!r}")
        self.d_model = d_model
        self.score_function, self.pre_softmax = score_function, pre_softmax
        self.normalize_top_k, self.scaling_factor = normalize_top_k, scaling_factor
        self.num_groups, self.group_top_k = num_groups, group_top_k
        self.bias_update_rate, self.jitter = bias_update_rate, jitter
        self.coefficients = {
            "aux": aux_loss_coeff,
            "seq_aux": seq_aux_loss_coeff,
            "z": z_loss_coeff,
        }
        self.dtype = dtype
        self.weight = logical_param(
            DEFAULT_WEIGHT_INIT, ("embed", None), rngs.params(), (d_model, num_experts), param_dtype
        )
        balanced = bias_update_rate > 0
        zeros = jnp.zeros((num_experts,), jnp.float32)
        self.expert_bias = ExpertBias(zeros) if balanced else nnx.data(None)
        self.expert_load = ExpertBias(zeros) if balanced else nnx.data(None)
        self.rngs = stream(rngs, "TopKRouter") if jitter > 0 else nnx.data(None)

    def route(self, x: jax.Array, *, sequences: int = 1, rngs: RngsLike = None) -> Routing:
        if self.jitter > 0 and not self.deterministic:
            key = draw_key("TopKRouter", rngs, self.rngs, "its input jitter in training")
            eps = self.jitter
            x = x * jax.random.uniform(key, x.shape, x.dtype, 1.0 - eps, 1.0 + eps)
        logits = jnp.matmul(x.astype(self.dtype), self.weight[...].astype(self.dtype))
        if self.score_function == "sigmoid":
            scores = jax.nn.sigmoid(logits)
            probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        else:
            probs = jax.nn.softmax(logits, axis=-1)
            scores = probs if self.pre_softmax else logits
        choice = scores + self._selection_bias() if self.expert_bias is not None else scores
        if self.num_groups:
            choice = _group_limited(choice, self.num_groups, self.group_top_k, self.top_k)
        _, experts = top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.score_function == "softmax" and not self.pre_softmax:
            weights = jax.nn.softmax(weights, axis=-1)
        if self.normalize_top_k:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        weights = weights * self.scaling_factor
        return Routing(
            experts,
            weights.astype(x.dtype),
            self._record(self._losses(logits, probs, experts, sequences)),
        )

    def _selection_bias(self) -> jax.Array:
        """The bias this call selects with: the kept bias plus the update the last training
        call's load asks for; a training call keeps it."""
        load = self.expert_load[...]
        bias = self.expert_bias[...] + self.bias_update_rate * jnp.sign(jnp.mean(load) - load)
        if not self.deterministic:
            self.expert_bias[...] = bias
        return bias

    def _losses(
        self, logits: jax.Array, probs: jax.Array, experts: jax.Array, sequences: int
    ) -> dict[str, jax.Array]:
        counts = expert_counts(experts, self.tot_expert)
        if self.expert_load is not None and not self.deterministic:
            self.expert_load[...] = counts / jnp.sum(counts)
        found = {}
        if self.coefficients["aux"]:
            found["aux"] = losses.load_balancing_loss(probs, counts, self.top_k)
        if self.coefficients["seq_aux"]:
            found["seq_aux"] = losses.sequence_load_balancing_loss(
                probs, experts, sequences, self.top_k
            )
        if self.coefficients["z"]:
            found["z"] = losses.z_loss(logits)
        return {name: self.coefficients[name] * value for name, value in found.items()}


def _check_groups(experts: int, k: int, groups: int | None, group_top_k: int | None) -> None:
    if groups is None and group_top_k is None:
        return
    ok = isinstance(groups, int) and isinstance(group_top_k, int) and 0 < group_top_k <= groups
    if not ok or experts % groups or k % group_top_k or k > group_top_k * (experts // groups):
        raise ValueError(
            "TopKRouter: group-limited routing needs num_groups dividing the experts and "
            "group_top_k (<= num_groups) dividing top_k, with top_k <= group_top_k x the experts "
            f"of a group; got num_groups={groups!r}, group_top_k={group_top_k!r} for "
            f"{experts} experts, top_k={k}"
        )


def _group_limited(scores: jax.Array, groups: int, chosen: int, k: int) -> jax.Array:
    """`scores` with the experts outside each token's `chosen` best groups at -inf; a group
    scores the sum of its ``k / chosen`` best scores."""
    tokens, experts = scores.shape
    grouped = scores.reshape(tokens, groups, experts // groups)
    group_scores = top_k(grouped, k // chosen)[0].sum(axis=-1)
    _, best = top_k(group_scores, chosen)
    keep = jnp.any(best[:, :, None] == jnp.arange(groups), axis=1)  # [tokens, groups]
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(tokens, experts)
