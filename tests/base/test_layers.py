"""Tensor-parallel layers: each equals the unsplit computation on Auto and Explicit meshes, with
exactly Megatron's communication; logical axis rules give the parameters' PartitionSpecs."""

import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hlo import collectives
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from fleetjax.layers import (
    DEFAULT_RULES,
    ColumnParallelLinear,
    ParallelCrossEntropy,
    RowParallelLinear,
    VocabParallelEmbedding,
    constrain,
    logical_to_spec,
    parallel_cross_entropy,
    partition_specs,
)
from fleetjax.mesh import build_mesh

ROWS, LENGTH, WIDTH, OUT, VOCAB = 8, 3, 16, 8, 32
BATCH = P(("dp", "sharding"))
SPLIT = P(("dp", "sharding"), None, "mp")  # activations split over mp on the features


def features(seed=1):
    return jax.random.normal(jax.random.key(seed), (ROWS, LENGTH, WIDTH))


def token_ids():
    # Includes ids outside [0, VOCAB): Paddle's mp lookup gives them zero rows.
    return (jnp.arange(ROWS * LENGTH).reshape(ROWS, LENGTH) * 3 % (VOCAB + 8)) - 4


def labels():
    return (jnp.arange(ROWS * LENGTH).reshape(ROWS, LENGTH) * 5 % WIDTH).at[0, :2].set(-100)


def rows(dp):
    """One device's output rows: [rows / dp, length, OUT]."""
    return f"f32[{ROWS // dp},{LENGTH},{OUT}]"


def per_token(dp):
    return f"f32[{ROWS // dp},{LENGTH}]"


# name: (make the layer, inputs, their PartitionSpecs, the (op, result shape) collectives
# expected for mp > 1 given dp, the output's sharding over mp on its last dimension)
CASES = {
    "column_gathered": (
        lambda: ColumnParallelLinear(WIDTH, OUT, has_bias=True, rngs=nnx.Rngs(0)),
        lambda: (features(),),
        (BATCH,),
        lambda dp: [("all-gather", rows(dp))],
        None,
    ),
    "column_split": (
        lambda: ColumnParallelLinear(
            WIDTH, OUT, has_bias=True, gather_output=False, rngs=nnx.Rngs(0)
        ),
        lambda: (features(),),
        (BATCH,),
        lambda dp: [],
        "mp",
    ),
    "row": (
        lambda: RowParallelLinear(WIDTH, OUT, rngs=nnx.Rngs(0)),
        lambda: (features(),),
        (BATCH,),
        lambda dp: [("all-reduce", rows(dp))],
        None,
    ),
    "row_input_is_parallel": (
        lambda: RowParallelLinear(WIDTH, OUT, input_is_parallel=True, rngs=nnx.Rngs(0)),
        lambda: (features(),),
        (SPLIT,),
        lambda dp: [("all-reduce", rows(dp))],
        None,
    ),
    "embedding": (
        lambda: VocabParallelEmbedding(VOCAB, OUT, rngs=nnx.Rngs(0)),
        lambda: (token_ids(),),
        (BATCH,),
        lambda dp: [("all-reduce", rows(dp))],  # the looked-up rows, not the table
        None,
    ),
    "cross_entropy": (
        lambda: ParallelCrossEntropy(),
        lambda: (features(), labels()),
        (SPLIT, BATCH),
        # One number per token: the max, then the sum of exponentials and the label's logit.
        lambda dp: [
            ("all-reduce", per_token(dp)),
            ("all-reduce", f"({per_token(dp)}, {per_token(dp)})"),
        ],
        None,
    ),
}


