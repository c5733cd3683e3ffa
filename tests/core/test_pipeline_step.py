"""The pipeline inside make_train_step: the same numbers as the unpipelined model."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import fleetjax
from fleetjax import PipelineLayer, PipelineParams
from fleetjax.transforms.pipeline import part_keys, to_model_order

LAYERS, WIDTH = 8, 32  # 8 x 32 x 32 layer weights: big enough for ZeRO to split


def embed(p, batch):
    return batch["x"] @ p["w"]


def stage(p, h):
    return h + jnp.tanh(h @ p["w"])


def head_loss(p, h, batch):
    return jnp.mean((h @ p["w"] - batch["y"]) ** 2)


MODEL = PipelineLayer(embed, stage, head_loss)


def make(seed=0, rows=16):
    rng = np.random.RandomState(seed)
    params = PipelineParams(
        embed={"w": rng.randn(5, WIDTH).astype(np.float32) / 3},
        layers={"w": rng.randn(LAYERS, WIDTH, WIDTH).astype(np.float32) / 8},
        head={"w": rng.randn(WIDTH, 3).astype(np.float32) / 4},
    )
    batch = {"x": rng.randn(rows, 5).astype(np.float32), "y": rng.randn(rows, 3).astype(np.float32)}
    return params, batch


def pipelined(schedule="1F1B", pp=4, micro_batch_size=2, accumulate_steps=4, **extra):
    s = fleetjax.DistributedStrategy(pipeline=True, **extra)
    s.hybrid_configs = {"pp_degree": pp, **s.hybrid_configs.set_values()}
    s.pipeline_configs = {
        "schedule_mode": schedule,
        "micro_batch_size": micro_batch_size,
        "accumulate_steps": accumulate_steps,
    }
    return s


def train(strategy, model=MODEL, tx=None, steps=2, rows=16, mesh=None):
    params, _ = make()
    step = fleetjax.make_train_step(model, tx or optax.sgd(0.1), strategy, mesh=mesh)
    state = step.init(params)
    losses = []
    for seed in range(1, steps + 1):
        state, metrics = step(state, make(seed, rows)[1])
        losses.append(float(metrics["loss"]))
    return step, state, losses


def reference(tx=None, steps=2, rows=16):
    return train(fleetjax.DistributedStrategy(), tx=tx, steps=steps, rows=rows)


@pytest.mark.parametrize("schedule", ["FThenB", "F-then-B", "1F1B"])
def test_pipelined_step_equals_the_plain_model(schedule):
    step, state, losses = train(pipelined(schedule))  # dp=2 x pp=4
    _, expected, expected_losses = reference()
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    chex.assert_trees_all_close(state.params, expected.params, rtol=1e-5, atol=1e-6)
    assert state.params.layers["w"].sharding.spec[0] == "pp"
    assert dict(step.mesh.shape) == {"dp": 2, "pp": 4, "sharding": 1, "mp": 1}


def test_interleaved_vpp_keeps_layers_in_pipeline_order():
    model = PipelineLayer(embed, stage, head_loss, num_virtual_pipeline_stages=2)
    _, state, losses = train(pipelined("VPP"), model=model)
    _, expected, expected_losses = reference()
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    layers = to_model_order(jax.device_get(state.params.layers), 4, 2)
    chex.assert_trees_all_close(
        layers, jax.device_get(expected.params.layers), rtol=1e-5, atol=1e-6
    )


def test_with_zero_and_adam():
    s = pipelined(sharding=True)
    s.hybrid_configs = {"dp_degree": 1}
    s.sharding_configs = {"stage": 2, "sharding_degree": 2, "pp_degree": 4}
    _, state, losses = train(s, tx=optax.adam(1e-2))
    _, expected, expected_losses = reference(tx=optax.adam(1e-2))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    chex.assert_trees_all_close(state.params, expected.params, rtol=1e-5, atol=2e-5)
    assert state.opt_state[0].mu.layers["w"].sharding.spec == jax.sharding.PartitionSpec(
        "pp", "sharding", None
    )


def test_with_amp_and_recompute():
    def marked_stage(p, h):
        return fleetjax.recompute(stage)(p, h)

    s = pipelined(amp=True)
    s.amp_configs = {"dtype": "bfloat16"}
    s.recompute, s.recompute_configs = True, {"policy": "nothing_saveable"}
    _, _, losses = train(s, model=PipelineLayer(embed, marked_stage, head_loss))
    _, _, expected_losses = reference()
    np.testing.assert_allclose(losses, expected_losses, rtol=2e-2)


def test_float16_loss_scaling_through_the_head():
    s = pipelined(amp=True)
    _, state, losses = train(s)
    _, _, expected_losses = reference()
    np.testing.assert_allclose(losses, expected_losses, rtol=2e-2)
    assert float(state.loss_scale.loss_scale) == 32768.0


def head_loss_and_metrics(p, h, batch):
    error = h @ p["w"] - batch["y"]
    return jnp.mean(error**2), {"mae": jnp.mean(jnp.abs(error)), "rows": jnp.float32(len(error))}


@pytest.mark.parametrize(
    "schedule, extra",
    [("1F1B", {}), ("FThenB", {"amp": True}), ("VPP", {})],
)
def test_aux_metrics_are_the_unpipelined_ones(schedule, extra):
    """Metrics of `head_loss` come back averaged over micro-batches and replicas, unscaled."""
    vpp = 2 if schedule == "VPP" else 1
    model = PipelineLayer(embed, stage, head_loss_and_metrics, num_virtual_pipeline_stages=vpp)
    strategy = pipelined(schedule, **extra)
    found = []
    for s in (strategy, fleetjax.DistributedStrategy(**extra)):
        step = fleetjax.make_train_step(model, optax.sgd(0.1), s, has_aux=True)
        state = step.init(make()[0])
        state, metrics = step(state, make(1)[1])
        found.append({k: float(v) for k, v in metrics.items() if k in ("loss", "mae", "rows")})
    pipelined_metrics, plain = found
    assert pipelined_metrics.keys() == plain.keys() == {"loss", "mae", "rows"}
    rtol = 1e-2 if extra else 1e-5  # float16 AMP
    for name in ("loss", "mae"):
        assert pipelined_metrics[name] == pytest.approx(plain[name], rel=rtol), name
    # A micro-batch has 2 of a replica's 8 rows; the unpipelined loss sees all 16.
    assert (pipelined_metrics["rows"], plain["rows"]) == (2.0, 16.0)


def dropout(x, key, rate=0.5):
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0.0)


def embed_dropout(p, batch, key):
    return dropout(batch["x"] @ p["w"], key)


def stage_dropout(p, h, key):
    return h + dropout(jnp.tanh(h @ p["w"]), key)


def head_dropout(p, h, batch, key):
    return jnp.mean((dropout(h, key) @ p["w"] - batch["y"]) ** 2)


def keyed_reference(params, batch, key, replicas, micro_batches):
    """The loss and gradients of the dropout model as `part_keys` documents its keys: the mean
    over replicas and micro-batches, each part of each with its own key."""

    def loss_fn(params):
        rows = jax.tree.leaves(batch)[0].shape[0] // (replicas * micro_batches)
        losses = []
        for r in range(replicas):
            for i in range(micro_batches):
                start = (r * micro_batches + i) * rows
                micro = {k: v[start : start + rows] for k, v in batch.items()}
                keys = part_keys(key, r, i, jnp.arange(LAYERS + 2))
                h = embed_dropout(params.embed, micro, keys[0])
                for layer in range(LAYERS):
                    w = {"w": params.layers["w"][layer]}
                    h = stage_dropout(w, h, keys[1 + layer])
                losses.append(head_dropout(params.head, h, micro, keys[-1]))
        return jnp.mean(jnp.stack(losses))

    return jax.value_and_grad(loss_fn)(params)


@pytest.mark.parametrize(
    "schedule, vpp, axes",
    [
        # 1F1B on Explicit axes, VPP and no pipeline run by default (the suite's time)
        pytest.param("1F1B", 1, AxisType.Auto, marks=pytest.mark.slow),
        ("1F1B", 1, AxisType.Explicit),
        pytest.param("FThenB", 1, AxisType.Auto, marks=pytest.mark.slow),
        ("VPP", 2, AxisType.Auto),
        (None, 1, AxisType.Auto),
    ],
)
def test_keys_reach_every_part_as_documented(schedule, vpp, axes):
    """With has_rng every embed, layer and head of every micro-batch and replica draws from its
    own key; the backward recomputes embed with the same one. Without a pipeline the model is
    one replica's one micro-batch."""
    model = PipelineLayer(
        embed_dropout, stage_dropout, head_dropout, num_virtual_pipeline_stages=vpp
    )
    strategy = pipelined(schedule) if schedule else fleetjax.DistributedStrategy()
    degrees = {"dp": 2, "pp": 4} if schedule else {"dp": 8}
    mesh = fleetjax.build_mesh(**degrees, axis_types=axes)
    step = fleetjax.make_train_step(model, optax.sgd(0.1), strategy, mesh, has_rng=True)
    params, batch = make()
    state = step.init(params, seed=3)
    new_state, metrics = step(state, batch)
    key = jax.random.fold_in(jax.random.PRNGKey(3), 0)  # the step's key at step 0
    replicas, micro_batches = (2, 4) if schedule else (1, 1)
    loss, grads = keyed_reference(params, batch, key, replicas, micro_batches)
    assert float(metrics["loss"]) == pytest.approx(float(loss), rel=1e-5)
    layers = jax.device_get(new_state.params.layers)
    if vpp > 1:
        layers = to_model_order(layers, 4, vpp)
    expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    chex.assert_trees_all_close(
        (jax.device_get(new_state.params.embed), layers, jax.device_get(new_state.params.head)),
        (expected.embed, expected.layers, expected.head),
        rtol=1e-5,
        atol=1e-6,
    )
    # A different key draws different masks.
    _, other = step(step.init(params, seed=4), batch)
    assert float(other["loss"]) != pytest.approx(float(metrics["loss"]), rel=1e-3)


