"""Cross entropy over vocabulary-parallel logits (Paddle's
`fleet.meta_parallel.ParallelCrossEntropy`, op ``c_softmax_with_cross_entropy``) as a function
and a flax nnx module."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax.layers.partitioning import constrain

__all__ = ["ParallelCrossEntropy", "parallel_cross_entropy"]


def parallel_cross_entropy(
    logits: jax.Array, label: jax.Array, *, ignore_index: int = -100
) -> jax.Array:
    """Per-token softmax cross entropy of `logits` split over ``mp`` on the vocabulary.

    Paddle's ``mp_ops._c_softmax_with_cross_entropy``: each ``mp`` device holds a slice of the
    vocabulary; the row maximum, the sum of exponentials and the label's logit are each reduced
    over ``mp`` (all-reduces of one number per token), and the full logits are never gathered.
    Tokens whose label is `ignore_index` get loss 0 (and no gradient). Other labels must lie in
    ``[0, vocab)``: Paddle's kernel raises for one outside, which a compiled program cannot, so
    its loss is the log-sum-exp alone. Computed in float32 at least; the loss has the logits'
    dtype, as in Paddle.

    Args:
      logits: ``[..., vocab]``.
      label: integer ``[...]`` or ``[..., 1]``.
      ignore_index: the label value that contributes no loss (Paddle's default -100).

    Returns:
      The loss of every token, ``[..., 1]`` (Paddle's shape).

    Raises:
      ValueError: if `label`'s shape does not fit `logits`' (Paddle's check).
      TypeError: if `label` is not an integer array.
    """
    if label.ndim not in (logits.ndim - 1, logits.ndim):
        raise ValueError(
            "Expected input_dims - 1 = label_dims or input_dims == label_dims "
            f"(got input_dims{logits.ndim}, label_dims{label.ndim})"
        )
    if label.ndim == logits.ndim - 1:
        label = label[..., None]
    if label.shape[:-1] != logits.shape[:-1] or label.shape[-1] != 1:
        raise ValueError(
            f"label of shape {label.shape} does not fit logits of shape {logits.shape}: it must "
            "be the logits' shape without the vocabulary dimension, or with 1 in its place"
        )
    if not jnp.issubdtype(label.dtype, jnp.integer):
        raise TypeError(f"label must be integers, got {label.dtype}")
    x = constrain(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), ("vocab",))
    # Each reduction over the vocabulary is a per-token all-reduce over mp; the label's logit
    # is picked by a masked sum (a gather from split logits would gather them whole).
    top = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    total = jnp.sum(jnp.exp(x - top), axis=-1, keepdims=True)
    hit = jnp.arange(x.shape[-1]) == label
    picked = jnp.sum(jnp.where(hit, x, 0.0), axis=-1, keepdims=True)
    loss = jnp.log(total) + top - picked
    return jnp.where(label == ignore_index, 0.0, loss).astype(logits.dtype)


class ParallelCrossEntropy(nnx.Module):
    """Paddle's ``ParallelCrossEntropy(mp_group=None, name=None, ignore_index=-100)``:
    `parallel_cross_entropy` as a layer, ``loss = layer(input, label)``."""

    def __init__(self, ignore_index: int = -100) -> None:
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")
        self.ignore_index = ignore_index

    def __call__(self, input: jax.Array, label: jax.Array) -> jax.Array:
        """The per-token loss, ``[..., 1]``."""
        return parallel_cross_entropy(input, label, ignore_index=self.ignore_index)
