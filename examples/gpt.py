"""A small GPT built from fleetjax's Megatron layers, split over ``mp`` as Paddle's GPT is.

Token embedding (`VocabParallelEmbedding`) plus learned positions; N pre-LayerNorm blocks of
causal multi-head attention (q, k and v from one `ColumnParallelLinear`, heads split over
``mp``; the output projection a `RowParallelLinear`) and an MLP (`ColumnParallelLinear` ->
gelu -> `RowParallelLinear`); a final LayerNorm, a vocabulary-parallel output projection and
`ParallelCrossEntropy`. Each block costs two all-reduces over ``mp`` in the forward pass; with
`GPTConfig.sequence_parallel` (Megatron's sequence parallelism, Paddle's sequence-parallel
linears) each is a reduce-scatter and an all-gather instead. Attention is
`fleetjax.layers.attention` (where the sequence is whole, XLA's attention keeping its bf16
probabilities alone for the backward pass, as Megatron's fused softmax): over a mesh with
``sep`` or ``cp`` axes the sequence is split and attention exchanges heads (``sep``)
or runs as a ring (``cp``); under ``cp`` the model keeps its tokens in the ring's load-balanced
order (`fleetjax.layers.to_load_balanced`).

The blocks' parameters are stacked on a leading layer axis (logical name ``"layers"``) and run
by a `lax.scan` whose body is marked with `fleetjax.recompute`; the model is also cut into
``embed -> stage (once per layer) -> head_loss`` for `fleetjax.transforms.pipeline`:

    gpt, params = make_gpt(GPTConfig(), seed=0)      # params: nested dicts of arrays
    loss = gpt.loss_fn(params, {"tokens": tokens})   # tokens: int32[B, T + 1]
    loss = gpt.loss_fn(params, batch, key)           # with hidden_dropout_prob > 0
    specs = gpt.partition_specs(mesh=mesh)           # PartitionSpecs like params
    parts = gpt.pipeline_params(params)              # PipelineParams(embed, layers, head)
    model = gpt.pipeline_layer()                     # the loss a pipeline trains on parts
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import fleetjax
from fleetjax.layers import (
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    LogicalRules,
    ParallelCrossEntropy,
    RowParallelLinear,
    RowSequenceParallelLinear,
    VocabParallelEmbedding,
    attention,
    constrain,
    logical_param,
    partition_specs,
    to_load_balanced,
)
from fleetjax.transforms.pipeline import PipelineLayer, PipelineParams

Params = dict[str, Any]
Batch = dict[str, jax.Array]

# Activations are constrained by their trailing dimensions: the batch dimension keeps the
# sharding it arrives with, except where ROWS splits it over the data axes (inside a pipeline,
# where each device runs its own replica, those axes are manual and the constraint leaves them).
HIDDEN = ("activation_length", "activation_embed")  # the residual stream [batch, length, embed]
# Under sequence parallelism the residual stream's sequence is split over mp too.
SEQUENCE_PARALLEL_HIDDEN = ("activation_norm_length", "activation_embed")
HEADS = ("activation_length", "activation_heads", "activation_kv")  # q, k, v
# The tensors a Megatron-LM layer keeps for its backward pass (Korthikanti et al. 2022, 4.1;
# the block's input is kept as the scanned layers' carry), named with `fleetjax.checkpoint_name`:
# ``recompute_configs={"checkpoints": MEGATRON_KEPT}`` keeps these and recomputes the rest,
# attention's scores included (Korthikanti's selective recompute).
MEGATRON_KEPT = (
    "ln_1_output",  # the q, k, v projection's input
    "qkv",
    "attention_output",  # the output projection's input
    "ln_2_input",  # the residual after attention
    "ln_2_output",  # the MLP's input
    "fc_in_output",  # gelu's input
    "gelu_output",  # the second MLP linear's input
)


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The GPT's sizes (Paddle GPT's names where it has them).

    Attributes:
      vocab_size: tokens in the vocabulary (split over mp: a multiple of mp_degree).
      max_position_embeddings: the longest sequence, T (tokens are [B, T + 1] at most).
      hidden_size: the residual width.
      num_attention_heads: heads; each mp device runs num_attention_heads / mp of them.
      num_hidden_layers: transformer blocks.
      intermediate_size: the MLP's hidden width (split over mp).
      initializer_range: the std of the normal initial weights.
      layer_norm_epsilon: the LayerNorms' epsilon (Paddle's 1e-5).
      hidden_dropout_prob: dropout of the embeddings and of each block's attention and MLP
        outputs (Paddle GPT's, which defaults to 0.1; 0 here). Above 0 the model's functions
        need a PRNG key: `make_train_step(..., has_rng=True)`.
      sequence_parallel: Megatron's sequence parallelism over mp (Paddle GPT's): the
        sequence-parallel linears, and the residual stream split along the sequence over mp.
      attention_implementation: `fleetjax.layers.attention`'s ``implementation``: None
        (XLA's attention on every backend, keeping only its probabilities, in bf16 under AMP,
        for the backward pass, as Megatron's fused softmax), or `jax.nn.dot_product_attention`'s
        ``"xla"`` (whose autodiff also keeps the float32 scores) or ``"cudnn"`` (cuDNN's fused
        flash attention on NVIDIA GPUs, which keeps no [heads, T, T] scores; it takes bf16 or
        fp16 only, so float32 q, k and v are cast to bfloat16 for it, and it needs the cuDNN
        library even to compile: ``pip install -e '.[aot-cudnn]'`` without a GPU). Under
        ``cp`` the ring attention runs instead.
    """

    vocab_size: int = 128
    max_position_embeddings: int = 16
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    intermediate_size: int = 128
    initializer_range: float = 0.02
    layer_norm_epsilon: float = 1e-5
    hidden_dropout_prob: float = 0.0
    sequence_parallel: bool = False
    attention_implementation: Literal["xla", "cudnn"] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.hidden_dropout_prob < 1:
            raise ValueError(
                f"GPTConfig.hidden_dropout_prob must be in [0, 1), got {self.hidden_dropout_prob!r}"
            )
        if self.attention_implementation not in (None, "xla", "cudnn"):
            raise ValueError(
                "GPTConfig.attention_implementation must be None, 'xla' or 'cudnn', got "
                f"{self.attention_implementation!r}"
            )
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in (
                "hidden_dropout_prob",
                "sequence_parallel",
                "attention_implementation",
            ):
                continue
            if field.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"GPTConfig.{field.name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"GPTConfig.{field.name} must be positive, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"GPTConfig.hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def hidden(self) -> tuple[str, str]:
        """The residual stream's logical names (its sequence split over mp too under sequence
        parallelism)."""
        return SEQUENCE_PARALLEL_HIDDEN if self.sequence_parallel else HIDDEN

    def linears(self) -> tuple[Any, Any]:
        """The column- and row-parallel linear layers (Paddle's sequence-parallel ones under
        sequence parallelism, along this model's sequence dimension, 1)."""
        if not self.sequence_parallel:
            return ColumnParallelLinear, RowParallelLinear
        return (
            functools.partial(ColumnSequenceParallelLinear, sequence_axis=1),
            functools.partial(RowSequenceParallelLinear, sequence_axis=1),
        )