def test_auto_parallel_strategy():
    s = fleetjax.Strategy(
        {"pipeline": {"enable": True, "pp_degree": 2, "micro_batch_size": 4, "accumulate_steps": 2}}
    )
    step, _, losses = train(s, rows=32)  # 4 data replicas x 4 rows x 2 micro-batches
    np.testing.assert_allclose(losses, reference(rows=32)[2], rtol=1e-5)
    assert step.mesh.shape["pp"] == 2


class TestErrors:
    def test_needs_a_pipeline_layer(self):
        with pytest.raises(
            TypeError, match=r"pass fleetjax.PipelineLayer\(embed, stage, head_loss\)"
        ):
            fleetjax.make_train_step(lambda p, b: 0.0, optax.sgd(0.1), pipelined())

    def test_batch_size_is_checked_like_paddle(self):
        params, batch = make(rows=24)
        step = fleetjax.make_train_step(MODEL, optax.sgd(0.1), pipelined())
        with pytest.raises(ValueError, match=r"2 x 2 x 4 = 16 rows, got 24"):
            step(step.init(params), batch)

    def test_every_paddle_schedule_is_built(self):
        # Paddle's schedule_mode values (the zero-bubble ones too) all make a step.
        for mode in ("Eager1F1B", "ZBH1", "ZBVPP"):
            fleetjax.make_train_step(MODEL, optax.sgd(0.1), pipelined(mode))

    def test_per_replica_optimizers_clash(self):
        s = pipelined(localsgd=True)
        with pytest.raises(ValueError, match="the pipeline does not combine with localsgd"):
            fleetjax.make_train_step(MODEL, optax.sgd(0.1), s)

    def test_the_model_alone_is_the_unpipelined_loss(self):
        params, batch = make()
        x = embed(params.embed, batch)
        for i in range(LAYERS):
            x = stage({"w": params.layers["w"][i]}, x)
        assert float(MODEL(params, batch)) == pytest.approx(
            float(head_loss(params.head, x, batch)), rel=1e-6
        )


