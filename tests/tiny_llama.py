"""A Llama-shaped model at test size (token embedding; blocks of RMSNorm, causal attention with
rotary positions and a fused qkv projection, RMSNorm, a SwiGLU MLP with a fused gate/up
projection; a final RMSNorm and the logits), in two spellings of the same computation:

* `Llama(config)`: plain flax nnx layers (`nnx.Embed`, `nnx.Linear`), for
  `dist.parallelize` and its plans (`PLAN`, `SP_PLAN`);
* `Llama(config, fleet=True)`: fleetjax's Megatron layers (`VocabParallelEmbedding`,
  `ColumnParallelLinear`, `RowParallelLinear`, their sequence-parallel forms with `ScatterOp` /
  `GatherOp` under `sequence_parallel`), the Fleet API's model.

Both draw their weights from the same random stream in the same order, so they start equal.
`pipeline_layer(model)` cuts the Fleet spelling by hand into a `PipelineLayer`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import fleetjax
import fleetjax.distributed as dist
from fleetjax import nn
from fleetjax.layers import (
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    GatherOp,
    RowParallelLinear,
    RowSequenceParallelLinear,
    ScatterOp,
    VocabParallelEmbedding,
)

INIT = nnx.initializers.normal(0.2)


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    hidden: int = 32
    heads: int = 4
    mlp: int = 64
    layers: int = 4
    fleet: bool = False  # fleetjax's Megatron layers instead of nnx's
    sequence_parallel: bool = False  # (fleet) Megatron's sequence parallelism over mp


class RMSNorm(nnx.Module):
    def __init__(self, width: int) -> None:
        self.weight = nnx.Param(jnp.ones((width,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * self.weight[...]


def _column(config: Config, width: int, out: int, rngs: nnx.Rngs) -> nnx.Module:
    if not config.fleet:
        return nnx.Linear(width, out, use_bias=False, kernel_init=INIT, rngs=rngs)
    if config.sequence_parallel:
        return ColumnSequenceParallelLinear(
            width, out, gather_output=False, sequence_axis=1, weight_init=INIT, rngs=rngs
        )
    return ColumnParallelLinear(width, out, gather_output=False, weight_init=INIT, rngs=rngs)


def _row(config: Config, width: int, out: int, rngs: nnx.Rngs) -> nnx.Module:
    if not config.fleet:
        return nnx.Linear(width, out, use_bias=False, kernel_init=INIT, rngs=rngs)
    if config.sequence_parallel:
        return RowSequenceParallelLinear(
            width, out, has_bias=False, input_is_parallel=True, sequence_axis=1,
            weight_init=INIT, rngs=rngs,
        )  # fmt: skip
    return RowParallelLinear(
        width, out, has_bias=False, input_is_parallel=True, weight_init=INIT, rngs=rngs
    )


def _rotary(x: jax.Array) -> jax.Array:
    """Rotary positions on [batch, sequence, heads, head_dim]."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000 ** (jnp.arange(half) / half))
    angle = jnp.arange(x.shape[1])[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


class Attention(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs) -> None:
        self.heads = config.heads
        # Columns [heads, (q, k, v), head_dim]: an mp device's block holds whole heads.
        self.qkv_proj = _column(config, config.hidden, 3 * config.hidden, rngs)
        self.o_proj = _row(config, config.hidden, config.hidden, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, width = x.shape
        qkv = self.qkv_proj(x).reshape(b, s, self.heads, 3, width // self.heads)
        q, k, v = _rotary(qkv[..., 0, :]), _rotary(qkv[..., 1, :]), qkv[..., 2, :]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        return self.o_proj(out.reshape(b, s, width))


class MLP(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs) -> None:
        # Columns [mlp, (gate, up)]: an mp device's block holds whole units.
        self.gate_up_proj = _column(config, config.hidden, 2 * config.mlp, rngs)
        self.down_proj = _row(config, config.mlp, config.hidden, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_up = self.gate_up_proj(x).reshape(*x.shape[:-1], -1, 2)
        return self.down_proj(jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1])


class Block(nnx.Module):
    def __init__(self, config: Config, rngs: nnx.Rngs) -> None:
        self.input_layernorm = RMSNorm(config.hidden)
        self.self_attn = Attention(config, rngs)
        self.post_attention_layernorm = RMSNorm(config.hidden)
        self.mlp = MLP(config, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Layer):
    """The model: a Paddle-style `nn.Layer` (`forward`), so that the auto-parallel loop defers
    its calls once an optimizer made with its `parameters()` trains it."""

    def __init__(self, config: Config, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.sequence_parallel = config.fleet and config.sequence_parallel
        if config.fleet:
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab, config.hidden, weight_init=INIT, rngs=rngs
            )
        else:
            self.embed_tokens = nnx.Embed(
                config.vocab, config.hidden, embedding_init=INIT, rngs=rngs
            )
        self.layers = nnx.List([Block(config, rngs) for _ in range(config.layers)])
        self.norm = RMSNorm(config.hidden)
        self.lm_head = _column(config, config.hidden, config.vocab, rngs)

    def forward(self, ids: jax.Array) -> jax.Array:
        x = self.embed_tokens(ids)
        if self.sequence_parallel:
            x = ScatterOp.apply(x, 1)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        if self.sequence_parallel:
            x = GatherOp.apply(x, 1)
        return self.lm_head(x)


# Paddle's Llama plans (the parallelize docstring's), over this model's layer names.
PLAN = {
    "embed_tokens": dist.RowWiseParallel(),
    "layers.*.self_attn.qkv_proj": dist.ColWiseParallel(),
    "layers.*.self_attn.o_proj": dist.RowWiseParallel(),
    "layers.*.mlp.gate_up_proj": dist.ColWiseParallel(),
    "layers.*.mlp.down_proj": dist.RowWiseParallel(),
    "lm_head": dist.ColWiseParallel(),
}
SP_PLAN = {
    **PLAN,
    "embed_tokens": [dist.RowWiseParallel(), dist.SequenceParallelBegin()],
    "layers.*.self_attn": dist.SequenceParallelDisable(),
    "layers.*.mlp": dist.SequenceParallelDisable(),
    "lm_head": [dist.SequenceParallelEnd(), dist.ColWiseParallel()],
}


def batches(count: int, rows: int = 8, length: int = 16, vocab: int = 64) -> list[tuple]:
    """`count` (ids, labels) batches of next-token prediction."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (count, rows, length + 1)).astype(np.int32)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def loss_fn(model: nnx.Module, batch: dict[str, Any]) -> jax.Array:
    """The Fleet API's loss of the model and a batch {"ids", "labels"}."""
    return nn.CrossEntropyLoss()(model(batch["ids"]), batch["labels"])


def pipeline_layer(model: Llama) -> tuple[fleetjax.PipelineLayer, fleetjax.PipelineParams]:
    """The Fleet spelling cut by hand for fleetjax's pipeline: embedding, blocks, head and
    loss; and its parameters."""
    block = nnx.graphdef(model.layers[0])
    embed_graph = nnx.graphdef(model.embed_tokens)
    head_graph = nnx.graphdef(nnx.List([model.norm, model.lm_head]))
    sp = model.sequence_parallel

    def embed(p: Any, batch: Any) -> jax.Array:
        x = nnx.merge(embed_graph, p)(batch["ids"])
        return ScatterOp.apply(x, 1) if sp else x

    def stage(p: Any, h: jax.Array) -> jax.Array:
        return nnx.merge(block, p)(h)

    def head_loss(p: Any, h: jax.Array, batch: Any) -> jax.Array:
        norm, lm_head = nnx.merge(head_graph, p)
        h = norm(h)
        return nn.CrossEntropyLoss()(lm_head(GatherOp.apply(h, 1) if sp else h), batch["labels"])

    stacked = jax.tree.map(
        lambda *xs: jnp.stack(xs),
        *[nnx.to_pure_dict(nnx.state(b, nnx.Param)) for b in model.layers],
    )
    params = fleetjax.PipelineParams(
        nnx.to_pure_dict(nnx.state(model.embed_tokens, nnx.Param)),
        stacked,
        nnx.to_pure_dict(nnx.state(nnx.List([model.norm, model.lm_head]), nnx.Param)),
    )
    return fleetjax.PipelineLayer(embed, stage, head_loss), params
