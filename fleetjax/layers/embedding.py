"""Megatron's vocabulary-parallel embedding (Paddle's `fleet.meta_parallel.VocabParallelEmbedding`)
as a flax nnx module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax.layers._params import DEFAULT_WEIGHT_INIT, check_sizes, logical_param
from fleetjax.layers.partitioning import constrain, out_sharding

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(nnx.Module):
    """An embedding table whose vocabulary dimension is split over ``mp``.

    Paddle's ``VocabParallelEmbedding(num_embeddings, embedding_dim, weight_attr)``. Each
    ``mp`` device looks up the ids in its range of the vocabulary, gives zero rows for the
    others, and the rows are summed over ``mp`` (one all-reduce of the looked-up rows; the
    table is never gathered). As in Paddle with ``mp > 1``, an id outside
    ``[0, num_embeddings)`` gives a zero row (here on any mesh, so ``mp = 1`` agrees).

    Attributes:
      weight: ``[num_embeddings, embedding_dim]``, logical axes ``("vocab", "embed")``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        weight_init: nnx.Initializer = DEFAULT_WEIGHT_INIT,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        """``weight_init`` stands for Paddle's ``weight_attr``."""
        check_sizes(type(self).__name__, num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = logical_param(
            weight_init,
            ("vocab", "embed"),
            rngs.params(),
            (num_embeddings, embedding_dim),
            param_dtype,
        )

    def __call__(self, ids: jax.Array) -> jax.Array:
        """The rows of `ids` (an integer array): ``ids.shape + (embedding_dim,)``."""
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise TypeError(f"VocabParallelEmbedding: ids must be integers, got {ids.dtype}")
        rows = (
            self.weight[...]
            .at[ids]
            .get(
                mode="fill",
                fill_value=0,
                wrap_negative_indices=False,
                out_sharding=out_sharding(ids, ids.ndim, (None,)),
            )
        )
        return constrain(rows, (None,))
