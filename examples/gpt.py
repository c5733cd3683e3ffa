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

With `GPTConfig.num_experts` the MLP is a mixture of experts (`fleetjax.layers.MoELayer`, SwiGLU
`ExpertMLP`s behind a `TopKRouter`, dropless by default), whose experts split over the expert
axes ``ep`` x ``mp``: Mixtral's and DeepSeek-V3's blocks. It balances its experts' load as
DeepSeek-V3 does, by a per-expert selection bias (`GPTConfig.moe_bias_update_rate`), which is
model state, or by Switch's auxiliary loss (`GPTConfig.moe_aux_loss_coeff`). A MoE GPT
keeps each layer's load of its last step as model state (`GPTFunctions.moe_load`), and its
loss reports it as metrics: ``moe/blocks/<layer>/max_violation`` (MaxVio), ``dropped``,
``rounds`` and ``aux_loss``.

The blocks' parameters are stacked on a leading layer axis (logical name ``"layers"``) and run
by a `lax.scan` whose body is marked with `fleetjax.recompute`; the model is also cut into
``embed -> stage (once per layer) -> head_loss`` for `fleetjax.transforms.pipeline`:

    gpt, params = make_gpt(GPTConfig(), seed=0)      # params: nested dicts of arrays
    loss = gpt.loss_fn(params, {"tokens": tokens})   # tokens: int32[B, T + 1]
    loss = gpt.loss_fn(params, batch, key)           # with hidden_dropout_prob > 0
    specs = gpt.partition_specs(mesh=mesh)           # PartitionSpecs like params
    parts = gpt.pipeline_params(params)              # PipelineParams(embed, layers, head)
    model = gpt.pipeline_layer()                     # the loss a pipeline trains on parts
    state = gpt.model_state()                        # MoE: the experts' bias and load
    loss, metrics, state = gpt.loss_fn(params, state, batch)  # MoE: has_aux, has_state
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

import fleetjax
from fleetjax.layers import (
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    ExpertBias,
    ExpertMLP,
    LogicalRules,
    MoEAux,
    MoELayer,
    ParallelCrossEntropy,
    RowParallelLinear,
    RowSequenceParallelLinear,
    TopKRouter,
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
      num_experts: 0 for the dense MLP; else the MLP is a MoE layer of this many SwiGLU
        experts (PaddleNLP's Qwen2-MoE name; Mixtral's ``num_local_experts``).
      num_experts_per_tok: experts a token goes to, k.
      moe_intermediate_size: an expert's hidden width (0: `intermediate_size`).
      shared_expert_intermediate_size: a shared SwiGLU expert every token also goes through,
        of this width (DeepSeek-V3's and Qwen2-MoE's); 0 for none.
      moe_score_function: the router's ``"softmax"`` (Mixtral) or ``"sigmoid"`` (DeepSeek-V3,
        its k weights normalised) scores.
      moe_bias_update_rate: DeepSeek-V3's aux-loss-free balancing: the per-expert selection
        bias moves by this much a step (0: none).
      moe_aux_loss_coeff: the load-balancing loss's coefficient (Megatron's
        ``--moe-aux-loss-coeff``; 0: none).
      moe_capacity_factor: None for dropless dispatch, else each expert's capacity factor.
      moe_buffer: dropless dispatch's receive buffer over the balanced size, less 1.
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
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_bias_update_rate: float = 0.0
    moe_aux_loss_coeff: float = 0.0
    moe_capacity_factor: float | None = None
    moe_buffer: float = 0.25

    # The fields that may be 0 (the others must be positive), and those that are no sizes.
    MAY_BE_ZERO = ("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size")
    NOT_SIZES = (
        "hidden_dropout_prob",
        "sequence_parallel",
        "attention_implementation",
        "moe_score_function",
        "moe_bias_update_rate",
        "moe_aux_loss_coeff",
        "moe_capacity_factor",
        "moe_buffer",
    )

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
            if field.name in self.NOT_SIZES:
                continue
            if field.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"GPTConfig.{field.name} must be an int, got {value!r}")
            if value < 0 or (value == 0 and field.name not in self.MAY_BE_ZERO):
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
    def moe(self) -> bool:
        """Whether the MLP is a mixture of experts."""
        return self.num_experts > 0

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


