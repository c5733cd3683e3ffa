"""ZeRO over the `sharding` axis: per-device bytes as ZeRO promises, the same numbers."""

import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo import collectives
from jax.sharding import PartitionSpec as P

import fleetjax
from fleetjax.checkpoint import CheckpointManager
from fleetjax.mesh import ZERO_MIN_ELEMENTS, build_mesh, zero_spec

WIDTH, LAYERS = 256, 4


def loss_fn(params, batch):
    h = batch["x"]
    for i in range(LAYERS):
        h = jnp.tanh(h @ params[f"w{i}"])
    return jnp.mean((h - batch["y"]) ** 2)


def make(seed=0, rows=16):
    rng = np.random.RandomState(seed)
    params = {f"w{i}": rng.randn(WIDTH, WIDTH).astype(np.float32) / 16 for i in range(LAYERS)}
    batch = {
        "x": rng.randn(rows, WIDTH).astype(np.float32),
        "y": rng.randn(rows, WIDTH).astype(np.float32),
    }
    return params, batch


def zero(stage, **configs):
    s = fleetjax.DistributedStrategy(sharding=stage > 0)
    s.sharding_configs = {"stage": max(stage, 1), **configs}
    return s


def step_for(strategy, tx=None):
    step = fleetjax.make_train_step(loss_fn, tx or optax.adam(1e-3), strategy)
    return step, step.init(make()[0])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_argument_bytes_follow_the_zero_formulas(stage):
    """P = parameter bytes, N = 8: no sharding 3P; stages 1 and 2: P + 2P/N; stage 3: 3P/N."""
    params, batch = make()
    p_bytes = sum(x.nbytes for x in params.values())
    expected = {0: 3 * p_bytes, 1: p_bytes + 2 * p_bytes / 8, 2: p_bytes + 2 * p_bytes / 8}
    expected[3] = 3 * p_bytes / 8
    step, state = step_for(zero(stage))
    memory = step.lower(state, batch).compile().memory_analysis()
    batch_bytes = sum(x.nbytes for x in batch.values()) // 8
    measured = memory.argument_size_in_bytes - batch_bytes
    assert measured == pytest.approx(expected[stage], rel=0.05)


def test_stage_2_keeps_one_nth_of_the_gradients():
    _, batch = make()
    one = fleetjax.explain(step_for(zero(1))[0], batch, show=False)
    two = fleetjax.explain(step_for(zero(2))[0], batch, show=False)
    assert two.grads * 8 == one.grads
    ops = {c.op for c in two.collectives}
    assert "reduce-scatter" in ops
    scattered = sum(c.bytes for c in two.collectives if c.op == "reduce-scatter")
    assert scattered == one.grads // 8  # each device receives only its shard
    assert two.temp < one.temp / 2, (one.temp, two.temp)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_params_equal_one_device_after_three_steps(stage):
    params, _ = make()
    batches = [make(seed)[1] for seed in range(1, 4)]
    step, state = step_for(zero(stage))
    for batch in batches:
        state, _ = step(state, batch)
    tx, reference = optax.adam(1e-3), params
    opt_state = tx.init(reference)
    for batch in batches:
        grads = jax.grad(loss_fn)(reference, batch)
        updates, opt_state = tx.update(grads, opt_state, reference)
        reference = optax.apply_updates(reference, updates)
    # Adam normalizes tiny gradients; last-bit differences of the 8-device sum move a
    # parameter by far less than the learning rate (1e-3), which a wrong update would not.
    chex.assert_trees_all_close(jax.device_get(state.params), reference, rtol=1e-5, atol=2e-5)


def test_placements_by_stage():
    def specs(stage):
        _, state = step_for(zero(stage))
        return state.params["w0"].sharding.spec, state.opt_state[0].mu["w0"].sharding.spec

    assert specs(0) == (P(), P())
    assert specs(1) == (P(), P("sharding", None))
    assert specs(3) == (P("sharding", None), P("sharding", None))
    _, state = step_for(zero(3))
    assert state.opt_state[0].count.sharding.spec == P()  # scalars stay whole


def test_data_parallel_and_sharding_axes_together():
    mesh = build_mesh(dp=2, sharding=4)
    s = zero(2, sharding_degree=4, dp_degree=2)
    params, batch = make()
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s, mesh=mesh)
    state, metrics = step(step.init(params), batch)
    plain = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    expected, expected_metrics = plain(plain.init(params), batch)
    np.testing.assert_allclose(metrics["loss"], expected_metrics["loss"], rtol=1e-6)
    chex.assert_trees_all_close(state.params, expected.params, rtol=1e-5, atol=1e-6)
    groups = {
        (c.op, c.group_size) for c in collectives(step.lower(state, batch).compile().as_text())
    }
    assert ("reduce-scatter", 4) in groups and ("all-reduce", 2) in groups


def test_optimizer_offload_keeps_the_state_in_pinned_host_memory():
    _, batch = make()
    step, state = step_for(zero(1, optimize_offload=True))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
    assert kinds == {"pinned_host"}
    state, _ = step(state, batch)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
    plain, plain_state = step_for(zero(1))
    expected, _ = plain(plain_state, batch)
    chex.assert_trees_all_close(state.params, expected.params, rtol=1e-6)


def test_placement_rule():
    mesh = build_mesh(dp=2, sharding=2, mp=2)
    assert zero_spec(P(), (100, 100), mesh) == P("sharding", None)  # the largest dimension
    assert zero_spec(P(), (7, 4096), mesh) == P(None, "sharding")
    assert zero_spec(P(None, "mp"), (64, 64), mesh) == P("sharding", "mp")  # a free dimension
    assert zero_spec(P("mp"), (4096, 3), mesh) == P(("mp", "sharding"), None)  # shared with mp
    assert zero_spec(P(), (ZERO_MIN_ELEMENTS - 1,), mesh) == P()  # small: whole
    assert zero_spec(P(), (4097, 3), mesh) == P()  # nothing splits evenly


def test_other_ways_to_ask_for_zero():
    auto = fleetjax.Strategy({"sharding": {"enable": True, "stage": 3, "degree": 8}})
    hybrid = fleetjax.DistributedStrategy(hybrid_configs={"sharding_degree": 8})
    assert fleetjax.make_train_step(loss_fn, optax.sgd(0.1), auto).plan.sharding_stage == 3
    assert fleetjax.make_train_step(loss_fn, optax.sgd(0.1), hybrid).plan.sharding_stage == 1


def test_refusals():
    s = zero(1, sharding_degree=8)
    s.dgc = True
    with pytest.raises(ValueError, match="ZeRO sharding does not combine with dgc"):
        fleetjax.make_train_step(loss_fn, fleetjax.optimizers.momentum(0.1), s)
    s = zero(1)
    s.fp16_allreduce = True
    with pytest.warns(
        fleetjax.StrategyWarning,
        match="fp16_allreduce=True has no effect in fleetjax: turned off under ZeRO",
    ):
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
    assert step.plan.allreduce_dtype is None


def test_restore_onto_another_stage(tmp_path):
    _, batch = make()
    plain, state = step_for(zero(0))
    state, _ = plain(state, batch)
    with CheckpointManager(tmp_path, async_save=False) as manager:
        manager.save(1, state)
    sharded, target = step_for(zero(3))
    with CheckpointManager(tmp_path, read_only=True) as manager:
        restored, _ = manager.restore(target)
    assert restored.params["w0"].sharding.spec == P("sharding", None)
    chex.assert_trees_all_equal(jax.device_get(restored.params), jax.device_get(state.params))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sharded(restored, batch)  # trains on from there
