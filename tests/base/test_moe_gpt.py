"""The example GPT with a mixture of experts (examples/gpt.py, ``GPTConfig.num_experts``): it
reports each layer's load, trains under ``ep`` as on one layout, and its checkpoints move
between EP sizes."""

import dataclasses
import pathlib
import sys

import jax
import numpy as np
import optax
import pytest

import fleetjax
from fleetjax.checkpoint import CheckpointManager
from fleetjax.plan import mesh_for, read_plan

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
from gpt import GPTConfig, make_gpt

EXPERTS, TOP_K, LAYERS = 8, 2, 2
CONFIG = GPTConfig(
    vocab_size=64,
    max_position_embeddings=8,
    hidden_size=16,
    num_attention_heads=4,
    num_hidden_layers=LAYERS,
    intermediate_size=32,
    initializer_range=0.2,
    num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    moe_bias_update_rate=0.01,
    moe_aux_loss_coeff=0.01,
)
# Paddle's order of its examples with expert parallelism: all eight names.
EP_ORDER = ["sharding", "moe_sharding", "pp", "sep", "cp", "dp", "ep", "mp"]
# The layouts of 8 devices by ep (Paddle's fold: ep x moe_sharding = sharding x mp).
LAYOUTS = {
    8: {"order": EP_ORDER, "sharding_degree": 8, "ep_degree": 8},
    4: {"order": EP_ORDER, "sharding_degree": 8, "ep_degree": 4, "moe_sharding_degree": 2},
    2: {"order": EP_ORDER, "sharding_degree": 8, "ep_degree": 2, "moe_sharding_degree": 4},
    1: {"dp_degree": 8},
}


@pytest.fixture(scope="module")
def gpt():
    return make_gpt(CONFIG)


@pytest.fixture(scope="module")
def batch():
    return {"tokens": jax.random.randint(jax.random.key(1), (16, 9), 0, CONFIG.vocab_size)}


def make_step(gpt, ep):
    strategy = fleetjax.DistributedStrategy()
    strategy.hybrid_configs = LAYOUTS[ep]
    model, _ = gpt
    mesh = mesh_for(read_plan(strategy))
    return fleetjax.make_train_step(
        model.loss_fn,
        optax.adam(1e-2),
        strategy,
        mesh,
        param_specs=model.partition_specs(mesh=mesh),
        has_aux=model.has_aux,
        has_state=model.has_state,
    )


def init(gpt, ep):
    model, params = gpt
    step = make_step(gpt, ep)
    return step, step.init(params, model_state=model.model_state())


def first_call(gpt, batch):
    """The loss, metrics and load of the MoE GPT's loss at its first state."""
    model, params = gpt
    loss, metrics, state = jax.jit(model.loss_fn)(params, model.model_state(), batch)
    return loss, metrics, model.moe_load(state)


@pytest.mark.slow  # 10 s, and 20 s to build the MoE GPT
def test_the_loss_reports_each_layers_load(gpt, batch):
    model, _ = gpt
    assert model.has_aux and model.has_state
    _, metrics, load = first_call(gpt, batch)
    tokens = batch["tokens"].shape[0] * (batch["tokens"].shape[1] - 1)
    np.testing.assert_array_equal(load.tokens_per_expert.sum(axis=1), [tokens * TOP_K] * LAYERS)
    counts = np.asarray(load.tokens_per_expert)
    np.testing.assert_allclose(
        load.max_violation, counts.max(axis=1) / counts.mean(axis=1) - 1, rtol=1e-6
    )
    np.testing.assert_array_equal(load.dropped, [0] * LAYERS)  # dropless
    assert np.all(np.asarray(load.aux_loss) > 0)
    names = ("max_violation", "dropped", "rounds", "aux_loss")
    assert set(metrics) == {f"moe/blocks/{i}/{n}" for i in range(LAYERS) for n in names}
    with pytest.raises(ValueError, match="moe_aux_loss_coeff=0.01: the pipeline cut"):
        model.pipeline_layer()


@pytest.mark.slow
def test_the_loss_is_the_language_models_plus_the_aux_losses(gpt, batch):
    model, params = gpt
    loss, _, load = first_call(gpt, batch)
    no_aux, _ = make_gpt(dataclasses.replace(CONFIG, moe_aux_loss_coeff=0.0))
    lm_loss, _, _ = jax.jit(no_aux.loss_fn)(params, model.model_state(), batch)
    np.testing.assert_allclose(loss, lm_loss + load.aux_loss.sum(), rtol=1e-6)
    no_aux.pipeline_layer()  # trains all it has


@pytest.mark.slow
def test_trains_under_ep_as_on_one_layout(gpt, batch):
    runs = {}
    for ep in (1, 8):
        step, state = init(gpt, ep)
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[ep] = losses, metrics, state
    np.testing.assert_allclose(runs[8][0], runs[1][0], rtol=1e-5)
    model, _ = gpt
    (_, metrics, state), (_, _, reference) = runs[8], runs[1]
    experts = state.params["blocks"]["moe"]["experts"]
    for leaf in jax.tree.leaves(experts):  # [layers, experts, ...]: each device its expert
        assert leaf.addressable_shards[0].data.shape[1] == EXPERTS // 8
    load, expected = model.moe_load(state.model_state), model.moe_load(reference.model_state)
    np.testing.assert_array_equal(load.tokens_per_expert, expected.tokens_per_expert)
    np.testing.assert_allclose(load.aux_loss, expected.aux_loss, rtol=1e-5)
    for layer in range(LAYERS):
        np.testing.assert_allclose(
            metrics[f"moe/blocks/{layer}/max_violation"], load.max_violation[layer], rtol=1e-6
        )
        assert metrics[f"moe/blocks/{layer}/dropped"] == 0
    bias = np.asarray(state.model_state["blocks"]["moe"]["gate"]["expert_bias"])
    assert np.any(bias != 0)  # balancing moved it


def host(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.mark.slow
def test_checkpoints_move_between_ep_sizes(gpt, batch, tmp_path):
    """Issue 32 item 6: saved at ep 8, restored at ep 4, 2 and 1, each saved again and restored
    back at ep 8: parameters, optimizer moments and model state bitwise, placed as the layout
    that restores them places them."""
    step, state = init(gpt, 8)
    for _ in range(2):  # moments that are not zero
        state, _ = step(state, batch)
    saved = host((state.params, state.opt_state, state.model_state))

    def restore(manager, target, at):
        restored, _ = manager.restore(target, step=at)
        for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
            assert got.sharding == want.sharding
        got = host((restored.params, restored.opt_state, restored.model_state))
        jax.tree.map(np.testing.assert_array_equal, got, saved)
        return restored

    with CheckpointManager(tmp_path) as manager:
        manager.save(8, state, force=True)
        manager.wait_until_finished()
        for number, ep in enumerate((4, 2, 1), start=9):  # checkpoint numbers only go up
            _, target = init(gpt, ep)
            assert manager.save(number, restore(manager, target, 8), force=True)
            manager.wait_until_finished()
            restore(manager, state, number)
