"""Every module of fleetjax/transforms/, used on its own on a toy loss, with no strategy object:
each against plain JAX."""

import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fleetjax
from fleetjax.transforms import (
    amp,
    grad_allreduce,
    grad_fn,
    gradient_merge,
    loss_scale,
    per_replica,
    pipeline,
    recompute,
    sparse_rows,
)

ROWS, WIDTH = 16, 4
TRANSFORMS = pathlib.Path(fleetjax.transforms.__file__).parent


def toy_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def toy():
    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(WIDTH, WIDTH)), jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(WIDTH, 1)), jnp.float32),
    }
    batch = {
        "x": jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32),
        "y": jnp.asarray(rng.normal(size=(ROWS, 1)), jnp.float32),
    }
    return params, batch


def toy_grad_fn():
    """The toy loss as a `GradFn` (no model state, no aux)."""

    def loss(params, model_state, batch):
        value = toy_loss(params, batch)
        return value, grad_fn.Outputs(value, {}, model_state)

    return grad_fn.value_and_grad(loss)


def reference():
    params, batch = toy()
    return jax.value_and_grad(toy_loss)(params, batch)


def test_every_transform_module_is_tested_here():
    modules = {p.stem for p in TRANSFORMS.glob("*.py") if not p.stem.startswith("_")}
    modules |= {p.name for p in TRANSFORMS.iterdir() if (p / "__init__.py").exists()}
    tested = {name.removeprefix("test_") for name in globals() if name.startswith("test_")}
    assert modules <= tested, f"transforms without a test here: {sorted(modules - tested)}"


def test_grad_fn():
    params, batch = toy()
    outputs, grads = toy_grad_fn()(params, None, batch)
    loss, expected = reference()
    np.testing.assert_allclose(outputs.loss, loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, expected, rtol=1e-6)


def test_amp():
    params, batch = toy()
    policy = amp.policy("bfloat16", "O1")
    cast = amp.autocast(toy_loss, policy)
    jaxpr = jax.make_jaxpr(cast)(params, batch)
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    np.testing.assert_allclose(cast(params, batch), toy_loss(params, batch), rtol=3e-2)


def test_loss_scale():
    params, batch = toy()
    scale = loss_scale.DynamicLossScale.create(1024.0, incr_every_n_steps=1)
    grads = jax.grad(lambda p: scale.scale(toy_loss(p, batch)))(params)
    sgd = lambda g: optax.apply_updates(params, jax.tree.map(lambda x: -0.1 * x, g))  # noqa: E731
    new, scale, metrics = loss_scale.apply_if_finite(sgd, params, grads, scale)
    chex.assert_trees_all_close(new, sgd(reference()[1]), rtol=1e-5)
    assert float(scale.loss_scale) == 2048.0 and not bool(metrics["skipped"])
    bad = jax.tree.map(lambda g: g.at[0].set(jnp.inf), grads)
    kept, scale, metrics = loss_scale.apply_if_finite(sgd, params, bad, scale)
    chex.assert_trees_all_equal(kept, params)
    assert bool(metrics["skipped"]) and float(scale.loss_scale) == 2048.0


def test_recompute():
    params, batch = toy()
    layer = recompute.recompute(lambda w, x: jnp.tanh(x @ w))

    def loss(p):
        return jnp.mean((layer(p["w1"], batch["x"]) @ p["w2"] - batch["y"]) ** 2)

    with recompute.recompute_scope(policy="nothing_saveable") as tracing:
        grads = jax.grad(loss)(params)
    assert tracing.layers == 1
    chex.assert_trees_all_close(grads, reference()[1], rtol=1e-6)


def test_gradient_merge():
    params, batch = toy()
    outputs, grads = gradient_merge.microbatched(toy_grad_fn(), k_steps=4)(params, None, batch)
    loss, expected = reference()
    np.testing.assert_allclose(outputs.loss, loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, expected, rtol=1e-5)


def test_grad_allreduce():
    params, batch = toy()
    mesh = fleetjax.build_mesh(dp=8)
    reduced = grad_allreduce.data_parallel(
        toy_grad_fn(), mesh, ("dp",), grad_allreduce.mean_in(jnp.bfloat16)
    )
    outputs, grads = jax.jit(reduced)(params, None, batch)
    loss, expected = reference()
    np.testing.assert_allclose(outputs.loss, loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, expected, rtol=1e-2)  # summed in bfloat16


