"""The tanh MLP that the overhead and ZeRO-staircase benchmarks train: square fp32 weight
matrices (what ZeRO shards) and small biases (which it keeps whole), and a regression loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Arrays = dict[str, np.ndarray]


def loss_fn(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    h = batch["x"]
    for i in range(len(params) // 2):
        h = jnp.tanh(h @ params[f"w{i}"] + params[f"b{i}"])
    return jnp.mean((h - batch["y"]) ** 2)


def inputs(layers: int, width: int, rows: int) -> tuple[Arrays, Arrays]:
    """Parameters `w0, b0, ...` of `layers` [width, width] layers and a batch of `rows` rows."""
    rng = np.random.RandomState(0)
    params = {}
    for i in range(layers):
        params[f"w{i}"] = (rng.randn(width, width) / np.sqrt(width)).astype(np.float32)
        params[f"b{i}"] = np.zeros(width, np.float32)
    batch = {
        "x": rng.randn(rows, width).astype(np.float32),
        "y": rng.randn(rows, width).astype(np.float32),
    }
    return params, batch
