"""Small MoE layers for the tests, the routings they exercise, and the dense one-device
reference a layer must equal: every expert on every token, masked by the top-k weights."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from fleetjax.layers import BaseGate, ExpertMLP, MoELayer, Routing, TopKRouter, partition_specs
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
    losses are Megatron's three, so that gradients reach the gate through all of them. With
    `kept`, the assignments it drops (-1) add nothing, but the losses count them (as the
    layer's, whose gate does not see what the dispatch's capacity drops)."""

    def __init__(self, ids: np.ndarray, *, kept: np.ndarray | None = None, rngs: nnx.Rngs):
        super().__init__(EXPERTS, 1, ids.shape[1])
        self.ids = Ids(jnp.asarray(ids))
        self.kept = Ids(jnp.asarray(ids if kept is None else kept))
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
        weights = jnp.take_along_axis(probs, ids, axis=-1)
        return Routing(self.kept[...], weights, self._record(losses))


class PaddleExpert(nnx.Module):
    """Paddle's example expert (two Linear layers with biases): no grouped matmul, so the layer
    runs it tile by tile."""

    def __init__(self, d_model: int, d_hidden: int, *, rngs: nnx.Rngs):
        self.htoh4 = nnx.Linear(d_model, d_hidden, rngs=rngs)
        self.h4toh = nnx.Linear(d_hidden, d_model, rngs=rngs)

    def __call__(self, x):
        return self.h4toh(jax.nn.gelu(self.htoh4(x)))


def make_layer(routing="router", *, kept=None, expert=ExpertMLP, seed: int = 0, **options):
    """A MoE layer: a `TopKRouter` with all three losses ("router"), or a `FixedGate` routing
    as `routing_ids(routing)` (or to the given ids; `kept`: see `FixedGate`)."""
    rngs = nnx.Rngs(seed)
    experts = [expert(D_MODEL, HIDDEN, rngs=rngs) for _ in range(EXPERTS)]
    if isinstance(routing, str) and routing == "router":
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
        ids = routing if isinstance(routing, np.ndarray) else routing_ids(routing, seed=seed)
        gate = FixedGate(ids, kept=kept, rngs=rngs)
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


def split(layer):
    """The layer's graph, and its parameters and other state as pure dicts (fleetjax's loss
    functions take them so; `nnx.merge` makes the variables anew in the traced function)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


@functools.cache
def step(graphdef, forward):
    """value_and_grad of <output, cotangent> + the aux losses, by parameters and input."""

    def loss(params, x, rest, cotangent):
        out, losses = forward(nnx.merge(graphdef, params, rest), x)
        return jnp.sum(out * cotangent) + sum(losses.values()), (out, losses)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def layer_forward(layer, x):
    out, stats = layer.call_with_stats(x)
    return out, {**stats.losses, "dropped": stats.dropped, "rounds": stats.rounds}


def run(layer, x, cotangent, mesh=None, forward=layer_forward):
    """(output, losses, gradients), compiled on `mesh` with the parameters placed by their
    rules."""
    graphdef, params, rest = split(layer)
    if mesh is None:
        (_, (out, losses)), grads = step(graphdef, forward)(params, x, rest, cotangent)
        return out, losses, grads
    with jax.set_mesh(mesh):
        specs = nnx.to_pure_dict(partition_specs(nnx.state(layer, nnx.Param), mesh=mesh))
        placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        (_, (out, losses)), grads = step(graphdef, forward)(placed, x, rest, cotangent)
    return out, losses, grads


def assert_close(actual, expected):
    """Every leaf equal to rtol 1e-6 (float32), measured against the leaf's scale: a gradient
    sums over the tokens, in another order on another layout, so an element that sums to
    little from large terms carries their rounding."""
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        scale = max(1.0, float(np.max(np.abs(b)))) if np.size(b) else 1.0
        where = jax.tree_util.keystr(path)
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * scale, err_msg=where)