def _moe(config: GPTConfig, rngs: nnx.Rngs) -> MoELayer:
    """The MoE MLP: SwiGLU experts behind a top-k router (DeepSeek-V3's sigmoid scores are
    normalised over the k), and the shared expert where there is one."""
    init = nnx.initializers.normal(config.initializer_range)
    width = config.moe_intermediate_size or config.intermediate_size

    def swiglu(hidden: int) -> ExpertMLP:
        return ExpertMLP(
            config.hidden_size, hidden, activation="silu", gated=True, weight_init=init, rngs=rngs
        )

    sigmoid = config.moe_score_function == "sigmoid"
    router = TopKRouter(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        score_function=config.moe_score_function,
        normalize_top_k=sigmoid,
        bias_update_rate=config.moe_bias_update_rate,
        aux_loss_coeff=config.moe_aux_loss_coeff,
        rngs=rngs,
    )
    shared = config.shared_expert_intermediate_size
    return MoELayer(
        config.hidden_size,
        [swiglu(width) for _ in range(config.num_experts)],
        router,
        shared_expert=swiglu(shared) if shared else None,
        capacity_factor=config.moe_capacity_factor,
        buffer=config.moe_buffer,
    )


class Block(nnx.Module):
    """A pre-LayerNorm transformer block: two all-reduces over mp in the forward pass (with a
    MoE MLP, one, and the experts' all-to-alls over the expert axes)."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.normal(config.initializer_range)
        self.dropout, self.hidden = config.hidden_dropout_prob, config.hidden
        column, row = config.linears()
        self.ln_1 = _layer_norm(config, rngs)
        self.attn = Attention(config, rngs=rngs)
        self.ln_2 = _layer_norm(config, rngs)
        self.moe = _moe(config, rngs) if config.moe else nnx.data(None)
        if config.moe:
            self.fc_in = self.fc_out = nnx.data(None)
            return
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
        if self.moe is not None:
            mlp = self.moe(name(self.ln_2(h), "ln_2_output"))
        else:
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


LOAD = "moe_load"  # a MoE block's load in its model state, beside its bias


class MoELoad(NamedTuple):
    """What a MoE layer saw in its last call (`fleetjax.layers.MoEStats`): ``tokens_per_expert``
    ([experts] assignments), ``max_violation`` (MaxVio: max over mean expert load, less 1),
    ``dropped`` assignments, all-to-all ``rounds`` and ``aux_loss`` (its weighted auxiliary
    losses)."""

    tokens_per_expert: jax.Array
    max_violation: jax.Array
    dropped: jax.Array
    rounds: jax.Array
    aux_loss: jax.Array


def _zeros(a: Any) -> jax.Array:
    return jnp.zeros(a.shape, a.dtype)


class GPTFunctions:
    """The GPT as pure functions of plain parameter pytrees (nested dicts of arrays:
    `nnx.to_pure_dict` of the model's `nnx.Param` state), for `jax.jit`,
    `fleetjax.make_train_step` and `fleetjax.transforms.pipeline`.

    A MoE GPT (`GPTConfig.num_experts`) keeps model state (`has_state`): each layer's experts'
    balancing bias (`ExpertBias`) and the load of its last call (`moe_load`); its loss takes
    the state after the parameters and also returns metrics (`has_aux`):
    ``loss_fn(params, model_state, batch[, key]) -> (loss, metrics, new_model_state)``, the
    loss with the layers' auxiliary losses added. Train it with ``make_train_step(gpt.loss_fn,
    ..., has_aux=gpt.has_aux, has_state=gpt.has_state)`` and ``step.init(params,
    model_state=gpt.model_state())``."""

    def __init__(self, model: GPT) -> None:
        self.config = model.config
        self._embed = nnx.graphdef(model.embed)
        block = nnx.eval_shape(lambda: Block(model.config, rngs=nnx.Rngs(0)))
        self._block, _, bias, records = nnx.split(block, nnx.Param, ExpertBias, ...)
        self._bias = nnx.to_pure_dict(bias)
        # What a block records of its last call and never reads back (a gate's loss).
        self._records = jax.tree.map(_zeros, nnx.to_pure_dict(records))
        self._head = nnx.graphdef(model.head)
        self._state = nnx.eval_shape(lambda: nnx.state(model, nnx.Param))  # shapes and names

    @property
    def has_state(self) -> bool:
        """Whether the blocks keep model state: a MoE GPT's bias and load."""
        return self.config.moe

    @property
    def has_aux(self) -> bool:
        """Whether `loss_fn` returns metrics beside the loss: a MoE GPT's load."""
        return self.config.moe

    def model_state(self) -> Params | None:
        """The blocks' model state at the start (the bias at 0, no load seen), as `loss_fn`
        takes it; None for a dense GPT."""
        if not self.has_state:
            return None
        load = MoELoad(
            tokens_per_expert=jnp.zeros((self.config.num_experts,), jnp.float32),
            max_violation=jnp.zeros((), jnp.float32),
            dropped=jnp.zeros((), jnp.int32),
            rounds=jnp.zeros((), jnp.int32),
            aux_loss=jnp.zeros((), jnp.float32),
        )
        layers = self.config.num_hidden_layers
        stacked = lambda a: jnp.zeros((layers, *a.shape), a.dtype)  # noqa: E731
        return {"blocks": jax.tree.map(stacked, {**self._bias, LOAD: load._asdict()})}

    @staticmethod
    def moe_load(model_state: Params) -> MoELoad:
        """Each layer's load of the last step, from the model state the step returned (each
        field stacked over the layers: ``tokens_per_expert`` is [layers, experts])."""
        return MoELoad(**model_state["blocks"][LOAD])

    def loss_fn(self, params: Params, *args: Any) -> Any:
        """The mean next-token loss of ``batch["tokens"]`` (int32 [B, T + 1]):
        ``loss_fn(params, batch[, key])``, or for a MoE GPT ``loss_fn(params, model_state,
        batch[, key]) -> (loss + auxiliary losses, metrics, new_model_state)``, the metrics
        each layer's load (``moe/blocks/<layer>/<MoELoad field>``, but the per-expert counts);
        with dropout, `key` is the step's PRNG key, split among the parts as a pipeline of one
        micro-batch splits it (`fleetjax.transforms.pipeline.part_keys`)."""
        parts = self.pipeline_params(params)
        if not self.has_state:
            return self._layer(1)(parts, *args)
        state, *rest = args
        loss, new = self._layer(1)(parts, self.pipeline_params(state), *rest)
        load = self.moe_load({"blocks": new.layers})
        metrics = {
            f"moe/blocks/{layer}/{name}": value[layer]
            for name, value in load._asdict().items()
            if name != "tokens_per_expert"
            for layer in range(self.config.num_hidden_layers)
        }
        return loss + jnp.sum(load.aux_loss), metrics, {"blocks": new.layers}

    def pipeline_layer(self, num_virtual_pipeline_stages: int = 1) -> PipelineLayer:
        """The GPT cut for a pipeline (on `pipeline_params`), which also trains unpipelined:
        the blocks marked for recompute, their rows kept split over the data axes (without a
        pipeline nothing else splits them, and XLA might gather the activations instead of
        the parameters that ZeRO-3 splits over `sharding`). A MoE GPT's parts take their
        state after their parameters and return their new state last; its load is model
        state, its auxiliary losses reach the loss only by `loss_fn`.

        Raises:
          ValueError: for a MoE GPT with an auxiliary loss (`GPTConfig.moe_aux_loss_coeff`),
            which this cut would not train.
        """
        if self.config.moe_aux_loss_coeff:
            raise ValueError(
                f"GPTConfig.moe_aux_loss_coeff={self.config.moe_aux_loss_coeff}: the pipeline "
                "cut of a MoE GPT does not add its auxiliary losses to the loss; train "
                "GPTFunctions.loss_fn, or balance by moe_bias_update_rate"
            )
        return self._layer(num_virtual_pipeline_stages)

    def _layer(self, num_virtual_pipeline_stages: int) -> PipelineLayer:
        """`pipeline_layer`, unchecked."""
        rows = ("activation_batch", *self.config.hidden)  # the rows over the data axes
        if not self.has_state:
            return PipelineLayer(
                lambda p, batch, *key: constrain(self.embed(p, batch, *key), rows),
                fleetjax.recompute(lambda p, h, *key: constrain(self.stage(p, h, *key), rows)),
                self.head_loss,
                num_virtual_pipeline_stages=num_virtual_pipeline_stages,
            )

        def stage(p: Params, state: Params, h: jax.Array, *key: jax.Array) -> tuple:
            h, state = self.moe_stage(p, state, h, *key)
            return constrain(h, rows), state

        return PipelineLayer(
            lambda p, state, batch, *key: (constrain(self.embed(p, batch, *key), rows), state),
            fleetjax.recompute(stage),
            lambda p, state, h, batch, *key: (self.head_loss(p, h, batch, *key), state),
            num_virtual_pipeline_stages=num_virtual_pipeline_stages,
        )

    def embed(self, embed_params: Params, batch: Batch, key: jax.Array | None = None) -> jax.Array:
        """Tokens ``[:, :-1]`` to the residual stream [B, T, hidden_size]."""
        return nnx.merge(self._embed, embed_params)(batch["tokens"][:, :-1], key)

    def stage(self, layer_params: Params, h: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """One block (parameters of one layer: a slice of ``params["blocks"]``)."""
        return nnx.merge(self._block, layer_params, self._records)(h, key)

    def moe_stage(
        self, layer_params: Params, layer_state: Params, h: jax.Array, key: jax.Array | None = None
    ) -> tuple[jax.Array, Params]:
        """One MoE block: its output and its new state (the bias it moved, the load it saw)."""
        bias = {name: value for name, value in layer_state.items() if name != LOAD}
        block = nnx.merge(self._block, layer_params, bias, self._records)
        out, captured = nnx.capture(block, MoEAux)(h, key)
        (stats,) = captured["moe"]["stats"].get_value()
        load = MoELoad(
            stats.tokens_per_expert, stats.max_violation, stats.dropped, stats.rounds, stats.loss
        )
        return out, {**nnx.to_pure_dict(nnx.state(block, ExpertBias)), LOAD: load._asdict()}

    def head_loss(
        self, head_params: Params, h: jax.Array, batch: Batch, key: jax.Array | None = None
    ) -> jax.Array:
        """The mean loss of predicting tokens ``[:, 1:]`` from the residual stream (`key` is
        accepted for the pipeline's `has_rng` and unused: the head has no dropout)."""
        return nnx.merge(self._head, head_params)(h, batch["tokens"][:, 1:])

    @staticmethod
    def pipeline_params(params: Params) -> PipelineParams:
        """`params` (or anything shaped like them: gradients, PartitionSpecs, the model state)
        cut for the pipeline: `PipelineParams(embed, layers, head)`, layers stacked in model
        order."""
        return PipelineParams(params.get("embed", {}), params["blocks"], params.get("head", {}))

    def partition_specs(
        self, *, rules: LogicalRules | None = None, mesh: Mesh | None = None
    ) -> Params:
        """A PartitionSpec for every parameter, shaped like the params (see
        `fleetjax.layers.partition_specs`)."""
        return nnx.to_pure_dict(partition_specs(self._state, rules=rules, mesh=mesh))


def make_gpt(config: GPTConfig, *, seed: int = 0) -> tuple[GPTFunctions, Params]:
    """The GPT's functions and its freshly initialised parameters (on the default device)."""
    model = GPT(config, rngs=nnx.Rngs(seed))
    return GPTFunctions(model), nnx.to_pure_dict(nnx.state(model, nnx.Param))
