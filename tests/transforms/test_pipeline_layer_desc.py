"""`PipelineLayer` in Paddle's `LayerDesc` list form: flax nnx layers, the run of identical
ones stacked on the layer axis, trained as the same model without the pipeline."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fleetjax
from fleetjax import LayerDesc, PipelineLayer, SharedLayerDesc
from fleetjax.layers import ColumnParallelLinear
from fleetjax.transforms.pipeline import to_model_order

WIDTH, LAYERS = 16, 8


class EmbeddingPipe(nnx.Module):
    def __init__(self, features, width, *, rngs):
        self.linear = nnx.Linear(features, width, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


class Block(nnx.Module):
    def __init__(self, width, *, norm=False, rngs):
        self.linear = nnx.Linear(width, width, rngs=rngs)
        self.norm = nnx.BatchNorm(width, rngs=rngs) if norm else None

    def __call__(self, x):
        h = self.linear(x)
        return x + jnp.tanh(self.norm(h) if self.norm is not None else h)


class HeadPipe(nnx.Module):
    def __init__(self, width, classes, *, rngs):
        self.linear = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def mse(output, labels):
    return jnp.mean((output - labels) ** 2)


def descs(norm=False, seed=0):
    """Paddle's form: the embedding, n identical blocks, the head."""
    rngs = nnx.Rngs(seed)
    return [
        LayerDesc(EmbeddingPipe, 5, WIDTH, rngs=rngs),
        *[LayerDesc(Block, WIDTH, norm=norm, rngs=rngs)] * LAYERS,
        LayerDesc(HeadPipe, WIDTH, 3, rngs=rngs),
    ]


def batch(rows=16, seed=1):
    rng = np.random.RandomState(seed)
    return rng.randn(rows, 5).astype(np.float32), rng.randn(rows, 3).astype(np.float32)


def pipelined(schedule="1F1B", pp=2, accumulate_steps=2):
    s = fleetjax.DistributedStrategy(pipeline=True)
    s.hybrid_configs = {"pp_degree": pp}
    s.pipeline_configs = {
        "schedule_mode": schedule,
        "micro_batch_size": 2,
        "accumulate_steps": accumulate_steps,
    }
    return s


def test_builds_the_parts_and_stacks_the_repeated_layers():
    model = PipelineLayer(descs(), num_stages=2, loss_fn=mse)
    assert jax.tree.map(jnp.shape, nnx.to_pure_dict(model.params.layers)) == {
        "linear": {"bias": (LAYERS, WIDTH), "kernel": (LAYERS, WIDTH, WIDTH)}
    }
    assert model.model_state is None and model.num_stages == 2
    # Each block drew its own weights from the shared nnx.Rngs, in the list's order.
    kernels = np.asarray(model.params.layers["linear"]["kernel"][...])
    assert not np.allclose(kernels[0], kernels[1])
    # The same model run as the loss: Paddle's forward over the list, then loss_fn.
    x, y = batch()
    built = [desc.build_layer() for desc in descs()]
    for layer in built[:-1]:
        x = layer(x)
    assert float(model(model.params, batch())) == pytest.approx(float(mse(built[-1](x), y)))


def test_pipelined_equals_the_unpipelined_model():
    model = PipelineLayer(descs(), num_stages=2, loss_fn=mse)
    found = []
    for strategy in (pipelined(), fleetjax.DistributedStrategy()):
        step = fleetjax.make_train_step(model, optax.adam(1e-2), strategy)
        state = step.init(model.params)
        for seed in (1, 2):
            state, metrics = step(state, batch(seed=seed))
        found.append((float(metrics["loss"]), jax.device_get(state.params)))
    (loss, params), (expected_loss, expected) = found
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    chex.assert_trees_all_close(params, expected, rtol=1e-5, atol=1e-5)


def test_batch_norm_in_the_stages_under_vpp():
    """Layers with statistics: the model state, per layer with its stage; averaged over the
    micro-batches as the unpipelined step's in-step gradient merge does (its rows permuted so
    that its micro-batches are the pipeline's)."""
    model = PipelineLayer(
        descs(norm=True),
        num_stages=2,
        loss_fn=mse,
        seg_method="layer:Block",
        num_virtual_pipeline_stages=2,
    )
    assert jax.tree.map(jnp.shape, nnx.to_pure_dict(model.model_state.layers)) == {
        "norm": {"mean": (LAYERS, WIDTH), "var": (LAYERS, WIDTH)}
    }
    strategy = pipelined("VPP")
    step = fleetjax.make_train_step(model, optax.sgd(0.1), strategy, has_state=True)
    state, _ = step(step.init(model.params, model_state=model.model_state), batch())
    assert state.model_state.layers["norm"]["mean"].sharding.spec == P("pp")
    micro_batches = 8  # 4 replicas x 2
    permuted = jax.tree.map(
        lambda x: x.reshape(micro_batches, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape),
        batch(),
    )
    merge = fleetjax.Strategy({"gradient_merge": {"enable": True, "k_steps": micro_batches}})
    one_device = fleetjax.build_mesh(dp=1, devices=jax.devices()[:1])
    plain = fleetjax.make_train_step(model, optax.sgd(0.1), merge, one_device, has_state=True)
    expected, _ = plain(plain.init(model.params, model_state=model.model_state), permuted)

    def model_order(tree):
        tree = jax.device_get(tree)
        return tree._replace(layers=to_model_order(tree.layers, 2, 2))

    chex.assert_trees_all_close(
        (model_order(state.params), model_order(state.model_state)),
        jax.device_get((expected.params, expected.model_state)),
        rtol=1e-5,
        atol=1e-5,
    )


