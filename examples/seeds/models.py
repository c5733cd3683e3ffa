"""The models and data the seed examples train in place of Paddle's: scikit-learn's handwritten
digits (8x8 images, shipped with scikit-learn), an MLP (flax nnx) and the same MLP cut for a
pipeline, and Paddle's dygraph loop over the fleet's optimizer."""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits

import fleetjax
from fleetjax import fleet

HIDDEN = 32


def digits(batch_size: int, steps: int, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """`steps` shuffled batches of `batch_size` digits: images `x` (64 floats in [0, 1]) and
    their `label`s."""
    data = load_digits()
    images, labels = (data.data / 16).astype(np.float32), data.target.astype(np.int32)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        rows = rng.choice(len(labels), batch_size, replace=False)
        yield {"x": images[rows], "label": labels[rows]}


class MLP(nnx.Module):
    """64 -> 32 -> 32 -> 10. The hidden activations are named "x" and "y", the checkpoints the
    seeds' recompute examples name, and each hidden layer is marked for recompute."""

    def __init__(self, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.l1 = nnx.Linear(64, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, 10, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = fleetjax.recompute(lambda h: self._hidden(self.l1, h, "x"))(images)
        y = fleetjax.recompute(lambda h: self._hidden(self.l2, h, "y"))(x)
        return self.out(y)

    @staticmethod
    def _hidden(layer: nnx.Linear, h: jax.Array, name: str) -> jax.Array:
        return fleetjax.checkpoint_name(jax.nn.relu(layer(h)), name)


def cross_entropy(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def train(
    optimizer: fleetjax.DistributedOptimizer, steps: int = 3, batch_size: int = 64
) -> list[float]:
    """Paddle's dygraph loop, `loss.backward(); opt.step(); opt.clear_grad()`, for a few steps
    of the MLP (the fleet's `distributed_model`) with `optimizer` (from
    `fleet.distributed_optimizer`); prints and returns the losses."""
    fleet.distributed_model(MLP())
    losses = []
    for batch in digits(batch_size, steps):
        optimizer.backward(cross_entropy, batch)
        losses.append(float(optimizer.step()))
        optimizer.clear_grad()
    print("  losses", " ".join(f"{loss:.4f}" for loss in losses))
    return losses


# -- the MLP cut for a pipeline ---------------------------------------------------------------


def embed(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    return jax.nn.relu(batch["x"] @ params["w"])


def stage(params: dict[str, jax.Array], h: jax.Array) -> jax.Array:
    return jax.nn.relu(h @ params["w"] + params["b"])


def head_loss(params: dict[str, jax.Array], h: jax.Array, batch: dict[str, jax.Array]):
    logits = h @ params["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


PIPELINE_MLP = fleetjax.PipelineLayer(embed, stage, head_loss)


def pipeline_params(layers: int = 4, seed: int = 0) -> fleetjax.PipelineParams:
    """The pipelined MLP's parameters: `layers` hidden layers, stacked."""
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    scale = jnp.sqrt(2.0 / HIDDEN)
    return fleetjax.PipelineParams(
        embed={"w": jax.random.normal(k1, (64, HIDDEN)) * jnp.sqrt(2.0 / 64)},
        layers={
            "w": jax.random.normal(k2, (layers, HIDDEN, HIDDEN)) * scale,
            "b": jnp.zeros((layers, HIDDEN)),
        },
        head={"w": jax.random.normal(k3, (HIDDEN, 10)) * scale},
    )


def train_pipeline(
    optimizer: fleetjax.DistributedOptimizer, batch_size: int, steps: int = 3
) -> list[float]:
    """A few steps of the pipelined MLP with `optimizer` (any `DistributedOptimizer`); prints
    and returns the losses."""
    step = fleetjax.make_train_step(PIPELINE_MLP, optimizer)
    state, losses = step.init(pipeline_params()), []
    for batch in digits(batch_size, steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    print("  losses", " ".join(f"{loss:.4f}" for loss in losses))
    return losses
