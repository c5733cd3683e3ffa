"""The example GPT trained by `make_train_step` under hybrid strategies (tensor, ZeRO and pipeline
parallel over 8 devices, on Auto and Explicit meshes) has one device's loss curve."""

import itertools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from tiny_gpt import EIGHT_HEADS as CONFIG
from tiny_gpt import make_gpt

import fleetjax
from fleetjax.transforms.pipeline import PipelineLayer

STEPS = 3
ROWS = 8


@pytest.fixture(scope="module")
def gpt():
    return make_gpt(CONFIG, seed=0)


@pytest.fixture(scope="module")
def batches():
    key = jax.random.key(1)
    return [
        {"tokens": jax.random.randint(k, (ROWS, CONFIG.max_position_embeddings + 1), 0, 64)}
        for k in jax.random.split(key, STEPS)
    ]


def losses(gpt, batches, strategy, mesh=None, pipelined=False):
    model, params = gpt
    specs = model.partition_specs()
    loss_fn = model.loss_fn
    if pipelined:
        loss_fn = PipelineLayer(model.embed, model.stage, model.head_loss)
        params, specs = model.pipeline_params(params), model.pipeline_params(specs)
    step = fleetjax.make_train_step(loss_fn, optax.adam(1e-2), strategy, mesh, param_specs=specs)
    state = step.init(params)
    out = []
    for batch in batches:
        state, metrics = step(state, batch)
        out.append(float(metrics["loss"]))
    return np.array(out)


@pytest.fixture(scope="module")
def reference(gpt, batches):
    """The loss curve with everything on one device."""
    one = fleetjax.build_mesh(dp=1, devices=jax.devices()[:1])
    return losses(gpt, batches, fleetjax.DistributedStrategy(), one)


def hybrid(dp, sharding, mp, stage):
    return fleetjax.DistributedStrategy(
        sharding=sharding > 1,
        sharding_configs={"sharding_degree": sharding, "stage": stage},
        hybrid_configs={"dp_degree": dp, "sharding_degree": sharding, "mp_degree": mp},
    )


FACTORISATIONS = [
    (dp, sharding, 8 // (dp * sharding))
    for dp, sharding in itertools.product((1, 2, 4, 8), repeat=2)
    if 8 % (dp * sharding) == 0
]
QUICK = {(2, 2, 2), (1, 1, 8)}
# Without a sharding axis the stage means nothing (sharding is off), so those run once.
GRID = [
    pytest.param(*f, stage, marks=() if f in QUICK and stage == 3 else pytest.mark.slow)
    for f in FACTORISATIONS
    for stage in ((1, 2, 3) if f[1] > 1 else (3,))
]


@pytest.mark.parametrize(("dp", "sharding", "mp", "stage"), GRID)
def test_every_factorisation_has_one_devices_loss_curve(
    gpt, batches, reference, dp, sharding, mp, stage
):
    got = losses(gpt, batches, hybrid(dp, sharding, mp, stage))
    np.testing.assert_allclose(got, reference, rtol=2e-6)


@pytest.mark.parametrize("mp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=lambda k: k.name)
def test_tensor_parallel_on_both_axis_types(gpt, batches, reference, mp, kind):
    mesh = fleetjax.build_mesh(dp=8 // mp, mp=mp, axis_types=kind)
    strategy = fleetjax.DistributedStrategy(
        tensor_parallel=True, tensor_parallel_configs={"tensor_parallel_degree": mp}
    )
    np.testing.assert_allclose(losses(gpt, batches, strategy, mesh), reference, rtol=2e-6)


def pipelined(**hybrid_configs):
    return fleetjax.DistributedStrategy(
        pipeline=True,
        pipeline_configs={"accumulate_steps": 2, "micro_batch_size": 2},
        hybrid_configs={"pp_degree": 2, **hybrid_configs},
    )


@pytest.mark.parametrize(
    "kind",
    [AxisType.Auto, pytest.param(AxisType.Explicit, marks=pytest.mark.slow)],
    ids=lambda k: k.name,
)
def test_dp2_pp2_mp2_trains_like_one_device(gpt, batches, reference, kind):
    mesh = fleetjax.build_mesh(dp=2, pp=2, mp=2, axis_types=kind)
    got = losses(gpt, batches, pipelined(dp_degree=2, mp_degree=2), mesh, pipelined=True)
    np.testing.assert_allclose(got, reference, rtol=2e-6)


# 19 s: under -m slow for the default suite's time (test_auto compiles ZeRO-3 x pp x mp by
# default, and test_pipeline_step trains ZeRO under a pipeline)
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])  # 3 gathers too
def test_pipeline_with_zero_and_mp(gpt, batches, reference, stage):
    """Stage 3 splits the embedding table over sharding and mp (XLA aborted partitioning its
    lookup inside the pipeline until the pipeline gathered it first)."""
    strategy = pipelined(sharding_degree=2, mp_degree=2)
    strategy.sharding = True
    strategy.sharding_configs = {"sharding_degree": 2, "stage": stage}
    got = losses(gpt, batches, strategy, pipelined=True)
    np.testing.assert_allclose(got, reference, rtol=2e-6)


# 29 s: under -m slow for the default suite's time; by default test_pipeline_step's float16
# loss scaling through the head and test_pipeline's loss scaling check the loss scale's path.
@pytest.mark.slow
@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit], ids=lambda k: k.name)
def test_amp_with_tensor_and_pipeline_parallel(gpt, batches, kind):
    """fp16 with dynamic loss scaling: the same curve as AMP on one device (the loss scale
    travels into the pipeline's last stage)."""
    amp = {"amp": True, "amp_configs": {"use_dynamic_loss_scaling": True}}
    one = fleetjax.build_mesh(dp=1, devices=jax.devices()[:1])
    expected = losses(gpt, batches, fleetjax.DistributedStrategy(**amp), one)
    strategy = pipelined(dp_degree=2, mp_degree=2)
    strategy.amp, strategy.amp_configs = True, amp["amp_configs"]
    mesh = fleetjax.build_mesh(dp=2, pp=2, mp=2, axis_types=kind)
    got = losses(gpt, batches, strategy, mesh, pipelined=True)
    np.testing.assert_allclose(got, expected, rtol=2e-3)
    assert np.all(np.diff(got) < 0)
