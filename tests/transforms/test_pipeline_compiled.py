"""pipeline with data and tensor parallelism, and what XLA compiled: collectives, memory."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hlo import collectives
from jax.sharding import NamedSharding, PartitionSpec
from test_pipeline import (
    MICRO_BATCH_SIZE,
    embed,
    head_loss,
    make_batch,
    make_params,
    reference,
    stage,
)

from fleetjax.mesh import build_mesh
from fleetjax.transforms.pipeline import (
    PipelineParams,
    pipeline,
    to_model_order,
    to_pipeline_order,
)


def place(mesh, params, batch, layer_specs):
    """Layers split over pp (and as `layer_specs` say), the rest replicated, the batch over dp."""

    def at(*spec):
        return NamedSharding(mesh, PartitionSpec(*spec))

    params = PipelineParams(
        jax.device_put(params.embed, at()),
        jax.device_put(params.layers, {k: at(*v) for k, v in layer_specs.items()}),
        jax.device_put(params.head, at()),
    )
    return params, jax.device_put(batch, at(("dp", "sharding")))


@pytest.mark.parametrize(
    ("mode", "dp", "pp", "mp", "m"),
    [("1F1B", 2, 4, 1, 5), ("VPP", 2, 2, 2, 3)],
    ids=["dp2-pp4-1F1B", "dp2-pp2-mp2-VPP"],
)
def test_data_tensor_and_pipeline_parallel_equal_one_device(mode, dp, pp, mp, m):
    vpp = 2 if mode == "VPP" else 1
    mesh = build_mesh(dp=dp, pp=pp, mp=mp)
    params, batch = make_params(2 * pp * vpp), make_batch(dp * m * MICRO_BATCH_SIZE)
    ordered = params._replace(layers=to_pipeline_order(params.layers, pp, vpp))
    # Megatron-style: the hidden units of each layer split over mp.
    specs = {"w": ("pp", None, "mp"), "b": ("pp", "mp")}
    placed, placed_batch = place(mesh, ordered, batch, specs)
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
    loss, grads = jax.jit(step)(placed, placed_batch)
    # The layers' gradients stay split over pp like the layers.
    for g in jax.tree.leaves(grads.layers):
        assert {s.data.shape[0] for s in g.addressable_shards} == {g.shape[0] // pp}
    grads = grads._replace(layers=to_model_order(grads.layers, pp, vpp))
    expected_loss, expected_grads = reference(params, batch, dp, m)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-5)


def entry_computation(hlo_text):
    """The text of the HLO module's entry computation (outside every loop)."""
    start = hlo_text.index("\nENTRY ")
    return hlo_text[start : hlo_text.index("\n}\n", start)]


def test_compiled_one_f_one_b_moves_activations_not_parameters():
    mesh = build_mesh(dp=2, pp=4)
    params, batch = place(
        mesh, make_params(8), make_batch(2 * 8 * MICRO_BATCH_SIZE), {"w": ("pp",), "b": ("pp",)}
    )
    step = pipeline(
        embed, stage, head_loss, mesh=mesh, micro_batch_size=MICRO_BATCH_SIZE, accumulate_steps=8
    )
    text = jax.jit(step).lower(params, batch).compile().as_text()
    found = collectives(text)
    permutes = [c for c in found if c.op == "collective-permute"]
    # An activation to the next stage in the warm-up's loop and the steady state's, a
    # cotangent to the previous in the steady state's and the cool-down's: a replica's
    # micro-batch of hidden units, f32[micro_batch_size, HIDDEN].
    assert len(permutes) == 4
    assert {re.sub(r"\{.*", "", c.shape) for c in permutes} == {"f32[2,8]"}
    # No stage parameters are gathered; gradients are reduced over dp once, after the loop.
    assert not [c for c in found if c.op == "all-gather"]
    reductions = [c for c in found if c.op in ("all-reduce", "reduce-scatter")]
    assert reductions
    assert len(collectives(entry_computation(text))) == len(reductions)


def temp_bytes(mode, micro_batches, stage_fn=None, mesh=None):
    """Per-device temp bytes of the compiled pipeline for an activation-heavy model, on `mesh`
    (default: pp=4 CPU devices)."""
    hidden, rows = 64, 32
    mesh = mesh or build_mesh(dp=1, pp=4, devices=jax.devices()[:4])

    def spec(shape, *axes):
        at = NamedSharding(mesh, PartitionSpec(*axes))
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=at)

    params = PipelineParams(
        {"w": spec((5, hidden), None)},
        {"w": spec((4, hidden, hidden), "pp"), "b": spec((4, hidden), "pp")},
        {"w": spec((hidden, 3), None)},
    )
    batch = {"x": spec((micro_batches * rows, 5)), "y": spec((micro_batches * rows, 3))}
    step = pipeline(
        embed,
        stage_fn or stage,
        head_loss,
        mesh=mesh,
        micro_batch_size=rows,
        accumulate_steps=micro_batches,
        schedule_mode=mode,
    )
    return jax.jit(step).lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def test_one_f_one_b_memory_does_not_grow_fthenb_grows():
    """pp=4: 1F1B keeps residuals in a ring of 2P - 1 = 7 slots whatever m is; FThenB keeps
    all m. (benchmarks/pipeline_memory.py measures more points.)"""
    one_f_one_b = {m: temp_bytes("1F1B", m) for m in (4, 16)}
    fthenb = {m: temp_bytes("FThenB", m) for m in (4, 16)}
    assert one_f_one_b[16] <= 1.15 * one_f_one_b[4]
    assert fthenb[16] >= 2.5 * fthenb[4]
    assert fthenb[16] >= 1.6 * one_f_one_b[16]


def test_pytree_activations_and_recompute():
    """Activations may be a pytree; a `jax.checkpoint`ed stage gives the same gradients and
    keeps fewer residuals."""

    def embed2(p, batch):
        return jnp.tanh(batch["x"] @ p["w"]), batch["x"].sum(-1)

    def stage2(p, xs):
        x, total = xs
        h = x @ p["w"] + p["b"]
        h = (h - h.mean(-1, keepdims=True)) / jnp.sqrt(h.var(-1, keepdims=True) + 1e-5)
        return x + jax.nn.gelu(h), 0.9 * total + h.sum(-1)

    def head2(p, xs, batch):
        return head_loss(p, xs[0], batch) + 0.01 * jnp.mean(xs[1] ** 2)

    mesh = build_mesh(dp=1, pp=4, devices=jax.devices()[:4])
    params, batch = make_params(8), make_batch(6 * MICRO_BATCH_SIZE)
    expected_loss, expected_grads = reference(params, batch, 1, 6, (embed2, stage2, head2))
    temps = []
    for stage_fn in (stage2, jax.checkpoint(stage2)):
        step = jax.jit(
            pipeline(
                embed2,
                stage_fn,
                head2,
                mesh=mesh,
                micro_batch_size=MICRO_BATCH_SIZE,
                accumulate_steps=6,
            )
        )
        loss, grads = step(params, batch)
        np.testing.assert_allclose(loss, expected_loss, rtol=1e-6)
        chex.assert_trees_all_close(grads, expected_grads, rtol=1e-5, atol=1e-5)
        temps.append(step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes)
    assert temps[1] < temps[0]