def _dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout of `x` at `rate`, with the PRNG `key`."""
    if rate == 0:
        return x
    if key is None:
        raise ValueError(
            f"hidden_dropout_prob={rate} needs a PRNG key: make the step with "
            "make_train_step(..., has_rng=True) (or set hidden_dropout_prob=0)"
        )
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), jnp.zeros_like(x))


def _layer_norm(config: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    names = {"out_sharding": ("embed",), "eager_sharding": False}
    return nnx.LayerNorm(
        config.hidden_size,
        epsilon=config.layer_norm_epsilon,
        scale_metadata=names,
        bias_metadata=names,
        rngs=rngs,
    )


class Embed(nnx.Module):
    """Token embedding (vocabulary split over mp) plus learned positions."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(config.initializer_range)
        self.dropout, self.hidden = config.hidden_dropout_prob, config.hidden
        self.word_embeddings = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, weight_init=init, rngs=rngs
        )
        self.position_embeddings = logical_param(
            init,
            (None, "embed"),
            rngs.params(),
            (config.max_position_embeddings, config.hidden_size),
            jnp.float32,
        )

    def __call__(self, tokens: jax.Array, key: jax.Array | None = None) -> jax.Array:
        longest = self.position_embeddings.shape[0]
        if tokens.shape[-1] > longest:
            raise ValueError(
                f"sequences of {tokens.shape[-1]} tokens are longer than "
                f"max_position_embeddings={longest}"
            )
        positions = to_load_balanced(self.position_embeddings[: tokens.shape[-1]], axis=0)
        h = self.word_embeddings(to_load_balanced(tokens)) + positions
        return constrain(_dropout(h, self.dropout, key), self.hidden)


