"""A click-through-rate model on power-law ids: DeepFM with sparse tables, and its data.

* `PowerLawClicks`: synthetic CTR data. Each of `slots` sparse features draws its ids from a
  power law (rank r with probability proportional to r ** -alpha, Zipf's law, as real feature
  ids are: a few are everywhere, most are rare), each slot from its own range of ids; a few
  dense features; and clicks drawn from a hidden logistic model of both, so there is something
  to learn.
* `DeepFM` (Guo et al. 2017, PaddleRec's `deepfm`): a first-order term (a one-column sparse
  table and a linear layer of the dense features), a factorization machine over the slots'
  embeddings (a second sparse table), and an MLP over the embeddings and the dense features.
  Both tables are `fleetjax.layers.SparseEmbedding`s: split over every device by rows and
  trained by Paddle's sparse rules on the rows a batch touches.

examples/train_ctr.py trains it with `make_train_step`; examples/train_ctr_ps.py is the same
training as a Paddle parameter-server script.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fleetjax


class PowerLawClicks:
    """Synthetic CTR batches: ``{"ids": [B, slots] int32, "dense": [B, dense] float32,
    "label": [B] float32}``; slot s's ids are ``s * ids_per_slot + rank - 1``."""

    def __init__(
        self,
        slots: int = 26,
        ids_per_slot: int = 4096,
        dense: int = 13,
        alpha: float = 1.1,
        seed: int = 0,
    ) -> None:
        self.slots, self.ids_per_slot, self.dense = slots, ids_per_slot, dense
        ranks = np.arange(1, ids_per_slot + 1, dtype=np.float64)
        weights = ranks**-alpha
        self._cdf = np.cumsum(weights) / weights.sum()
        rng = np.random.default_rng([seed, 1])
        self._id_effect = rng.normal(0.0, 0.6, slots * ids_per_slot).astype(np.float32)
        self._dense_effect = rng.normal(0.0, 0.5, dense).astype(np.float32)

    @property
    def num_ids(self) -> int:
        """How many distinct ids the slots have together (a table's rows)."""
        return self.slots * self.ids_per_slot

    def batch(self, size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
        ranks = np.searchsorted(self._cdf, rng.random((size, self.slots)))
        ids = (np.arange(self.slots) * self.ids_per_slot + ranks).astype(np.int32)
        dense = rng.normal(size=(size, self.dense)).astype(np.float32)
        logit = self._id_effect[ids].sum(1) / np.sqrt(self.slots) + dense @ self._dense_effect
        label = (rng.random(size) < 1 / (1 + np.exp(1.0 - logit))).astype(np.float32)
        return {"ids": ids, "dense": dense, "label": label}

    def batches(self, size: int, seed: int, start: int = 0) -> Iterator[dict[str, np.ndarray]]:
        """Endless batches of `size`, the i-th one the same on every process (from `start`)."""
        position = start
        while True:
            yield self.batch(size, np.random.default_rng([seed, position]))
            position += 1


class DeepFM(nnx.Module):
    """DeepFM over `slots` sparse features (ids in ``[0, num_ids)``) and `dense` features; its
    two tables are named "first_order" and "embedding" (Paddle's table names for
    `sparse_table_configs`)."""

    def __init__(
        self,
        num_ids: int,
        slots: int,
        dense: int,
        embedding_dim: int = 8,
        hidden: tuple[int, ...] = (64, 32),
        *,
        rngs: nnx.Rngs,
    ) -> None:
        self.first_order = fleetjax.layers.SparseEmbedding(
            num_ids, 1, table_name="first_order", rngs=rngs
        )
        self.embedding = fleetjax.layers.SparseEmbedding(
            num_ids, embedding_dim, table_name="embedding", initial_range=0.05, rngs=rngs
        )
        self.dense_linear = nnx.Linear(dense, 1, rngs=rngs)
        sizes = (slots * embedding_dim + dense, *hidden, 1)
        self.mlp = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(sizes)])

    def __call__(self, ids: jax.Array, dense: jax.Array) -> jax.Array:
        """The click logits, ``[batch]``."""
        first = self.first_order(ids).sum((1, 2)) + self.dense_linear(dense)[:, 0]
        e = self.embedding(ids)  # [batch, slots, dim]
        fm = 0.5 * (jnp.square(e.sum(1)) - jnp.square(e).sum(1)).sum(1)
        h = jnp.concatenate([e.reshape(e.shape[0], -1), dense], axis=1)
        for layer in self.mlp[:-1]:
            h = jax.nn.relu(layer(h))
        return first + fm + self.mlp[-1](h)[:, 0]


def loss_fn(model: DeepFM, batch: dict[str, jax.Array]) -> jax.Array:
    """Binary cross-entropy of the clicks."""
    logits = model(batch["ids"], batch["dense"])
    return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean()


def process_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's rows of a global batch: the step joins all processes' rows in order."""
    rows = len(batch["label"]) // jax.process_count()
    start = jax.process_index() * rows
    return {k: v[start : start + rows] for k, v in batch.items()}