def test_logical_names_place_the_stacked_layers():
    class ParallelBlock(nnx.Module):
        def __init__(self, width, *, rngs):
            self.linear = ColumnParallelLinear(width, width, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.linear(x))

    rngs = nnx.Rngs(0)
    layers = [
        LayerDesc(EmbeddingPipe, 5, WIDTH, rngs=rngs),
        *[LayerDesc(ParallelBlock, WIDTH, rngs=rngs)] * 4,
        LayerDesc(HeadPipe, WIDTH, 3, rngs=rngs),
    ]
    model = PipelineLayer(layers, 2, loss_fn=mse)  # Paddle's positional order
    s = pipelined()
    s.hybrid_configs = {"pp_degree": 2, "mp_degree": 2}
    s.tensor_parallel = True
    step = fleetjax.make_train_step(model, optax.sgd(0.1), s)
    state = step.init(model.params)
    assert state.params.layers["linear"]["weight"].sharding.spec == P("pp", None, "mp")
    _, metrics = step(state, batch(rows=8))
    assert np.isfinite(float(metrics["loss"]))


class TestWhatDoesNotMap:
    def test_no_repeated_layer(self):
        rngs = nnx.Rngs(0)
        layers = [
            LayerDesc(EmbeddingPipe, 5, WIDTH, rngs=rngs),
            LayerDesc(HeadPipe, WIDTH, 3, rngs=rngs),
        ]
        with pytest.raises(
            ValueError, match="needs the layers the stages share as a run of identical"
        ):
            PipelineLayer(layers, num_stages=2, loss_fn=mse)

    def test_non_uniform_middle_layers(self):
        rngs = nnx.Rngs(0)
        widths = [LayerDesc(Block, WIDTH, rngs=rngs), LayerDesc(Block, 2 * WIDTH, rngs=rngs)]
        with pytest.raises(ValueError, match="Found no repeated LayerDesc"):
            PipelineLayer(widths * 2, num_stages=2, loss_fn=mse)

    def test_layers_that_build_differently(self):
        class Growing(nnx.Module):
            built = 0

            def __init__(self, *, rngs):
                Growing.built += 1
                self.linear = nnx.Linear(WIDTH, WIDTH + Growing.built, rngs=rngs)

        with pytest.raises(ValueError, match="are not all alike"):
            PipelineLayer([LayerDesc(Growing, rngs=nnx.Rngs(0))] * 2, num_stages=2, loss_fn=mse)

    def test_layers_that_keep_random_streams(self):
        class Dropped(nnx.Module):
            def __init__(self, *, rngs):
                self.dropout = nnx.Dropout(0.1, rngs=rngs)

        with pytest.raises(ValueError, match=r"keeps nnx.Rngs streams.*has_rng=True"):
            PipelineLayer([LayerDesc(Dropped, rngs=nnx.Rngs(0))] * 2, num_stages=2, loss_fn=mse)

    def test_shared_weights_across_parts(self):
        rngs = nnx.Rngs(0)
        shared = SharedLayerDesc("embed", EmbeddingPipe, None, "weight", 5, 5, rngs=rngs)
        layers = [shared, *[LayerDesc(Block, 5, rngs=rngs)] * 2, shared]
        with pytest.raises(ValueError, match="key 'embed' appears 2 times"):
            PipelineLayer(layers, num_stages=2, loss_fn=mse)

    @pytest.mark.parametrize(
        ("arguments", "message"),
        [
            ({}, "should provide num_stages or topology"),
            ({"num_stages": 2, "topology": object()}, "pass num_stages instead"),
            ({"num_stages": 2, "seg_method": [0, 3, 10]}, "splits the repeated layers evenly"),
            ({"num_stages": 2, "seg_method": "layer:Embedding"}, r"matches layers \[0\]"),
            (
                {"num_stages": 2, "num_virtual_pipeline_stages": 2},
                "seg_method should be start with layer: for interleave scheduler",
            ),
            ({"num_stages": 2, "recompute_interval": 1}, "recompute_ctx must be not None"),
        ],
    )
    def test_paddle_arguments(self, arguments, message):
        with pytest.raises(ValueError, match=message):
            PipelineLayer(layers=descs(), loss_fn=mse, **arguments)

    def test_layer_func_must_be_an_nnx_module(self):
        with pytest.raises(TypeError, match="should be a derived class of flax nnx.Module"):
            LayerDesc(jnp.tanh)

    def test_stages_must_be_the_meshs(self):
        model = PipelineLayer(descs(), num_stages=4, loss_fn=mse)
        step = fleetjax.make_train_step(model, optax.sgd(0.1), pipelined(pp=2))
        with pytest.raises(ValueError, match="cut for num_stages=4, but the mesh's pp axis"):
            step.init(model.params)

    def test_model_state_needs_has_state(self):
        model = PipelineLayer(descs(norm=True), num_stages=2, loss_fn=mse)
        with pytest.raises(TypeError, match="keep model state and take no PRNG key"):
            model(model.params, batch())
        step = fleetjax.make_train_step(model, optax.sgd(0.1), pipelined())
        with pytest.raises(TypeError, match=r"make the step with has_state=True"):
            step(step.init(model.params), batch())
