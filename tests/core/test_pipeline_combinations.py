"""The pipeline with gradient merge, fp16_allreduce, hierarchical all-reduce and model state:
the numbers of the unpipelined model under the same merge, reduction and state rules (issue 13:
seed 002's Strategy example and seed 001's pipeline + fp16_allreduce)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo import collectives, stablehlo_dtypes
from test_pipeline_step import MODEL, WIDTH, make, pipelined, train

import fleetjax
from fleetjax import PipelineLayer, PipelineParams
from fleetjax.transforms.pipeline import to_model_order

SCHEDULES = ["FThenB", "1F1B", "VPP"]


def schedules(default: str) -> list:
    """`SCHEDULES`, all but `default` under -m slow: each test runs one schedule by default
    (the suite's time), a different one per test."""
    return [s if s == default else pytest.param(s, marks=pytest.mark.slow) for s in SCHEDULES]


def model_for(schedule, model=MODEL):
    vpp = 2 if schedule == "VPP" else 1
    return PipelineLayer(model.embed, model.stage, model.head_loss, vpp)


def model_order(params, pp=2, vpp=1):
    params = jax.device_get(params)
    return params._replace(layers=to_model_order(params.layers, pp, vpp))


def seed_002(schedule=None):
    """Seed 002's `Strategy` example (sharding stage 2 over 2, gradient_merge k_steps=2 with
    avg=False, a 1F1B pipeline of micro_batch_size 2), on pp=2 x sharding=2 x dp=2; without a
    `schedule`, the same strategy without the pipeline."""
    config = {
        "sharding": {"enable": True, "stage": 2, "degree": 2},
        "gradient_merge": {"enable": True, "k_steps": 2, "avg": schedule is None},
    }
    if schedule is not None:
        vpp = 2 if schedule == "VPP" else 1
        config["pipeline"] = {
            "enable": True,
            "schedule_mode": schedule,
            "micro_batch_size": 2,
            "pp_degree": 2,
            "vpp_degree": vpp,
        }
    return fleetjax.Strategy(config)


@pytest.mark.parametrize("schedule", schedules("1F1B"))
def test_in_step_gradient_merge_is_the_pipelines_accumulation(schedule):
    """As Paddle's auto-parallel engine runs seed 002: the batch is cut into k_steps
    micro-batches, which the pipeline accumulates, averaged (Paddle sets avg=True)."""
    with pytest.warns(
        fleetjax.StrategyWarning,
        match=r"gradient_merge.avg=False has no effect.*mean over its micro-batches",
    ):
        step, state, losses = train(seed_002(schedule), tx=optax.adam(1e-2))
    assert step.plan.pipeline.accumulate_steps == 2
    assert dict(step.mesh.shape) == {"dp": 2, "pp": 2, "sharding": 2, "mp": 1}
    _, expected, expected_losses = train(seed_002(), tx=optax.adam(1e-2))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    vpp = 2 if schedule == "VPP" else 1
    chex.assert_trees_all_close(
        model_order(state.params, 2, vpp), jax.device_get(expected.params), rtol=1e-5, atol=2e-5
    )


def test_merge_and_accumulate_steps_must_agree():
    s = seed_002("1F1B")
    s.pipeline.accumulate_steps = 4
    with pytest.raises(
        ValueError,
        match=r"gradient_merge k_steps=2 and pipeline accumulate_steps=4 ask for different "
        r"numbers of micro-batches",
    ):
        fleetjax.make_train_step(MODEL, optax.sgd(0.1), s)


def test_in_step_merge_of_distributed_strategy_sets_the_micro_batches():
    s = pipelined("1F1B", pp=2, accumulate_steps=1, gradient_merge=True)
    s.gradient_merge_configs = {"k_steps": 2, "mode": "in_step"}
    _, state, losses = train(s)
    _, expected, expected_losses = train(fleetjax.DistributedStrategy())
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    chex.assert_trees_all_close(state.params, expected.params, rtol=1e-5, atol=1e-6)


def test_sharding_merge_is_the_pipelines_accumulation():
    """Paddle's static sharding optimizer merges the pipeline's micro-batches in place of
    sharding_configs.gradient_merge_acc_step."""
    s = pipelined("1F1B", pp=2, accumulate_steps=2, sharding=True)
    s.sharding_configs = {"gradient_merge_acc_step": 4, "sharding_degree": 2}
    with pytest.warns(
        fleetjax.StrategyWarning,
        match=r"gradient_merge_acc_step=4 has no effect.*pipeline_configs.accumulate_steps",
    ):
        plan = fleetjax.read_plan(s)
    assert plan.gradient_merge is None and plan.pipeline.accumulate_steps == 2


def test_gradient_merge_across_calls_steps_every_k_calls():
    """Paddle's GradientMergeOptimizer around the pipeline's gradient (optax.MultiSteps): the
    parameters move on every second call only, by the mean of two calls' gradients."""

    def merged(strategy):
        strategy.gradient_merge, strategy.gradient_merge_configs = True, {"k_steps": 2}
        return strategy

    pipelined_merge = merged(pipelined("1F1B", pp=2, accumulate_steps=2))
    _, state, losses = train(pipelined_merge, steps=4)
    _, expected, expected_losses = train(merged(fleetjax.DistributedStrategy()), steps=4)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    chex.assert_trees_all_close(state.params, expected.params, rtol=1e-5, atol=1e-6)


def replica_gradients(params, batch, replicas):
    """Each data-parallel replica's gradient of the unpipelined loss on its own rows."""
    rows = jax.tree.leaves(batch)[0].shape[0] // replicas
    own = lambda r: jax.tree.map(lambda x: x[r * rows : (r + 1) * rows], batch)  # noqa: E731
    return [jax.grad(MODEL)(params, own(r)) for r in range(replicas)]


@functools.cache
def on_four_replicas(**fields):
    """The unpipelined model's parameters after one step on dp=4 (a pipeline of pp=2 on the 8
    devices has 4 replicas), as host arrays."""
    mesh = fleetjax.build_mesh(dp=4, devices=jax.devices()[:4])
    _, state, _ = train(fleetjax.DistributedStrategy(**fields), steps=1, mesh=mesh)
    return jax.device_get(state.params)


def half_precision_tolerance(unit_roundoff, lr=0.1, replicas=4):
    """How far one SGD step under a half-precision all-reduce may land from another run's that
    rounds the same gradients computed in another order: each replica's gradient / R rounds to
    half precision (float32 rounding may tip it over a boundary: 1 ulp, 2 u |g|), and each of
    the R - 1 additions rounds (u |sum|). Per leaf, from the replicas' largest gradient."""
    grads = replica_gradients(make()[0], make(1)[1], replicas)
    largest = jax.tree.map(lambda *g: np.max(np.abs(np.stack(g))), *grads)
    update = jax.tree.map(lambda *g: np.mean(np.stack(g), 0), *grads)
    return jax.tree.map(lambda g: lr * (replicas + 1) * unit_roundoff * g, largest), update


@pytest.mark.parametrize("schedule", schedules("VPP"))
def test_fp16_allreduce_reduces_the_pipelines_gradients_in_half_precision(schedule):
    """Seed 001's pipeline + fp16_allreduce: each replica's gradient, over the replica count,
    is summed over the data axes in float16, once, after the loop, as without the pipeline."""
    vpp, replicas = 2 if schedule == "VPP" else 1, 4
    strategy = pipelined(schedule, pp=2, accumulate_steps=2, fp16_allreduce=True)
    step, state, _ = train(strategy, model_for(schedule), steps=1)
    got = model_order(state.params, 2, vpp)
    tolerance, mean_grad = half_precision_tolerance(2.0**-11)  # float16: 11 significant bits
    expected = on_four_replicas(fp16_allreduce=True)
    for g, e, t in zip(*map(jax.tree.leaves, (got, expected, tolerance)), strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=t)
    in_float32 = jax.tree.map(lambda p, g: p - 0.1 * g, make()[0], mean_grad)
    assert not all(map(np.array_equal, jax.tree.leaves(got), jax.tree.leaves(in_float32)))
    text = step.lower(state, make(1)[1]).compile().as_text()
    sums = [c for c in collectives(text) if c.op == "all-reduce"]
    half_sums = [c for c in sums if "f16[" in c.shape]
    assert half_sums and {c.group_size for c in half_sums} == {replicas}
    # The layers' gradients ([layers per stage, ...]) are summed in float16 only.
    assert any(f"f16[4,{WIDTH},{WIDTH}]" in c.shape for c in half_sums), half_sums
    assert not [c for c in sums if f"f32[4,{WIDTH},{WIDTH}]" in c.shape]


def test_bfloat16_allreduce_under_the_pipeline():
    strategy = pipelined("1F1B", pp=2, accumulate_steps=2, fp16_allreduce=True)
    strategy.fp16_allreduce_dtype = "bfloat16"
    step, state, _ = train(strategy, steps=1)
    # What fleetjax asks XLA for (XLA:CPU then sums bfloat16 in float32).
    assert "bf16" in stablehlo_dtypes(step.lower(state, make(1)[1]).as_text(), "all_reduce")
    tolerance, _ = half_precision_tolerance(2.0**-8)  # bfloat16: 8 significant bits
    expected = on_four_replicas(fp16_allreduce=True, fp16_allreduce_dtype="bfloat16")
    got = jax.device_get(state.params)
    for g, e, t in zip(*map(jax.tree.leaves, (got, expected, tolerance)), strict=True):
        np.testing.assert_allclose(g, e, rtol=0, atol=t)


def test_hierarchical_allreduce_under_the_pipeline():
    strategy = pipelined("1F1B", pp=2, accumulate_steps=2, use_hierarchical_allreduce=True)
    strategy.hierarchical_allreduce_inter_nranks = 2  # 2 nodes of the 4 replicas
    step, state, _ = train(strategy, steps=1)
    chex.assert_trees_all_close(
        jax.device_get(state.params), on_four_replicas(), rtol=1e-5, atol=1e-6
    )
    found = collectives(step.lower(state, make(1)[1]).compile().as_text())
    # The ring's steps move parts of the flattened layer gradients, [layers per stage x ...].
    assert [c for c in found if c.op == "collective-permute" and "f32[2048]" in c.shape]


# -- model state in the stages -----------------------------------------------------------------


def embed_with_state(p, s, batch):
    x = batch["x"] @ p["w"]
    return x, {"mean": 0.9 * s["mean"] + 0.1 * x.mean(0)}


def stage_with_state(p, s, h):
    """A layer normalising with its micro-batch's mean, keeping a running mean (float) and a
    count of the batches it saw (int)."""
    mean = h.mean(0)
    new = {"mean": 0.9 * s["mean"] + 0.1 * mean, "seen": s["seen"] + 1}
    return h + jnp.tanh((h - mean) @ p["w"]), new


def head_with_state(p, s, h, batch):
    loss = jnp.mean((h @ p["w"] - batch["y"]) ** 2)
    return loss, {"decayed": 0.5 * s["decayed"] + loss}


STATEFUL = PipelineLayer(embed_with_state, stage_with_state, head_with_state)


def initial_state(layers=8):
    return PipelineParams(
        {"mean": np.zeros(WIDTH, np.float32)},
        {"mean": np.zeros((layers, WIDTH), np.float32), "seen": np.zeros(layers, np.int32)},
        {"decayed": np.float32(1.0)},
    )


@pytest.mark.parametrize("schedule", schedules("FThenB"))
def test_model_state_in_the_stages(schedule):
    """Every micro-batch of every replica sees the step's state; the new float states are
    averaged over all of them and the others are the last one's, as the unpipelined step's
    in-step gradient merge does with its micro-batches. Layer l's state lives on its stage."""
    vpp, replicas, micro_batches = 2 if schedule == "VPP" else 1, 4, 2
    strategy = pipelined(schedule, pp=2, accumulate_steps=micro_batches)
    model = model_for(schedule, STATEFUL)
    step = fleetjax.make_train_step(model, optax.sgd(0.1), strategy, has_state=True)
    params, batch = make()[0], make(1)[1]
    state, metrics = step(step.init(params, model_state=initial_state()), batch)
    assert state.model_state.layers["mean"].sharding.spec == jax.sharding.PartitionSpec("pp")
    # The unpipelined step with in-step merge of all R x m micro-batches, its rows permuted so
    # that its micro-batch j (rows j, j + k, ...) is the pipeline's (rows [j b, (j + 1) b)).
    k = replicas * micro_batches
    permuted = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]).swapaxes(0, 1), batch)
    permuted = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), permuted)
    merge = fleetjax.Strategy({"gradient_merge": {"enable": True, "k_steps": k}})
    one_device = fleetjax.build_mesh(dp=1, devices=jax.devices()[:1])
    plain = fleetjax.make_train_step(STATEFUL, optax.sgd(0.1), merge, one_device, has_state=True)
    expected, expected_metrics = plain(plain.init(params, model_state=initial_state()), permuted)
    assert float(metrics["loss"]) == pytest.approx(float(expected_metrics["loss"]), rel=1e-5)
    chex.assert_trees_all_close(
        (model_order(state.params, 2, vpp), model_order(state.model_state, 2, vpp)),
        jax.device_get((expected.params, expected.model_state)),
        rtol=1e-5,
        atol=1e-6,
    )
    np.testing.assert_array_equal(jax.device_get(state.model_state.layers["seen"]), 1)


def test_model_state_must_keep_its_shapes():
    def growing(p, s, h):
        return h, {"mean": jnp.concatenate([s["mean"], s["mean"]]), "seen": s["seen"]}

    model = PipelineLayer(embed_with_state, growing, head_with_state)
    step = fleetjax.make_train_step(model, optax.sgd(0.1), pipelined(), has_state=True)
    state = step.init(make()[0], model_state=initial_state())
    with pytest.raises(ValueError, match="stage must return a model state like its input"):
        step(state, make(1)[1])


def test_model_state_is_pipeline_params():
    step = fleetjax.make_train_step(STATEFUL, optax.sgd(0.1), pipelined(), has_state=True)
    with pytest.raises(TypeError, match=r"model_state must be a fleetjax PipelineParams"):
        step.init(make()[0], model_state={"mean": np.zeros(WIDTH, np.float32)})
