"""The gradient chain alone (`fleetjax.step.grad_chain`): from a plan, a mesh and a placement, the
gradient function of a loss, against `jax.value_and_grad` on one device. No optimizer, no
train step."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from hlo import collectives, computations

import fleetjax
from fleetjax.mesh import build_mesh
from fleetjax.placement import place
from fleetjax.step import Signature, grad_chain
from fleetjax.transforms.loss_scale import DynamicLossScale

RNG = np.random.default_rng(0)
PARAMS = {"w": RNG.normal(size=(8, 4)).astype(np.float32) / 3}
BATCH = {"x": RNG.normal(size=(32, 8)).astype(np.float32), "y": RNG.normal(size=(32, 4))}
BATCH["y"] = BATCH["y"].astype(np.float32)


def loss_fn(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w"]) - batch["y"]) ** 2)


def chain(strategy, loss_scale=None):
    """The chain's gradient function for `strategy` on 8 devices, jitted over the batch split
    as a step splits it, and its compiled text."""
    plan = fleetjax.read_plan(strategy)
    mesh = build_mesh(dp=8)
    tx = optax.sgd(0.1)
    state = jax.eval_shape(
        lambda p: fleetjax.TrainState(jnp.zeros((), jnp.int32), p, tx.init(p), jnp.zeros(2)),
        PARAMS,
    )
    placement = place(plan, mesh, state, tx)
    grad_fn = grad_chain(loss_fn, plan, mesh, placement, Signature(), loss_scale)
    run = jax.jit(
        lambda p, b: grad_fn(p, None, b),
        in_shardings=(placement.params, placement.batch),
        out_shardings=(None, placement.grads),
    )
    with jax.set_mesh(mesh):
        (out, grads), text = run(PARAMS, BATCH), run.lower(PARAMS, BATCH).compile().as_text()
    return out, grads, text


def expected():
    return jax.value_and_grad(loss_fn)(PARAMS, BATCH)


def test_no_transform_is_value_and_grad():
    out, grads, text = chain(fleetjax.DistributedStrategy())
    loss, want = expected()
    np.testing.assert_allclose(out.loss, loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-7)
    assert {c.op for c in collectives(text)} == {"all-reduce"}  # XLA's own


def test_in_step_merge_is_the_whole_batch_and_reduces_once():
    merge = {"gradient_merge": {"enable": True, "k_steps": 4, "mode": "in_step"}}
    out, grads, text = chain(fleetjax.Strategy(merge))
    loss, want = expected()
    np.testing.assert_allclose(out.loss, loss, rtol=1e-5)
    chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-7)
    where = [name for name, part in computations(text).items() if collectives(part)]
    assert where == ["ENTRY"]  # reduced once after the micro-batch loop, not inside it


def test_fp16_allreduce_sums_in_half_precision():
    _, grads, text = chain(fleetjax.DistributedStrategy(fp16_allreduce=True))
    _, want = expected()
    chex.assert_trees_all_close(grads, want, rtol=2e-3, atol=1e-4)
    reduced = [a for c in collectives(text) if c.op == "all-reduce" for a in c.arrays]
    assert ("f16", (8, 4)) in reduced and ("f32", (8, 4)) not in reduced  # the gradient


def test_the_loss_is_differentiated_scaled_and_reported_unscaled():
    scale = DynamicLossScale.create(1024.0)
    out, grads, _ = chain(fleetjax.DistributedStrategy(), scale)
    loss, want = expected()
    np.testing.assert_allclose(out.loss, loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, jax.tree.map(lambda g: 1024.0 * g, want), rtol=1e-5)
