"""Paddle 3's long-sequence axes on the example GPT: segment parallelism (`sep_degree`),
context parallelism (`cp_degree`, ring attention) and Megatron's sequence parallelism over mp
train to one device's losses, alone and with dp / sharding / mp / pp, and compile to the
collectives they are made of, over the right axis."""

import contextlib
import dataclasses
import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hlo import collectives
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny_gpt import EIGHT_HEADS as CONFIG
from tiny_gpt import make_gpt

import fleetjax
from fleetjax import targets
from fleetjax.layers import (
    ColumnSequenceParallelLinear,
    attention,
    sequence_parallel_options,
    to_load_balanced,
    to_natural,
)
from fleetjax.plan import read_plan
from fleetjax.transforms.pipeline import PipelineLayer

STEPS, ROWS = 2, 8
SEQUENCE_PARALLEL = dataclasses.replace(CONFIG, sequence_parallel=True)


@pytest.fixture(scope="module")
def batches():
    keys = jax.random.split(jax.random.key(1), STEPS)
    length = CONFIG.max_position_embeddings + 1
    return [{"tokens": jax.random.randint(k, (ROWS, length), 0, 64)} for k in keys]


def losses(config, batches, hybrid, mesh=None, micro_batch_size=None, **strategy):
    """The loss curve; pipelined (2 micro-batches of `micro_batch_size` rows) if it is set."""
    model, params = make_gpt(config, seed=0)
    specs, loss_fn = model.partition_specs(), model.loss_fn
    if micro_batch_size:
        loss_fn = PipelineLayer(model.embed, model.stage, model.head_loss)
        params, specs = model.pipeline_params(params), model.pipeline_params(specs)
        configs = {"accumulate_steps": 2, "micro_batch_size": micro_batch_size}
        strategy.update(pipeline=True, pipeline_configs=configs)
    s = fleetjax.DistributedStrategy(hybrid_configs=hybrid, **strategy)
    step = fleetjax.make_train_step(loss_fn, optax.adam(1e-2), s, mesh, param_specs=specs)
    state, out = step.init(params), []
    for batch in batches:
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return np.array(out)


@pytest.fixture(scope="module")
def reference(batches):
    one = fleetjax.build_mesh(dp=1, devices=jax.devices()[:1])
    return losses(CONFIG, batches, {}, one)


def _degrees(**degrees):
    return {f"{axis}_degree": degree for axis, degree in degrees.items()}


# (GPT config, hybrid_configs, pipeline micro-batch rows or None): each axis alone, then with
# dp, sharding, mp and pp.
LAYOUTS = {
    "sep": (CONFIG, _degrees(sep=2), None),
    "cp": (CONFIG, _degrees(sharding=2, cp=2), None),
    "cp4": (CONFIG, _degrees(sharding=4, cp=4), None),
    "sp": (SEQUENCE_PARALLEL, _degrees(mp=2), None),
    "sep-cp-mp": (CONFIG, _degrees(sharding=2, cp=2, sep=2, mp=2), None),
    "dp-sep-mp": (CONFIG, _degrees(dp=2, sep=2, mp=2), None),
    "sharding-cp-sp": (SEQUENCE_PARALLEL, _degrees(dp=1, sharding=4, cp=2, mp=2), None),
    "pp-cp-sp": (SEQUENCE_PARALLEL, _degrees(pp=2, sharding=2, cp=2, mp=2), 4),
    "pp-sep-mp": (CONFIG, _degrees(pp=2, sep=2, mp=2), 4),
    "dp-pp-sp": (SEQUENCE_PARALLEL, _degrees(dp=2, pp=2, mp=2), 2),
}  # fmt: skip
QUICK = {"sep", "cp", "sp", "pp-cp-sp"}  # sep x cp x mp: the attention test below


@pytest.mark.parametrize(
    "name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS]
)
def test_trains_to_one_devices_losses(batches, reference, name):
    config, hybrid, micro_batch_size = LAYOUTS[name]
    got = losses(config, batches, hybrid, micro_batch_size=micro_batch_size)
    np.testing.assert_allclose(got, reference, rtol=2e-5)


def _qkv(length=32, heads=4):
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, (2, length, heads, 8)) for k in keys]


# (mesh, length, whether the sequence is in the ring's order): cp=2 over 2048 tokens, a
# device's 1024 queries go in tiles of QUERY_TILE (512). Each mesh runs one order by default,
# the other under -m slow (the suite's time), and the ring of 8 only there.
ATTENTION_CASES = [
    ({"cp": 4}, 32, False),
    ({"sep": 2, "cp": 2, "mp": 2}, 32, True),
    ({"cp": 2}, 2048, True),
] + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in [
        ({"cp": 4}, 32, True),
        ({"cp": 8}, 32, True),
        ({"cp": 8}, 32, False),
        ({"sep": 2, "cp": 2, "mp": 2}, 32, False),
        ({"cp": 2}, 2048, False),
    ]
]


