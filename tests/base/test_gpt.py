"""The example GPT (examples/gpt.py): split over mp it gives one device's loss and gradients, and
XLA compiles exactly Megatron's communication."""

import dataclasses
import math
import pathlib
import re
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hlo import collectives
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fleetjax.mesh import build_mesh
from fleetjax.transforms import recompute
from fleetjax.transforms.pipeline import PipelineLayer, PipelineParams, pipeline

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
from gpt import Attention, GPTConfig, make_gpt

ROWS = 8
CONFIG = GPTConfig(
    vocab_size=64,
    max_position_embeddings=8,
    hidden_size=16,
    num_attention_heads=4,
    num_hidden_layers=2,
    intermediate_size=32,
    initializer_range=0.2,
)
LENGTH, WIDTH = CONFIG.max_position_embeddings, CONFIG.hidden_size
DATA = P(("dp", "sharding"))


@pytest.fixture(scope="module")
def gpt():
    return make_gpt(CONFIG, seed=0)


@pytest.fixture(scope="module")
def batch():
    tokens = jax.random.randint(jax.random.key(1), (ROWS, LENGTH + 1), 0, CONFIG.vocab_size)
    return {"tokens": tokens}


@pytest.fixture(scope="module")
def reference(gpt, batch):
    """Loss and gradients on one device."""
    model, params = gpt
    device = jax.devices()[0]
    return jax.jit(jax.value_and_grad(model.loss_fn))(*jax.device_put((params, batch), device))


def placed(model, params, batch, mesh):
    """(params, batch) placed by the partition specs, and their shardings."""
    shardings = (
        jax.tree.map(lambda s: NamedSharding(mesh, s), model.partition_specs(mesh=mesh)),
        {"tokens": NamedSharding(mesh, DATA)},
    )
    # On Explicit axes the traced types come from the arguments, so they are placed first.
    return jax.device_put((params, batch), shardings), shardings


# mp=4 under -m slow (test_layers.py has mp=4 by default): the default suite's time
MESHES = [(8, 1, AxisType.Auto), (4, 2, AxisType.Auto), (4, 2, AxisType.Explicit)] + [
    pytest.param(2, 4, kind, marks=pytest.mark.slow) for kind in (AxisType.Auto, AxisType.Explicit)
]


@pytest.mark.parametrize(("dp", "mp", "kind"), MESHES, ids=lambda x: getattr(x, "name", x))
def test_loss_and_gradients_equal_one_device(gpt, batch, reference, dp, mp, kind):
    model, params = gpt
    mesh = build_mesh(dp=dp, mp=mp, axis_types=kind)
    args, (param_sharding, batch_sharding) = placed(model, params, batch, mesh)
    with jax.set_mesh(mesh):
        step = jax.jit(
            jax.value_and_grad(model.loss_fn),
            in_shardings=(param_sharding, batch_sharding),
            out_shardings=(NamedSharding(mesh, P()), param_sharding),
        )
        loss, grads = jax.block_until_ready(step(*args))
    expected_loss, expected_grads = reference
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    assert abs(float(loss) - np.log(CONFIG.vocab_size)) > 0.05  # a trained-looking, not flat, loss
    chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-6)
    assert grads["blocks"]["fc_in"]["weight"].sharding.spec == P(None, None, "mp")