class Attention(nnx.Module):
    """Causal multi-head attention with q, k, v from one column-parallel projection."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(config.initializer_range)
        self.config = config
        width = config.hidden_size
        column, row = config.linears()
        self.qkv_proj = column(
            width, 3 * width, has_bias=True, gather_output=False, weight_init=init, rngs=rngs
        )
        self.out_proj = row(width, width, input_is_parallel=True, weight_init=init, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, width = x.shape
        heads, head_dim = self.config.num_attention_heads, self.config.head_dim
        # Head-major columns [heads, (q, k, v), head_dim]: an mp device's contiguous block of
        # columns holds whole heads, so attention needs no communication.
        qkv = fleetjax.checkpoint_name(self.qkv_proj(x), "qkv")
        qkv = qkv.reshape(batch, length, heads, 3, head_dim)
        q, k, v = (constrain(qkv[..., i, :], HEADS) for i in range(3))
        implementation = self.config.attention_implementation
        if implementation == "cudnn" and q.dtype == jnp.float32:
            q, k, v = (y.astype(jnp.bfloat16) for y in (q, k, v))  # cuDNN takes bf16/fp16 only
        # The tokens are in the load-balanced order since the embedding (see Embed).
        out = attention(q, k, v, is_causal=True, load_balanced=True, implementation=implementation)
        out = out.astype(x.dtype).reshape(batch, length, width)
        return self.out_proj(fleetjax.checkpoint_name(out, "attention_output"))


class Block(nnx.Module):
    """A pre-LayerNorm transformer block: two all-reduces over mp in the forward pass."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(config.initializer_range)
        self.dropout, self.hidden = config.hidden_dropout_prob, config.hidden
        column, row = config.linears()
        self.ln_1 = _layer_norm(config, rngs)
        self.attn = Attention(config, rngs=rngs)
        self.ln_2 = _layer_norm(config, rngs)
        self.fc_in = column(
            config.hidden_size,
            config.intermediate_size,
            has_bias=True,
            gather_output=False,
            weight_init=init,
            rngs=rngs,
        )
        self.fc_out = row(
            config.intermediate_size,
            config.hidden_size,
            input_is_parallel=True,
            weight_init=init,
            rngs=rngs,
        )

    def __call__(self, h: jax.Array, key: jax.Array | None = None) -> jax.Array:
        attn_key, mlp_key = (None, None) if key is None else jax.random.split(key)
        name = fleetjax.checkpoint_name
        h = h + _dropout(self.attn(name(self.ln_1(h), "ln_1_output")), self.dropout, attn_key)
        h = name(h, "ln_2_input")
        hidden = name(self.fc_in(name(self.ln_2(h), "ln_2_output")), "fc_in_output")
        mlp = self.fc_out(name(jax.nn.gelu(hidden, approximate=False), "gelu_output"))
        h = h + _dropout(mlp, self.dropout, mlp_key)
        return constrain(h, self.hidden)