def without_layouts(shape):
    return re.sub(r"\{[\d,]*\}", "", shape)


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=lambda k: k.name)
@pytest.mark.parametrize("mp", [1, 2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_equals_the_unsplit_computation(case, mp, kind):
    make, inputs, in_specs, expected, out_split = CASES[case]
    layer, inputs = make(), inputs()
    graphdef, state = nnx.split(layer)

    def apply(state, *xs):
        return nnx.merge(graphdef, state)(*xs)

    device = jax.devices()[0]
    expected_out = jax.jit(apply)(*jax.device_put((state, *inputs), device))

    mesh = build_mesh(mp=mp, axis_types=kind)
    dp = 8 // mp
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    state_sharding = jax.tree.map(shard, partition_specs(state, mesh=mesh))
    in_shardings = (state_sharding, *map(shard, in_specs))
    placed = jax.device_put((state, *inputs), in_shardings)
    with jax.set_mesh(mesh):
        run = jax.jit(apply, in_shardings=in_shardings)
        out = run(*placed)
        hlo = run.lower(*placed).compile().as_text()

    np.testing.assert_allclose(out, expected_out, rtol=1e-6, atol=1e-6)
    if mp > 1:
        spec = (*out.sharding.spec, *(None,) * out.ndim)[: out.ndim]
        assert spec[-1] == out_split
    found = [(c.op, without_layouts(c.shape)) for c in collectives(hlo)]
    assert found == (expected(dp) if mp > 1 else [])


def test_embedding_gives_zero_rows_for_ids_outside_the_vocabulary():
    layer = VocabParallelEmbedding(VOCAB, OUT, rngs=nnx.Rngs(0))
    ids = jnp.array([[-1, 0, VOCAB - 1, VOCAB]])
    rows = layer(ids)
    np.testing.assert_array_equal(rows[0, [0, 3]], 0.0)
    np.testing.assert_array_equal(rows[0, 1:3], layer.weight[...][jnp.array([0, VOCAB - 1])])


def test_parameters_carry_logical_names_and_paddle_defaults():
    column = ColumnParallelLinear(WIDTH, OUT, rngs=nnx.Rngs(0))
    assert column.weight.get_metadata()["out_sharding"] == ("embed", "mlp")
    assert column.bias is None  # Paddle's has_bias=None: no bias
    assert column.gather_output
    row = RowParallelLinear(WIDTH, OUT, rngs=nnx.Rngs(0))
    assert row.weight.get_metadata()["out_sharding"] == ("mlp", "embed")
    assert row.bias.get_metadata()["out_sharding"] == ("embed",)
    np.testing.assert_array_equal(row.bias[...], 0.0)
    assert not row.input_is_parallel
    embedding = VocabParallelEmbedding(VOCAB, OUT, rngs=nnx.Rngs(0))
    assert embedding.weight.get_metadata()["out_sharding"] == ("vocab", "embed")
    # Paddle's default weight initializer is Xavier uniform: |w| <= sqrt(6 / (fan_in + fan_out)).
    bound = np.sqrt(6 / (WIDTH + OUT))
    assert 0.5 * bound < np.abs(column.weight[...]).max() <= bound


# -- ParallelCrossEntropy ----------------------------------------------------------------------


def plain_cross_entropy(logits, label, ignore_index=-100):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(label, 0))
    return jnp.where(label == ignore_index, 0.0, loss)[..., None]


@pytest.mark.parametrize("label_shape", ["[...]", "[..., 1]"])
def test_cross_entropy_equals_plain_softmax_cross_entropy(label_shape):
    logits, label = features() * 3, jnp.abs(labels()).at[1, 1].set(7) % WIDTH
    given = label if label_shape == "[...]" else label[..., None]
    loss_fn = ParallelCrossEntropy(ignore_index=7)
    loss = loss_fn(logits, given)
    expected = plain_cross_entropy(logits, label, ignore_index=7)
    assert loss.shape == (ROWS, LENGTH, 1)
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_array_equal(loss[..., 0] == 0.0, label == 7)

    grad = jax.grad(lambda x: loss_fn(x, given).sum())(logits)
    expected_grad = jax.grad(lambda x: plain_cross_entropy(x, label, 7).sum())(logits)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(grad[1, 1], 0.0)


def test_cross_entropy_default_ignore_index_and_dtype():
    logits, label = features().astype(jnp.bfloat16), labels()
    loss = parallel_cross_entropy(logits, label)
    assert loss.dtype == jnp.bfloat16
    np.testing.assert_array_equal(loss[0, :2, 0], 0.0)  # labels -100
    expected = plain_cross_entropy(logits.astype(jnp.float32), label)
    np.testing.assert_allclose(loss.astype(jnp.float32), expected, rtol=1e-2)


def test_cross_entropy_bad_labels():
    logits = features()
    with pytest.raises(ValueError) as error:
        parallel_cross_entropy(logits, jnp.zeros((ROWS,), jnp.int32))
    assert str(error.value) == (
        "Expected input_dims - 1 = label_dims or input_dims == label_dims "
        "(got input_dims3, label_dims1)"
    )
    with pytest.raises(ValueError, match=r"label of shape \(8, 3, 2\) does not fit logits"):
        parallel_cross_entropy(logits, jnp.zeros((ROWS, LENGTH, 2), jnp.int32))
    with pytest.raises(TypeError, match="label must be integers, got float32"):
        parallel_cross_entropy(logits, jnp.zeros((ROWS, LENGTH)))
    with pytest.raises(TypeError, match="ignore_index must be an int, got 1.5"):
        ParallelCrossEntropy(ignore_index=1.5)


def test_bad_layer_arguments():
    with pytest.raises(ValueError, match="ColumnParallelLinear: out_features must be a positive"):
        ColumnParallelLinear(4, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="RowParallelLinear: in_features must be a positive int"):
        RowParallelLinear(2.0, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="VocabParallelEmbedding: num_embeddings must be a"):
        VocabParallelEmbedding(True, 4, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="ids must be integers, got float32"):
        VocabParallelEmbedding(4, 4, rngs=nnx.Rngs(0))(jnp.zeros(3))


# -- partition specs ---------------------------------------------------------------------------


class TwoLayers(nnx.Module):
    def __init__(self, rngs):
        self.up = ColumnParallelLinear(WIDTH, 32, has_bias=True, gather_output=False, rngs=rngs)
        self.down = RowParallelLinear(32, WIDTH, input_is_parallel=True, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)  # no names: replicated


def test_partition_specs_of_an_nnx_state():
    model = TwoLayers(nnx.Rngs(0))
    specs = partition_specs(nnx.state(model))
    assert isinstance(specs, nnx.State)
    assert nnx.to_pure_dict(specs) == {
        "up": {"weight": P(None, "mp"), "bias": P("mp")},
        "down": {"weight": P("mp", None), "bias": P(None)},
        "norm": {"scale": P(), "bias": P()},
    }
    assert nnx.to_pure_dict(partition_specs(model)) == nnx.to_pure_dict(specs)  # a Module works too
    # The result is in_shardings for the state as it is.
    mesh = build_mesh(mp=4)
    state = nnx.state(model)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    placed = jax.jit(lambda s: s, out_shardings=shardings)(state)
    assert placed["up"]["weight"][...].sharding.spec == P(None, "mp")


def test_placed_parameters_are_really_split():
    mp = 4
    mesh = build_mesh(mp=mp)
    model = TwoLayers(nnx.Rngs(0))
    state = nnx.to_pure_dict(nnx.state(model))
    specs = nnx.to_pure_dict(partition_specs(model))
    placed = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    shard_shape = lambda x: x.addressable_shards[0].data.shape  # noqa: E731
    assert shard_shape(placed["up"]["weight"]) == (WIDTH, 32 // mp)
    assert shard_shape(placed["up"]["bias"]) == (32 // mp,)
    assert shard_shape(placed["down"]["weight"]) == (32 // mp, WIDTH)
    assert shard_shape(placed["down"]["bias"]) == (WIDTH,)


def test_partition_specs_of_a_plain_pytree_with_names():
    params = {"w": np.zeros((4, 8)), "b": jax.ShapeDtypeStruct((8,), jnp.float32), "s": 1.0}
    names = {"w": ("embed", "vocab"), "b": ("vocab",), "s": None}
    specs = partition_specs(params, names)
    assert specs == {"w": P(None, "mp"), "b": P("mp"), "s": P()}


def test_partition_specs_of_linen_logically_partitioned_variables():
    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            return nn.Dense(32, kernel_init=init, use_bias=False)(x)

    variables = jax.eval_shape(Mlp().init, jax.random.key(0), jnp.zeros((2, WIDTH)))
    specs = partition_specs(variables)
    assert specs == {"params": {"Dense_0": {"kernel": P(None, "mp")}}}
    assert jax.tree.structure(specs) == jax.tree.structure(nn.unbox(variables))


def test_rules_override_by_priority():
    # A rule given first wins; "mlp" then finds mp taken and falls back to unsplit.
    assert logical_to_spec(("mlp", "embed"), rules=[("embed", "mp")]) == P(None, "mp")
    assert logical_to_spec(("mlp", "embed")) == P("mp", None)
    assert logical_to_spec(("vocab", "embed"), rules=[("vocab", None)]) == P(None, None)
    # flax's rules context is read when no rules are passed.
    with nnx.logical_axis_rules([("embed", "sharding")]):
        assert partition_specs({"w": np.zeros((4, 8))}, {"w": ("embed", "mlp")}) == {
            "w": P("sharding", "mp")
        }
    # The batch goes over both data axes; on a mesh without sharding, over dp alone.
    assert logical_to_spec(("activation_batch", "activation_embed")) == P(("dp", "sharding"), None)
    only_dp = jax.make_mesh((8,), ("dp",), axis_types=(AxisType.Auto,))
    assert logical_to_spec(("activation_batch",), mesh=only_dp) == P("dp")
    assert logical_to_spec(("mlp",), mesh=only_dp) == P(None)
    assert dict(DEFAULT_RULES)["activation_batch"] == ("dp", "sharding")


def test_partition_spec_errors_name_the_parameter():
    with pytest.raises(ValueError, match=r"no axis rule for the logical name\(s\) \['hidden'\]"):
        partition_specs({"w": np.zeros((4, 8))}, {"w": ("hidden", "mlp")})
    with pytest.raises(ValueError) as error:
        partition_specs({"w": np.zeros((4, 8))}, {"w": ("mlp",)})
    assert str(error.value) == "params['w'] has shape (4, 8) but 1 logical axis names ('mlp',)"
    with pytest.raises(ValueError) as error:
        partition_specs({"w": np.zeros((4, 6))}, {"w": ("embed", "mlp")}, mesh=build_mesh(mp=4))
    assert str(error.value) == (
        "params['w'] has shape (4, 6): dimension 1 ('mlp', size 6) does not split evenly over mp=4"
    )
    with pytest.raises(ValueError, match="rules must be .logical name, mesh axes. pairs"):
        logical_to_spec(("mlp",), rules=[("mlp", 4)])


def test_constrain_without_a_mesh_is_the_identity():
    x = features()
    assert constrain(x, ("mlp",)) is x
    chex.assert_trees_all_equal(jax.jit(lambda x: constrain(x, ("mlp",)))(x), x)


def test_constrain_refuses_mixed_axis_types():
    mesh = jax.make_mesh((4, 2), ("dp", "mp"), axis_types=(AxisType.Explicit, AxisType.Auto))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="all Auto or all Explicit, got"):
        jax.jit(lambda x: constrain(x, ("mlp",))).lower(features())