def test_per_replica():
    params, batch = toy()
    mesh = fleetjax.build_mesh(dp=8)

    def update(state, rows, key, agree):
        grads = jax.grad(toy_loss)(state, rows)  # this replica's rows only
        return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), {"loss": toy_loss(state, rows)}

    run = per_replica.per_replica(update, mesh, ("dp",), P(), False)
    new, metrics = jax.jit(run)(params, batch, None)
    # Each replica stepped on its own two rows; replicated outputs keep replica 0's.
    first = {k: v[:2] for k, v in batch.items()}
    chex.assert_trees_all_close(
        new, jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(toy_loss)(params, first))
    )
    per_device = [
        toy_loss(params, {k: v[2 * i : 2 * i + 2] for k, v in batch.items()}) for i in range(8)
    ]
    np.testing.assert_allclose(metrics["loss"], np.mean(per_device), rtol=1e-6)


@pytest.mark.parametrize("schedule", ["FThenB", "1F1B"])
def test_pipeline(schedule):
    params, batch = toy()
    layers = jnp.stack([params["w1"]] * 4)
    pipe_params = pipeline.PipelineParams(None, layers, params["w2"])
    model = pipeline.PipelineLayer(
        embed=lambda _, b: b["x"],
        stage=lambda w, h: jnp.tanh(h @ w),
        head_loss=lambda w2, h, b: jnp.mean((h @ w2 - b["y"]) ** 2),
    )
    mesh = fleetjax.build_mesh(dp=2, pp=4)
    value_and_grad = pipeline.pipeline(
        model.embed,
        model.stage,
        model.head_loss,
        mesh=mesh,
        micro_batch_size=4,
        accumulate_steps=2,
        schedule_mode=schedule,
    )
    loss, grads = jax.jit(value_and_grad)(pipe_params, batch)
    expected_loss, expected = jax.value_and_grad(model)(pipe_params, batch)
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    chex.assert_trees_all_close(grads, expected, rtol=1e-4, atol=1e-6)


def test_sparse_rows():
    """A toy loss reading a sparse table split over 8 devices: the gradient of the table is its
    touched rows (duplicates summed) and Paddle's naive rule on them equals plain SGD on a dense
    table."""
    rng = np.random.default_rng(0)
    mesh = fleetjax.mesh.build_mesh(dp=8)
    axes = ("dp", "sharding", "pp", "mp")
    table = jnp.asarray(rng.normal(size=(64, WIDTH)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 64, size=(ROWS, 3)), jnp.int32)
    params, batch = toy()
    params = {"emb": fleetjax.layers.sparse_table(table), "w2": params["w2"]}

    def loss(params, ids, y):
        rows = fleetjax.layers.lookup(params["emb"], ids).sum(1)
        return jnp.mean((rows @ params["w2"] - y) ** 2)

    @jax.jit
    def step(params, ids, y):
        value, grads, touched = sparse_rows.value_and_grad(loss, mesh, axes)(params, ids, y)
        named = sparse_rows.name_tables(params)
        rules = {"['emb']": fleetjax.optimizers.sparse_rules.naive_sgd(0.5)}
        slots = sparse_rows.init_slots(rules, sparse_rows.tables(named))
        new, _ = sparse_rows.apply_rows(rules, named, slots, touched, grads, mesh, axes)
        return value, new["emb"][...], grads["emb"][...], touched["['emb']"].ids

    with jax.set_mesh(mesh):
        value, new, row_grads, touched = step(params, ids, batch["y"][:, 0])

    def dense(table):
        return jnp.mean(((table[ids].sum(1) @ params["w2"]) - batch["y"][:, 0]) ** 2)

    expected, grad = jax.value_and_grad(dense)(table)
    distinct = np.unique(ids)
    assert row_grads.shape == (len(touched), WIDTH) and row_grads.shape[0] < 64
    np.testing.assert_array_equal(touched[: len(distinct)], distinct)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    np.testing.assert_allclose(row_grads[: len(distinct)], grad[distinct], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(new, table - 0.5 * grad, rtol=1e-5, atol=1e-7)