@pytest.mark.parametrize(("mesh", "length", "ordered"), ATTENTION_CASES)
def test_attention_and_its_gradients_equal_unsplit(mesh, length, ordered):
    q, k, v = _qkv(length)

    def split(q, k, v):
        if ordered:  # the model keeps its sequence in the ring's order
            q, k, v = (to_load_balanced(x) for x in (q, k, v))
        out = attention(q, k, v, load_balanced=ordered)
        return to_natural(out) if ordered else out

    def plain(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True)

    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    want = plain(q, k, v), jax.grad(loss(plain), (0, 1, 2))(q, k, v)
    with jax.set_mesh(fleetjax.build_mesh(**mesh)):
        got = jax.jit(split)(q, k, v), jax.jit(jax.grad(loss(split), (0, 1, 2)))(q, k, v)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), got, want)


def _axes(c, mesh):
    """The mesh axes along which the devices of `c`'s first group (or pair) differ."""
    group = c.pairs[0] if c.pairs else c.groups[0]
    coordinates = np.array(np.unravel_index(list(group), mesh.devices.shape))
    varies = (coordinates != coordinates[:, :1]).any(axis=1)
    return tuple(a for a, v in zip(mesh.axis_names, varies, strict=True) if v)


needs_plugin = pytest.mark.skipif(
    not targets.plugin_installed(),
    reason="jax's CUDA plugin is not installed: pip install -e '.[aot]'",
)
# Big enough for XLA:GPU's matmul tiling.
H100_GPT = dataclasses.replace(
    CONFIG, hidden_size=256, intermediate_size=1024, max_position_embeddings=128, vocab_size=512
)


@needs_plugin
def test_ulysses_is_all_to_all_over_sep_and_the_ring_permutes_over_cp():
    """On compile-only H100s (on CPU the ring rotates by all-to-all: see `_ring._rotate`)."""
    mesh = targets.mesh("h100", 8, sep=2, cp=2, mp=2)
    seq = NamedSharding(mesh, P(None, ("cp", "sep"), "mp"))
    qkv = [jax.ShapeDtypeStruct((2, 512, 8, 64), jnp.bfloat16, sharding=seq)] * 3
    fn = lambda q, k, v: attention(q, k, v, load_balanced=True)  # noqa: E731
    for f in (fn, jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))):
        with jax.set_mesh(mesh):
            hlo = jax.jit(f).lower(*qkv).compile().as_text()
        ops = [(c.op, _axes(c, mesh)) for c in collectives(hlo)]
        # Ulysses: q, k, v and the output (or their gradients) each an all-to-all over sep;
        # the ring: keys and values (and their gradients) sent on over cp.
        assert sorted(set(ops)) == [("all-to-all", ("sep",)), ("collective-permute", ("cp",))]
        assert ops.count(("all-to-all", ("sep",))) >= 4


def _block_collectives(config, mesh, rows):
    """Sorted (op, result shape) of one block's forward and of its gradient, compiled."""
    model, params = make_gpt(config, seed=0)
    specs = jax.tree.map(lambda s: P(*s[1:]), model.partition_specs(mesh=mesh)["blocks"])
    place = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))  # noqa: E731
    layer = jax.tree.map(lambda a, s: place(a[0], s), params["blocks"], specs)
    split = "mp" if config.sequence_parallel else None  # the residual stream as it arrives
    h = place(jnp.zeros((rows, config.max_position_embeddings, config.hidden_size)), P("dp", split))
    grad = jax.grad(lambda layer, h: model.stage(layer, h).sum(), (0, 1))
    found = []
    with jax.set_mesh(mesh):
        for fn in (model.stage, grad):
            hlo = jax.jit(fn).lower(layer, h).compile().as_text()
            found.append(sorted((c.op, c.shape.split("{")[0]) for c in collectives(hlo)))
    return found


@needs_plugin
def test_sequence_parallel_turns_each_all_reduce_into_reduce_scatter_and_all_gather():
    """On compile-only H100s (XLA:CPU has no reduce-scatter rewrite: it all-reduces and
    slices), one block forward and backward."""
    mesh = targets.mesh("h100", 8, dp=4, mp=2)
    length, width = H100_GPT.max_position_embeddings, H100_GPT.hidden_size
    rows, half = f"f32[2,{length},{width}]", f"f32[2,{length // 2},{width}]"
    forward, backward = _block_collectives(H100_GPT, mesh, 8)
    assert forward == [("all-reduce", rows)] * 2  # Megatron: one per row-parallel layer
    megatron = [op for op in backward if op[1] == rows]
    sp = dataclasses.replace(H100_GPT, sequence_parallel=True)
    forward, backward = _block_collectives(sp, mesh, 8)
    # Each all-reduce becomes a reduce-scatter along the sequence, and each column layer's
    # input is all-gathered first: the same bytes, 2 (t - 1) / t of the rows, in two halves.
    assert forward == [("all-gather", rows)] * 2 + [("reduce-scatter", half)] * 2
    activations = [op for op in backward if op[1] in (rows, half)]
    assert {op for op, _ in activations} == {"all-gather", "reduce-scatter"}
    assert activations.count(("all-gather", rows)) == len(megatron)
    assert activations.count(("reduce-scatter", half)) == len(megatron)


