"""pipeline: every schedule gives the loss and gradients of the unpipelined model."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from fleetjax.mesh import build_mesh
from fleetjax.transforms.pipeline import (
    PipelineParams,
    pipeline,
    to_model_order,
    to_pipeline_order,
)

HIDDEN = 8
MICRO_BATCH_SIZE = 2


def embed(p, batch):
    return jnp.tanh(batch["x"] @ p["w"])


def stage(p, x):
    return x + jnp.tanh(x @ p["w"] + p["b"])


def head_loss(p, x, batch):
    return jnp.mean((x @ p["w"] - batch["y"]) ** 2)


def make_params(layers, seed=0):
    rng = np.random.RandomState(seed)
    return PipelineParams(
        {"w": rng.randn(5, HIDDEN).astype(np.float32) / 2},
        {
            "w": rng.randn(layers, HIDDEN, HIDDEN).astype(np.float32) / 3,
            "b": rng.randn(layers, HIDDEN).astype(np.float32) / 5,
        },
        {"w": rng.randn(HIDDEN, 3).astype(np.float32) / 3},
    )


def make_batch(rows, seed=1):
    rng = np.random.RandomState(seed)
    return {"x": rng.randn(rows, 5).astype(np.float32), "y": rng.randn(rows, 3).astype(np.float32)}


@functools.cache
def reference_for(layers, micro_batches):
    """The reference for the test model with `layers` layers on one replica (cached: the
    schedules share it)."""
    return reference(
        make_params(layers), make_batch(micro_batches * MICRO_BATCH_SIZE), 1, micro_batches
    )


def reference(params, batch, replicas, micro_batches, model=(embed, stage, head_loss)):
    """Paddle's pipeline loss on one device: the mean over every replica's micro-batches
    (rows [i b, (i + 1) b) of the replica's rows) of the unpipelined model's loss."""
    embed_fn, stage_fn, head_fn = model

    def loss(params, batch):
        def one(micro):
            x = embed_fn(params.embed, micro)
            x = jax.lax.scan(lambda h, p: (stage_fn(p, h), None), x, params.layers)[0]
            return head_fn(params.head, x, micro)

        split = jax.tree.map(lambda a: a.reshape(replicas * micro_batches, -1, *a.shape[1:]), batch)
        return jnp.mean(jax.vmap(one)(split))

    device = jax.devices()[0]
    return jax.jit(jax.value_and_grad(loss))(*jax.device_put((params, batch), device))


# One micro-batch, as many as stages and more than twice as many; by default pp=2 with 1 and
# 2 pp + 1 and pp=4 with pp and 2 pp + 1 micro-batches, the rest under -m slow (suite time).
DEFAULT_GRID = {(2, 1), (2, 5), (4, 4), (4, 9)}
CASES = [
    (mode, pp, m) if (pp, m) in DEFAULT_GRID else pytest.param(mode, pp, m, marks=pytest.mark.slow)
    for mode in ("FThenB", "1F1B")
    for pp in (2, 4)
    for m in (1, pp, 2 * pp + 1)
]
CASES += [("VPP", 2, 5), ("VPP", 4, 4), ("VPP", 4, 9)]
CASES += [pytest.param("VPP", 2, 2, marks=pytest.mark.slow)]
# Eager1F1B and the zero-bubble schedules (backward split into B and W:
# tests/transforms/test_zero_bubble.py)
CASES += [("ZBH1", 2, 2), ("ZBH1", 4, 9), ("ZBVPP", 2, 5), ("Eager1F1B", 2, 3)]
CASES += [pytest.param(*c, marks=pytest.mark.slow) for c in [("ZBH1", 4, 4), ("ZBVPP", 4, 4)]]
CASES += [pytest.param("Eager1F1B", 4, 8, marks=pytest.mark.slow)]


@pytest.mark.parametrize(("mode", "pp", "m"), CASES)
def test_equals_unpipelined(mode, pp, m):
    vpp = 2 if mode in ("VPP", "ZBVPP") else 1
    mesh = build_mesh(dp=1, pp=pp, devices=jax.devices()[:pp])
    params = make_params(2 * pp * vpp)  # chunks of two layers
    batch = make_batch(m * MICRO_BATCH_SIZE)
    step = pipeline(
        embed,
        stage,
        head_loss,
        mesh=mesh,
        micro_batch_size=MICRO_BATCH_SIZE,
        accumulate_steps=m,
        schedule_mode=mode,
        vpp_degree=vpp,
    )
    placed = params._replace(layers=to_pipeline_order(params.layers, pp, vpp))
    loss, grads = jax.jit(step)(placed, batch)
    grads = grads._replace(layers=to_model_order(grads.layers, pp, vpp))
    expected_loss, expected_grads = reference_for(2 * pp * vpp, m)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-5)


def test_pipeline_order():
    layers = {"w": np.arange(8)}
    # Stage s owns chunks s and s + P: model layers [2s, 2s + 1] and [4 + 2s, 4 + 2s + 1].
    ordered = to_pipeline_order(layers, 2, 2)
    np.testing.assert_array_equal(ordered["w"], [0, 1, 4, 5, 2, 3, 6, 7])
    np.testing.assert_array_equal(to_model_order(ordered, 2, 2)["w"], np.arange(8))
    np.testing.assert_array_equal(to_pipeline_order(layers, 4)["w"], np.arange(8))
    with pytest.raises(ValueError, match="has 8 layers, which do not split into pp_degree"):
        to_pipeline_order(layers, 3, 1)


@pytest.mark.parametrize("rows", [14, 24])  # 24: divisible by micro_batch_size, not 12
def test_wrong_batch_size_states_the_rule_and_the_numbers(rows):
    mesh = build_mesh(dp=2, pp=4)
    step = pipeline(embed, stage, head_loss, mesh=mesh, micro_batch_size=2, accumulate_steps=3)
    with pytest.raises(ValueError) as error:
        step(make_params(4), make_batch(rows))
    assert str(error.value) == (
        "a pipeline batch has data-parallel replicas x micro_batch_size x accumulate_steps = "
        f"2 x 2 x 3 = 12 rows, got {rows}: pass 12 rows, or change pipeline_configs' "
        "micro_batch_size or accumulate_steps (each replica's rows are accumulate_steps "
        "micro-batches)"
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule_mode": "DualPipeV"}, "schedule_mode must be one of 'FThenB', 'F-then-B'"),
        ({"micro_batch_size": 0}, "micro_batch_size must be a positive int, got 0"),
        ({"accumulate_steps": 0}, r"micro_batches \(accumulate_steps\) must be a positive int"),
        (
            {"schedule_mode": "VPP", "vpp_degree": 2, "accumulate_steps": 2},
            r"The accumulate_steps\(2\) should be greater than or equal to pp_degree\(4\)",
        ),
    ],
)
def test_bad_configuration(kwargs, message):
    mesh = build_mesh(dp=2, pp=4)
    config = {"micro_batch_size": 2, "accumulate_steps": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        pipeline(embed, stage, head_loss, mesh=mesh, **config)


def test_bad_model():
    with pytest.raises(ValueError, match=r"mesh must have a 'pp' axis .* got axes \('x',\)"):
        pipeline(
            embed,
            stage,
            head_loss,
            mesh=jax.make_mesh((8,), ("x",)),
            micro_batch_size=2,
            accumulate_steps=4,
        )
    mesh = build_mesh(dp=2, pp=4)
    step = pipeline(embed, stage, head_loss, mesh=mesh, micro_batch_size=2, accumulate_steps=4)
    batch = make_batch(16)
    with pytest.raises(ValueError, match="has 6 layers, which do not split into pp_degree x"):
        step(make_params(6), batch)
    with pytest.raises(TypeError, match="params must be a fleetjax PipelineParams"):
        step(tuple(make_params(4)), batch)

    def widening(p, x):
        return jnp.concatenate([x, x], -1)

    step = pipeline(embed, widening, head_loss, mesh=mesh, micro_batch_size=2, accumulate_steps=4)
    with pytest.raises(ValueError, match="stage must return activations like its input"):
        step(make_params(4), batch)


def head_with_metrics(p, x, batch):
    loss = head_loss(p, x, batch)
    return loss, {"loss": loss, "first_output": jnp.mean(x @ p["w"], axis=0)[0]}


@pytest.mark.parametrize(
    ("axes", "has_aux"),
    [
        (AxisType.Auto, False),
        (AxisType.Explicit, True),
        # each axis type and each head form runs once by default (the suite's time)
        pytest.param(AxisType.Auto, True, marks=pytest.mark.slow),
        pytest.param(AxisType.Explicit, False, marks=pytest.mark.slow),
    ],
    ids=["Auto-loss", "Explicit-aux", "Auto-aux", "Explicit-loss"],
)
def test_loss_scale_scales_the_gradients_not_the_loss(axes, has_aux):
    """AMP's loss scaling: the backward runs on the scaled loss, so the gradients come back
    times the scale; the loss and the metrics do not."""
    mesh = build_mesh(dp=2, pp=4, axis_types=axes)
    head = head_with_metrics if has_aux else head_loss
    step = pipeline(
        embed, stage, head, mesh=mesh, micro_batch_size=2, accumulate_steps=4, has_aux=has_aux
    )

    def at(*spec):
        return NamedSharding(mesh, PartitionSpec(*spec))

    # On Explicit axes the traced types come from the arguments, so they are placed first.
    params = jax.device_put(make_params(8), PipelineParams(at(), at("pp"), at()))
    batch = jax.device_put(make_batch(16), at(("dp", "sharding")))
    scale = jnp.float32(1024.0)  # AMP's loss scales are powers of two
    with jax.set_mesh(mesh):
        out, grads = jax.jit(step)(params, batch)
        scaled_step = jax.jit(lambda params, batch, s: step(params, batch, loss_scale=s))
        scaled_out, scaled_grads = scaled_step(params, batch, scale)
    chex.assert_trees_all_close(scaled_out, out, rtol=1e-6)
    unscaled = jax.tree.map(lambda g: g / 1024, scaled_grads)
    chex.assert_trees_all_close(unscaled, grads, rtol=1e-5, atol=1e-6)
    expected_loss, expected_grads = reference(make_params(8), make_batch(16), 2, 4)
    np.testing.assert_allclose(out[0] if has_aux else out, expected_loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-6)


def test_loss_scale_must_be_a_scalar():
    mesh = build_mesh(dp=2, pp=4)
    step = pipeline(embed, stage, head_loss, mesh=mesh, micro_batch_size=2, accumulate_steps=4)
    with pytest.raises(
        ValueError, match=r"loss_scale must be a scalar, got an array of shape \(2,\)"
    ):
        step(make_params(4), make_batch(16), loss_scale=jnp.ones(2))
