"""A MoE layer's auxiliary losses and load metrics, and how they reach the training loss.

With ``T`` tokens, ``E`` experts, ``k`` experts a token, ``p[t, e]`` the router's probability
of expert ``e`` for token ``t`` and ``f[e]`` the share of the ``T k`` assignments that expert
``e`` receives:

* `load_balancing_loss`: ``E sum_e f[e] P[e]``, ``P[e] = mean_t p[t, e]`` (Switch Transformer,
  GShard; Megatron's ``aux_loss``, MaxText's ``load_balance_loss``): 1 when balanced;
* `sequence_load_balancing_loss`: the same within each sequence, averaged over the sequences
  (DeepSeek-V3's complementary sequence-wise loss; Megatron's ``seq_aux_loss``);
* `z_loss`: ``mean_t logsumexp(logits[t])^2`` (ST-MoE; Megatron's ``--moe-z-loss-coeff``);
* `max_violation`: ``max_e load[e] / mean_e load[e] - 1`` (MaxVio, Wang et al. 2024, "Auxiliary-
  Loss-Free Load Balancing"): 0 when balanced.

Every one is computed over the layer's global batch, so it is the same under every layout; the
expert counts ``f`` carry no gradient, ``P`` and the logits do.

How they reach the step: each `MoELayer` call records a `MoEStats` with flax's
``Module.sow`` as a `MoEAux` variable. ``nnx.capture(model, MoEAux)(x)`` returns them next
to the output; `moe_aux` adds the losses up and names the metrics:

    logits, captured = nnx.capture(model, fleetjax.layers.MoEAux)(x)
    aux_loss, metrics = fleetjax.layers.moe_aux(captured)
    return task_loss(logits) + aux_loss, metrics          # make_train_step(..., has_aux=True)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from fleetjax.layers.moe.routing import on_auto_axes

__all__ = [
    "MoEAux",
    "MoEStats",
    "load_balancing_loss",
    "max_violation",
    "moe_aux",
    "sequence_load_balancing_loss",
    "z_loss",
]


def load_balancing_loss(probs: jax.Array, counts: jax.Array, top_k: int) -> jax.Array:
    """``E sum_e f[e] P[e]`` for router probabilities `probs` ``[T, E]`` and the assignments
    each expert receives, `counts` ``[E]`` (``f = counts / (T top_k)``, no gradient)."""
    tokens, experts = probs.shape
    share = jax.lax.stop_gradient(counts) / (tokens * top_k)
    return experts * jnp.sum(share * jnp.mean(probs.astype(jnp.float32), axis=0))


def sequence_load_balancing_loss(
    probs: jax.Array, experts: jax.Array, sequences: int, top_k: int
) -> jax.Array:
    """`load_balancing_loss` within each of `sequences` equal runs of tokens, averaged:
    `probs` ``[T, E]``, `experts` ``[T, k]`` (``-1``: dropped)."""
    num_experts = probs.shape[1]

    def loss(probs: jax.Array, experts: jax.Array) -> jax.Array:
        per = probs.reshape(sequences, -1, num_experts)
        hits = jax.nn.one_hot(experts.reshape(sequences, -1), num_experts, dtype=jnp.float32)
        counts = hits.sum(axis=1)  # [sequences, E]; one_hot of -1 is all zeros
        return jnp.mean(jax.vmap(lambda p, c: load_balancing_loss(p, c, top_k))(per, counts))

    # Sequences need not line up with the tokens' split: XLA chooses how to split this.
    return on_auto_axes(loss, PartitionSpec())(probs, experts)


def z_loss(logits: jax.Array) -> jax.Array:
    """``mean_t logsumexp(logits[t])^2`` (ST-MoE's router z-loss)."""
    return jnp.mean(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1) ** 2)


def max_violation(counts: jax.Array) -> jax.Array:
    """MaxVio: ``max_e counts[e] / mean_e counts[e] - 1`` (0 for a balanced load)."""
    mean = jnp.mean(counts)
    return jnp.where(mean > 0, jnp.max(counts) / jnp.maximum(mean, 1e-30) - 1, 0.0)


class MoEStats(NamedTuple):
    """What one call of a `MoELayer` reports.

    Attributes:
      loss: the sum of `losses`: what to add to the training loss.
      losses: each auxiliary loss of the gate by name, weighted by its coefficient.
      tokens_per_expert: ``[E]`` float32, the assignments each expert received.
      max_violation: MaxVio of `tokens_per_expert` (`max_violation`).
      dropped: int32, the assignments dropped: by the gate's capacity (Paddle's gates) and by
        the dispatch's (``capacity_factor``); 0 in dropless mode.
      rounds: int32, the all-to-all rounds the dispatch took: 1 while every expert's tokens
        fit the receive buffer, more under skewed routing (dropless mode).
    """

    loss: jax.Array
    losses: dict[str, jax.Array]
    tokens_per_expert: jax.Array
    max_violation: jax.Array
    dropped: jax.Array
    rounds: jax.Array


class MoEAux(nnx.Intermediate):
    """The variable type a `MoELayer` sows its `MoEStats` as (one per call, in a tuple):
    capture them with ``nnx.capture(fn, MoEAux)``."""


def moe_aux(captured: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The total auxiliary loss and the metrics of every MoE layer call in `captured` (the
    state ``nnx.capture(fn, MoEAux)`` returns, or a model's ``nnx.state(model, MoEAux)``).

    Metrics are named ``moe/<layer path>/<name>``: ``max_violation``, ``dropped``, ``rounds``
    and each loss (``<name>_loss``, weighted); a layer called more than once gets a
    ``[call]`` suffix per call.
    """
    total = jnp.zeros((), jnp.float32)
    metrics: dict[str, jax.Array] = {}
    flat = nnx.to_flat_state(
        nnx.state(captured, MoEAux) if isinstance(captured, nnx.Module) else captured
    )
    for path, variable in flat:
        if not isinstance(variable, MoEAux):
            continue
        calls = variable.get_value()
        where = "/".join(str(p) for p in path[:-1]) or "layer"
        for i, stats in enumerate(calls):
            suffix = f"[{i}]" if len(calls) > 1 else ""
            total = total + stats.loss
            named = {f"{name}_loss": value for name, value in stats.losses.items()}
            named |= {
                "max_violation": stats.max_violation,
                "dropped": stats.dropped,
                "rounds": stats.rounds,
            }
            metrics |= {f"moe/{where}/{name}{suffix}": value for name, value in named.items()}
    return total, metrics