def test_explain_counts_the_permutes_of_every_tick():
    """Activations go down in every tick that runs forwards and cotangents up in every tick
    that runs backwards, inside the compiled loops: m + pp - 1 of each under 1F1B, not one of
    each in all m + 2 (pp - 1) ticks (the warm-up sends no cotangent, the cool-down no
    activation)."""
    pp, m = 4, 4
    step, state, _ = train(pipelined("1F1B", pp=pp, accumulate_steps=m), steps=1)
    report = fleetjax.explain(step, make(1)[1], state, show=False)
    permutes = [c for c in report.collectives if c.op == "collective-permute"]
    assert fleetjax.pipeline_schedule("1F1B", pp, m).ticks == m + 2 * (pp - 1)
    sends = 2 * (m + pp - 1)
    assert [(c.dtype, c.count) for c in permutes] == [("f32", sends)]
    # Each device sends its own replica's (dp=2 over 8 devices) [micro_batch_size, WIDTH].
    activation_bytes = 2 * WIDTH * 4
    assert permutes[0].bytes == sends * activation_bytes


def test_amp_casts_the_stages_weights_once_per_step():
    """Under AMP the stage converts its weights to bf16 before each matmul; the pipeline does
    it once per step, before its loops, not in every tick and recomputed layer: the lowered
    step converts the stage's stacked f32 [2, 32, 32] weights, never a layer's [32, 32]."""

    def marked_stage(p, h):
        return fleetjax.recompute(stage)(p, h)

    s = pipelined(amp=True)
    s.amp_configs = {"dtype": "bfloat16"}
    s.recompute, s.recompute_configs = True, {"policy": "nothing_saveable"}
    step = fleetjax.make_train_step(
        PipelineLayer(embed, marked_stage, head_loss), optax.sgd(0.1), s
    )
    params, batch = make()
    text = step.lower(step.init(params), batch).as_text()
    converts = re.findall(
        r"stablehlo.convert .*: \(tensor<([\dx]+)xf32>\) -> tensor<\1xbf16>", text
    )
    assert "2x32x32" in converts  # a stage's two layers of 32 x 32, at once
    assert "32x32" not in converts
