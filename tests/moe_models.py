"""Small MoE layers for the tests, the routings they exercise, and the dense one-device
reference a layer must equal: every expert on every token, masked by the top-k weights."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fleetjax.layers import BaseGate, ExpertMLP, MoELayer, Routing, TopKRouter
from fleetjax.layers.moe import load_balancing_loss, sequence_load_balancing_loss, z_loss

D_MODEL, HIDDEN, EXPERTS, TOP_K = 8, 16, 8, 2
BATCH, SEQ = 4, 8  # 32 tokens: 4 a device on 8 devices
ROUTINGS = ("uniform", "zipf", "all_to_one")


def routing_ids(kind: str, tokens: int = BATCH * SEQ, seed: int = 0) -> np.ndarray:
    """[tokens, TOP_K] distinct experts a token: uniform, Zipf-skewed, or every token's first
    choice expert 0 (and its second expert 1)."""
    rng = np.random.default_rng(seed)
    if kind == "all_to_one":
        return np.tile(np.arange(TOP_K, dtype=np.int32), (tokens, 1))
    p = np.ones(EXPERTS) if kind == "uniform" else 1.0 / np.arange(1, EXPERTS + 1) ** 1.5
    rows = [rng.choice(EXPERTS, TOP_K, replace=False, p=p / p.sum()) for _ in range(tokens)]
    return np.asarray(rows, np.int32)


class Ids(nnx.Variable):
    """The fixed expert choices of a `FixedGate` (not trained)."""


class FixedGate(BaseGate):
    """Routes to given experts; the weights are the softmax of a linear layer at them, and the
    losses are Megatron's three, so that gradients reach the gate through all of them."""

    def __init__(self, ids: np.ndarray, *, rngs: nnx.Rngs):
        super().__init__(EXPERTS, 1, ids.shape[1])
        self.ids = Ids(jnp.asarray(ids))
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (D_MODEL, EXPERTS)) / 3)

    def route(self, x, *, sequences=1, rngs=None):
        logits = x @ self.weight[...]
        probs = jax.nn.softmax(logits, axis=-1)
        ids = self.ids[...]
        counts = jnp.bincount(ids.reshape(-1), length=EXPERTS).astype(jnp.float32)
        losses = {
            "aux": 0.01 * load_balancing_loss(probs, counts, self.top_k),
            "seq_aux": 0.001 * sequence_load_balancing_loss(probs, ids, sequences, self.top_k),
            "z": 0.001 * z_loss(logits),
        }
        return Routing(ids, jnp.take_along_axis(probs, ids, axis=-1), self._record(losses))


class PaddleExpert(nnx.Module):
    """Paddle's example expert (two Linear layers with biases): no grouped matmul, so the layer
    runs it tile by tile."""

    def __init__(self, d_model: int, d_hidden: int, *, rngs: nnx.Rngs):
        self.htoh4 = nnx.Linear(d_model, d_hidden, rngs=rngs)
        self.h4toh = nnx.Linear(d_hidden, d_model, rngs=rngs)

    def __call__(self, x):
        return self.h4toh(jax.nn.gelu(self.htoh4(x)))


def make_layer(routing: str = "router", *, expert=ExpertMLP, seed: int = 0, **options):
    """A MoE layer: a `TopKRouter` with all three losses ("router"), or a `FixedGate` routing
    as `routing_ids(routing)`."""
    rngs = nnx.Rngs(seed)
    experts = [expert(D_MODEL, HIDDEN, rngs=rngs) for _ in range(EXPERTS)]
    if routing == "router":
        gate = TopKRouter(
            D_MODEL,
            EXPERTS,
            TOP_K,
            aux_loss_coeff=0.01,
            seq_aux_loss_coeff=0.001,
            z_loss_coeff=0.001,
            rngs=rngs,
        )
    else:
        gate = FixedGate(routing_ids(routing, seed=seed), rngs=rngs)
    return MoELayer(D_MODEL, experts, gate, **options)


def inputs(seed: int = 1) -> tuple[jax.Array, jax.Array]:
    """An input [BATCH, SEQ, D_MODEL] and a cotangent for its output."""
    x, cotangent = jax.random.normal(jax.random.key(seed), (2, BATCH, SEQ, D_MODEL))
    return x, cotangent


def dense_reference(layer: MoELayer, x: jax.Array) -> tuple[jax.Array, dict]:
    """Every expert on every token, masked by the top-k weights, on one device; the gate's
    losses."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.gate.route(tokens, sequences=x.shape[0])
    graphdef, state = nnx.split(layer.experts)
    every = jax.vmap(lambda s: nnx.merge(graphdef, s)(tokens))(state)  # [E, T, H]
    kept = routing.experts >= 0
    dense = (
        jnp.zeros((tokens.shape[0], layer.num_expert))
        .at[jnp.arange(tokens.shape[0])[:, None], jnp.where(kept, routing.experts, 0)]
        .add(jnp.where(kept, routing.weights, 0))
    )
    out = jnp.einsum("te,eth->th", dense, every)
    if layer.shared_expert is not None:
        out = out + layer.shared_expert(tokens)
    return out.reshape(x.shape), routing.losses