class Head(nnx.Module):
    """Final LayerNorm, vocabulary-parallel logits and their parallel cross entropy."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.ln_f = _layer_norm(config, rngs)
        self.lm_head = config.linears()[0](
            config.hidden_size,
            config.vocab_size,
            gather_output=False,
            weight_init=nnx.initializers.normal(config.initializer_range),
            rngs=rngs,
        )
        self.loss = ParallelCrossEntropy()

    def __call__(self, h: jax.Array, labels: jax.Array) -> jax.Array:
        """The mean next-token loss (the labels in the tokens' order, see Embed)."""
        return jnp.mean(self.loss(self.lm_head(self.ln_f(h)), to_load_balanced(labels)))


class GPT(nnx.Module):
    """The GPT's parameters: ``embed``, ``blocks`` (stacked on a leading layer axis), ``head``.

    Run it with the pure functions of `GPTFunctions` (see `make_gpt`).
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        self.embed = Embed(config, rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def blocks(rngs: nnx.Rngs) -> Block:
            return Block(config, rngs=rngs)

        self.blocks = blocks(rngs.split(config.num_hidden_layers))
        self.head = Head(config, rngs=rngs)


class GPTFunctions:
    """The GPT as pure functions of plain parameter pytrees (nested dicts of arrays:
    `nnx.to_pure_dict` of the model's state), for `jax.jit`, `fleetjax.make_train_step` and
    `fleetjax.transforms.pipeline`."""

    def __init__(self, model: GPT) -> None:
        self.config = model.config
        self._embed = nnx.graphdef(model.embed)
        self._block = nnx.graphdef(nnx.eval_shape(lambda: Block(model.config, rngs=nnx.Rngs(0))))
        self._head = nnx.graphdef(model.head)
        self._state = nnx.eval_shape(lambda: nnx.state(model))  # shapes and logical names

    def loss_fn(self, params: Params, batch: Batch, *key: jax.Array) -> jax.Array:
        """The mean next-token loss of ``batch["tokens"]`` (int32 [B, T + 1]); with dropout,
        `key` is the step's PRNG key, split among the parts as a pipeline of one micro-batch
        splits it (`fleetjax.transforms.pipeline.part_keys`)."""
        return self.pipeline_layer()(self.pipeline_params(params), batch, *key)

    def pipeline_layer(self, num_virtual_pipeline_stages: int = 1) -> PipelineLayer:
        """The GPT cut for a pipeline (on `pipeline_params`), which also trains unpipelined:
        the blocks marked for recompute, their rows kept split over the data axes (without a
        pipeline nothing else splits them, and XLA might gather the activations instead of
        the parameters that ZeRO-3 splits over `sharding`)."""
        rows = ("activation_batch", *self.config.hidden)  # the rows over the data axes
        return PipelineLayer(
            lambda p, batch, *key: constrain(self.embed(p, batch, *key), rows),
            fleetjax.recompute(lambda p, h, *key: constrain(self.stage(p, h, *key), rows)),
            self.head_loss,
            num_virtual_pipeline_stages=num_virtual_pipeline_stages,
        )

    def embed(self, embed_params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        """Tokens ``[:, :-1]`` to the residual stream [B, T, hidden_size]."""
        return nnx.merge(self._embed, embed_params)(batch["tokens"][:, :-1], key)

    def stage(self, layer_params: Params, h: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """One block (parameters of one layer: a slice of ``params["blocks"]``)."""
        return nnx.merge(self._block, layer_params)(h, key)

    def head_loss(
        self, head_params: Params, h: jax.Array, batch: Batch, key: jax.Array | None = None
    ) -> jax.Array:
        """The mean loss of predicting tokens ``[:, 1:]`` from the residual stream (`key` is
        accepted for the pipeline's `has_rng` and unused: the head has no dropout)."""
        return nnx.merge(self._head, head_params)(h, batch["tokens"][:, 1:])

    @staticmethod
    def pipeline_params(params: Params) -> PipelineParams:
        """`params` (or anything shaped like them: gradients, PartitionSpecs) cut for the
        pipeline: `PipelineParams(embed, layers, head)`, layers stacked in model order."""
        return PipelineParams(params["embed"], params["blocks"], params["head"])

    def partition_specs(
        self, *, rules: LogicalRules | None = None, mesh: Mesh | None = None
    ) -> Params:
        """A PartitionSpec for every parameter, shaped like the params (see
        `fleetjax.layers.partition_specs`)."""
        return nnx.to_pure_dict(partition_specs(self._state, rules=rules, mesh=mesh))


def make_gpt(config: GPTConfig, *, seed: int = 0) -> tuple[GPTFunctions, Params]:
    """The GPT's functions and its freshly initialised parameters (on the default device)."""
    model = GPT(config, rngs=nnx.Rngs(seed))
    return GPTFunctions(model), nnx.to_pure_dict(nnx.state(model))