def _saved(column, x):
    """What the backward pass of `column` keeps: a line per residual, "f32[8,8,16] from ..."."""
    graph, state = nnx.split(column)
    loss = lambda state, x: jnp.sum(nnx.merge(graph, state)(x) ** 2)  # noqa: E731
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        jax.ad_checkpoint.print_saved_residuals(loss, state, x)
    return printed.getvalue().splitlines()


def test_recompute_allgather_keeps_the_split_input():
    mesh = fleetjax.build_mesh(dp=4, mp=2)
    x = jnp.ones((8, 8, 16))  # [batch, sequence, hidden], the sequence split over mp
    make = lambda **kw: ColumnSequenceParallelLinear(  # noqa: E731
        16, 32, gather_output=False, sequence_axis=1, rngs=nnx.Rngs(0), **kw
    )
    with jax.set_mesh(mesh):
        kept = _saved(make(), x)
        again = _saved(make(recompute_allgather=True), x)
        with sequence_parallel_options(recompute_allgather=True):  # mp_configs' setting
            from_strategy = _saved(make(), x)
    assert any("sharding_constraint" in line for line in kept)  # the gathered input
    for saved in (again, from_strategy):
        assert not any("sharding_constraint" in line for line in saved)
        assert "f32[8,8,16] from the argument x" in saved  # as it arrives: split over mp
    assert read_plan(fleetjax.DistributedStrategy(
        hybrid_configs={"mp_configs": {"recompute_allgather": True}}
    )).recompute_allgather  # fmt: skip


@pytest.mark.parametrize(
    ("mesh", "shape", "message"),
    [
        ({"sep": 4}, (2, 10, 8, 8), "sequence of 10 tokens .*its length must be a multiple of 4"),
        ({"sep": 2, "cp": 2}, (2, 12, 8, 8), "multiple of 8 \\(sep_degree x cp_degree, and x 2"),
        ({"sep": 4}, (2, 16, 6, 8), "6 attention heads do not split over mp x sep = 4"),
        ({"sep": 2, "mp": 2}, (2, 16, 6, 8), "6 attention heads do not split over mp x sep = 4"),
    ],
)  # fmt: skip
def test_shapes_the_sequence_axes_cannot_split_are_errors(mesh, shape, message):
    q = jnp.ones(shape)
    with jax.set_mesh(fleetjax.build_mesh(**mesh)), pytest.raises(ValueError, match=message):
        attention(q, q, q)


@needs_plugin
def test_the_ring_compiles_for_h100s_in_the_gradient_of_a_loop_over_layers():
    """A looped ring's collective-permute, in the gradient of a loop over layers, is a cycle
    to XLA:GPU's scheduler ("A cycle is detected"): the ring's steps are unrolled."""
    mesh = targets.mesh("h100", 8, cp=8)
    x = jax.ShapeDtypeStruct(
        (2, 512, 8, 64), jnp.float32, sharding=NamedSharding(mesh, P(None, "cp"))
    )
    ws = jax.ShapeDtypeStruct((2, 64, 64), jnp.float32, sharding=NamedSharding(mesh, P()))

    def loss(ws, x):
        layer = lambda h, w: (attention(h @ w, h, h, load_balanced=True), None)  # noqa: E731
        return jax.lax.scan(layer, x, ws)[0].sum()

    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss)).lower(ws, x).compile().as_text()
    assert {c.op for c in collectives(hlo)} >= {"collective-permute"}


@needs_plugin
@pytest.mark.slow  # four GPT steps at 32k tokens compiled for H100s: about 80 s
def test_long_sequence_example_fits_with_cp_where_the_batch_split_does_not():
    """examples/long_sequence.py: 8 sequences of 32k tokens on 8 compile-only H100s."""
    import long_sequence  # examples/ is on the path (tiny_gpt)

    gpu = {
        name: long_sequence.explain(hybrid, show=False).gpu
        for name, hybrid in long_sequence.LAYOUTS.items()
    }
    over = {name for name, g in gpu.items() if g.peak_bytes > g.hbm_bytes}
    assert over == {"batch over sharding", "sequence over sep"}
    assert gpu["sequence over cp"].peak_bytes < 0.9 * gpu["batch over sharding"].peak_bytes