@pytest.mark.parametrize("mp", [2, 4])
def test_parameters_are_really_split(gpt, batch, mp):
    model, params = gpt
    (params, _), _ = placed(model, params, batch, build_mesh(mp=mp))
    shard = lambda x: x.addressable_shards[0].data.shape  # noqa: E731
    layers, vocab, ff = CONFIG.num_hidden_layers, CONFIG.vocab_size, CONFIG.intermediate_size
    assert shard(params["embed"]["word_embeddings"]["weight"]) == (vocab // mp, WIDTH)
    assert shard(params["head"]["lm_head"]["weight"]) == (WIDTH, vocab // mp)
    assert shard(params["blocks"]["attn"]["qkv_proj"]["weight"]) == (layers, WIDTH, 3 * WIDTH // mp)
    assert shard(params["blocks"]["attn"]["out_proj"]["weight"]) == (layers, WIDTH // mp, WIDTH)
    assert shard(params["blocks"]["fc_in"]["weight"]) == (layers, WIDTH, ff // mp)
    assert shard(params["blocks"]["fc_out"]["weight"]) == (layers, ff // mp, WIDTH)
    assert shard(params["blocks"]["ln_1"]["scale"]) == (layers, WIDTH)
    assert shard(params["embed"]["position_embeddings"]) == (LENGTH, WIDTH)


def test_pipeline_cut_equals_the_loss(gpt, batch, reference):
    model, params = gpt
    parts = model.pipeline_params(params)
    assert isinstance(parts, PipelineParams)
    assert parts.layers is params["blocks"]
    assert jax.tree.leaves(parts.layers)[0].shape[0] == CONFIG.num_hidden_layers

    def cut(parts, batch):
        h = model.embed(parts.embed, batch)
        h, _ = jax.lax.scan(lambda h, p: (model.stage(p, h), None), h, parts.layers)
        return model.head_loss(parts.head, h, batch)

    np.testing.assert_allclose(jax.jit(cut)(parts, batch), reference[0], rtol=1e-6)
    specs = model.pipeline_params(model.partition_specs())
    assert specs.layers["fc_in"]["weight"] == P(None, None, "mp")  # cut the same way


@pytest.mark.slow
def test_runs_in_the_pipeline_transform_with_mp(gpt, batch, reference):
    """The cut model in fleetjax.transforms.pipeline over dp=2 x pp=2 x mp=2 (Auto axes)."""
    model, params = gpt
    mesh = build_mesh(dp=2, pp=2, mp=2)
    specs = model.pipeline_params(model.partition_specs(mesh=mesh))
    specs = specs._replace(layers=jax.tree.map(lambda s: P("pp", *s[1:]), specs.layers))
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    parts = jax.device_put(model.pipeline_params(params), shardings)
    step = pipeline(
        model.embed,
        model.stage,
        model.head_loss,
        mesh=mesh,
        micro_batch_size=2,
        accumulate_steps=2,
    )
    with jax.set_mesh(mesh):
        loss, grads = jax.block_until_ready(jax.jit(step)(parts, batch))
    expected_loss, expected_grads = reference  # micro-batches of equal size: the same mean
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, model.pipeline_params(expected_grads), rtol=1e-5, atol=1e-6)


def test_attention_is_the_causal_softmax_formula():
    """`jax.nn.dot_product_attention` (XLA's on CPU) gives what the formula gives: softmax of
    q k^T / sqrt(head_dim), causally masked, times v, between the two projections."""
    attention = Attention(CONFIG, rngs=nnx.Rngs(3))
    p = nnx.to_pure_dict(nnx.state(attention))
    x = jax.random.normal(jax.random.key(4), (ROWS, LENGTH, WIDTH))
    heads, head_dim = CONFIG.num_attention_heads, CONFIG.head_dim
    qkv = x @ p["qkv_proj"]["weight"] + p["qkv_proj"]["bias"]
    q, k, v = jnp.moveaxis(qkv.reshape(ROWS, LENGTH, heads, 3, head_dim), 3, 0)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    scores = jnp.where(jnp.tril(jnp.ones((LENGTH, LENGTH), bool)), scores, -jnp.inf)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    expected = out.reshape(ROWS, LENGTH, WIDTH) @ p["out_proj"]["weight"] + p["out_proj"]["bias"]
    np.testing.assert_allclose(jax.jit(attention)(x), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="attention_implementation must be None, 'xla' or 'cudnn'"):
        GPTConfig(attention_implementation="flash")


def test_layers_are_marked_for_recompute(gpt, batch, reference):
    model, params = gpt
    with recompute.recompute_scope() as tracing:
        jaxpr = jax.make_jaxpr(jax.grad(model.loss_fn))(params, batch)
    assert tracing.layers == 1  # the scan body, traced once
    assert "checkpoint" in str(jaxpr) or "remat" in str(jaxpr)


def compiled_collectives(fn, args, shardings, mesh, wrt=None):
    """(op, result shapes) of every collective XLA compiled for `fn` (or its gradient)."""
    fn = fn if wrt is None else jax.grad(fn, argnums=wrt)
    with jax.set_mesh(mesh):
        hlo = jax.jit(fn, in_shardings=shardings).lower(*args).compile().as_text()
    return [
        (c.op, re.findall(r"[a-z]+\d*\[[\d,]*\]", c.shape), c.group_size) for c in collectives(hlo)
    ]


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=lambda k: k.name)
def test_one_block_has_exactly_megatrons_two_all_reduces(gpt, kind):
    model, params = gpt
    mesh = build_mesh(dp=4, mp=2, axis_types=kind)
    layer = jax.tree.map(lambda x: x[0], params["blocks"])
    specs = jax.tree.map(lambda s: P(*s[1:]), model.partition_specs(mesh=mesh)["blocks"])
    shardings = (jax.tree.map(lambda s: NamedSharding(mesh, s), specs), NamedSharding(mesh, DATA))
    h = jax.random.normal(jax.random.key(2), (ROWS, LENGTH, WIDTH))
    args = jax.device_put((layer, h), shardings)
    rows = f"f32[{ROWS // 4},{LENGTH},{WIDTH}]"
    # One after attention's output projection, one after the MLP's; each over the 2 mp devices.
    megatron = [("all-reduce", [rows], 2), ("all-reduce", [rows], 2)]
    assert compiled_collectives(model.stage, args, shardings, mesh) == megatron
    # Without jax.set_mesh the layers take the mesh from the placed arguments' types.
    hlo = jax.jit(model.stage).lower(*args).compile().as_text()
    assert [(c.op, c.group_size) for c in collectives(hlo)] == [("all-reduce", 2)] * 2


def test_embedding_and_cross_entropy_never_communicate_logits(gpt, batch):
    model, params = gpt
    mesh = build_mesh(dp=4, mp=2)
    (params, batch), (specs, batch_sharding) = placed(model, params, batch, mesh)
    h = jax.device_put(jnp.ones((ROWS, LENGTH, WIDTH)), NamedSharding(mesh, DATA))
    rows, per_token, scalar = (
        f"f32[{ROWS // 4},{LENGTH},{WIDTH}]",
        f"f32[{ROWS // 4},{LENGTH}]",
        "f32[]",
    )
    embed = compiled_collectives(
        model.embed, (params["embed"], batch), (specs["embed"], batch_sharding), mesh
    )
    assert embed == [("all-reduce", [rows], 2)]  # the looked-up rows, summed over mp
    head_args = (params["head"], h, batch)
    head_shardings = (specs["head"], NamedSharding(mesh, DATA), batch_sharding)
    forward = compiled_collectives(model.head_loss, head_args, head_shardings, mesh)
    backward = compiled_collectives(model.head_loss, head_args, head_shardings, mesh, wrt=1)
    # Per token: the max, then the sum of exponentials and the label's logit; the mean's scalar
    # over dp. Backward: the per-token sums again and the gradient rows of lm_head's input.
    assert forward == [
        ("all-reduce", [per_token], 2),
        ("all-reduce", [per_token, per_token], 2),
        ("all-reduce", [scalar], 4),
    ]
    assert {shape for _, shapes, _ in backward for shape in shapes} <= {per_token, rows, scalar}


def test_dropout_takes_the_keys_a_pipeline_would_give(batch):
    """With hidden_dropout_prob the loss takes the step key and splits it among the parts as
    `PipelineLayer` (a pipeline of one micro-batch) does; without a key it is an error."""
    model, params = make_gpt(dataclasses.replace(CONFIG, hidden_dropout_prob=0.25), seed=0)
    key = jax.random.fold_in(jax.random.PRNGKey(7), 0)
    loss = jax.jit(model.loss_fn)(params, batch, key)
    layer = PipelineLayer(model.embed, model.stage, model.head_loss)
    cut = jax.jit(layer)(model.pipeline_params(params), batch, key)
    np.testing.assert_allclose(cut, loss, rtol=1e-6)
    other = jax.jit(model.loss_fn)(params, batch, jax.random.fold_in(key, 1))
    undropped = jax.jit(make_gpt(CONFIG, seed=0)[0].loss_fn)(params, batch)
    assert len({float(loss), float(other), float(undropped)}) == 3
    with pytest.raises(ValueError, match=r"hidden_dropout_prob=0.25 needs a PRNG key: .*has_rng"):
        model.loss_fn(params, batch)
    with pytest.raises(ValueError, match=r"hidden_dropout_prob must be in \[0, 1\), got 1.0"):
        GPTConfig(hidden_dropout_prob=1.0)


def test_bad_config_and_batch(gpt):
    model, params = gpt
    too_long = {"tokens": jnp.zeros((2, LENGTH + 2), jnp.int32)}
    with pytest.raises(ValueError, match="sequences of 9 tokens are longer than max_position_"):
        model.loss_fn(params, too_long)
    with pytest.raises(ValueError, match=r"hidden_size \(30\) must be a multiple of num_att"):
        GPTConfig(hidden_size=30)
    with pytest.raises(ValueError, match="GPTConfig.vocab_size must be positive, got 0"):
        GPTConfig(vocab_size=0)
    with pytest.raises(ValueError, match="GPTConfig.num_hidden_layers must be an int, got 2.0"):
        GPTConfig(num_hidden_layers=2.0)
