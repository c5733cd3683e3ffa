"""`dist.parallelize` on a Llama-shaped model (tests/tiny_llama.py) with Paddle's plans: it
trains on 8 CPU devices to one device's losses, and its compiled program holds the same
collectives (kinds, group sizes, bytes, counts) as the Fleet API's program of the same model
written with fleetjax's Megatron layers at the same degrees (`hybrid_configs` mp, sharding,
pp, sequence parallelism), read from the HLO XLA compiled: the two front ends cost the same.
A plan key or a `split_spec` that names nothing is an error naming it."""

import collections
import inspect

import jax
import numpy as np
import optax
import pytest
import tiny_llama
from flax import nnx
from jax.sharding import PartitionSpec
from tiny_llama import PLAN, SP_PLAN, Config, Llama, batches, loss_fn, pipeline_layer

import fleetjax
import fleetjax.distributed as dist
from fleetjax import nn, optimizers
from fleetjax.layers import partition_specs

RATE = 1e-2
FOUR_LAYERS = Config()


@pytest.fixture(autouse=True)
def _no_global_mesh():
    yield
    dist.set_mesh(None)


def collectives(text):
    """What a compiled program sends: (kind, devices per group, bytes) -> instructions."""
    return collections.Counter(
        (c.op, c.group_size, c.result_bytes) for c in fleetjax.hlo.collectives(text)
    )


def one_device(data, config=FOUR_LAYERS):
    graph, params = nnx.split(Llama(config), nnx.Param)
    opt = optimizers.AdamW(learning_rate=RATE)
    state = opt.init(params)

    @jax.jit
    def step(params, state, ids, labels):
        def loss(p):
            return nn.CrossEntropyLoss()(nnx.merge(graph, p)(ids), labels)

        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    losses = []
    for ids, labels in data:
        params, state, value = step(params, state, ids, labels)
        losses.append(float(value))
    return losses


def parallelized(data, mesh, config, model_config=FOUR_LAYERS):
    """Paddle's dygraph loop on the parallelized model: its losses and compiled program."""
    model = Llama(model_config)
    opt = optimizers.AdamW(learning_rate=RATE, parameters=model.parameters())
    model, opt = dist.parallelize(model, opt, mesh, config)
    losses = []
    for ids, labels in dist.shard_dataloader(data, mesh, shard_dims="dp"):
        loss = nn.CrossEntropyLoss()(model(ids), labels)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss.item())
    step, state = opt.trainer.train_step, opt.trainer.state
    batch = {"inputs": (data[0][0],), "keywords": {}, "label": data[0][1]}
    text = step.lower(state, batch).compile().as_text()
    return losses, text, fleetjax.explain(step, batch, show=False)


def fleet_program(data, strategy, mesh, sequence_parallel=False, layers=4):
    """The Fleet API's program: the model in fleetjax's Megatron layers, trained by
    `make_train_step` under `strategy` (a pipeline: the model cut by hand)."""
    model = Llama(Config(layers=layers, fleet=True, sequence_parallel=sequence_parallel))
    opt = fleetjax.distributed_optimizer(optimizers.AdamW(learning_rate=RATE), strategy, mesh)
    if strategy.pipeline:
        layer, params = pipeline_layer(model)

        def spec(m):
            return nnx.to_pure_dict(partition_specs(nnx.state(m, nnx.Param), mesh=mesh))

        stacked = jax.tree.map(
            lambda s: PartitionSpec(None, *s),
            spec(model.layers[0]),
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )
        specs = fleetjax.PipelineParams(
            spec(model.embed_tokens), stacked, spec(nnx.List([model.norm, model.lm_head]))
        )
        step = fleetjax.make_train_step(layer, opt, param_specs=specs)
        state = step.init(params)
    else:
        trainer = fleetjax.fleet.Trainer(loss_fn, model, opt)
        step, state = trainer.train_step, trainer.state
    losses = []
    for ids, labels in data:
        state, metrics = step(state, {"ids": ids, "labels": labels})
        losses.append(float(metrics["loss"]))
    batch = {"ids": data[0][0], "labels": data[0][1]}
    return losses, step.lower(state, batch).compile().as_text()


def hybrid(mp=1, sharding=1, pp=1, micro_batch_size=None):
    strategy = fleetjax.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": 1,
        "mp_degree": mp,
        "sharding_degree": sharding,
        "pp_degree": pp,
    }
    strategy.sharding = True
    strategy.sharding_configs = {"stage": 1}
    if pp > 1:
        strategy.pipeline = True
        strategy.pipeline_configs = {"micro_batch_size": micro_batch_size, "accumulate_steps": 1}
    return strategy


def test_tensor_parallel_and_zero_1_cost_what_the_fleet_api_costs():
    data, model = batches(2), Config(layers=2)
    mesh = dist.ProcessMesh(np.arange(8).reshape(4, 2), dim_names=["dp", "mp"])
    config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": PLAN}}
    losses, text, report = parallelized(data, mesh, config, model)
    np.testing.assert_allclose(losses, one_device(data, model), rtol=1e-5)
    fleet_losses, fleet_text = fleet_program(
        data, hybrid(mp=2, sharding=4), fleetjax.build_mesh(dp=1, sharding=4, mp=2), layers=2
    )
    np.testing.assert_allclose(losses, fleet_losses, rtol=1e-5)
    found = collectives(text)
    assert found == collectives(fleet_text)
    # Megatron's two all-reduces per block in the forward and two in the backward, over mp.
    assert found[("all-reduce", 2, 4096)] == 4 * 2
    explained(report, text)


def explained(report, text):
    """`explain` names each reshard of the program: its placement change over the user's
    mesh dims, and the operation and line of the user's code that needed it."""
    changes = {(r.op, r.change) for r in report.reshards}
    # Row-parallel partial sums over the user's 'mp'; ZeRO-1's gradients over the user's 'dp'.
    assert ("all-reduce", "Partial() -> Replicate() over mp") in changes
    assert ("all-reduce", "Partial() -> Replicate() over dp") in changes
    o_proj = next(
        i
        for i, line in enumerate(inspect.getsource(tiny_llama).splitlines(), 1)
        if "return self.o_proj(" in line
    )
    row = [r for r in report.reshards if r.source == f"tiny_llama.py:{o_proj} (Attention.__call__)"]
    assert {r.operation for r in row} >= {"dot_general"}  # o_proj's partial sums
    assert sum(r.count for r in report.reshards) == len(fleetjax.hlo.collectives(text))
    assert "reshards (what moves, for which operation):" in str(report)


@pytest.mark.slow
def test_sequence_parallel_costs_what_the_fleet_api_costs():
    data = batches(2)
    mesh = dist.ProcessMesh(np.arange(8).reshape(4, 2), dim_names=["dp", "mp"])
    config = {"dp_config": {"sharding_level": 1}, "mp_config": {"parallelize_plan": SP_PLAN}}
    losses, text, _ = parallelized(data, mesh, config)
    np.testing.assert_allclose(losses, one_device(data), rtol=1e-5)
    _, fleet_text = fleet_program(
        data,
        hybrid(mp=2, sharding=4),
        fleetjax.build_mesh(dp=1, sharding=4, mp=2),
        sequence_parallel=True,
    )
    assert collectives(text) == collectives(fleet_text)


@pytest.mark.slow
def test_a_split_spec_pipeline_costs_what_the_fleet_api_pipeline_costs():
    data = batches(2)
    mesh = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), dim_names=["pp", "dp", "mp"])
    config = {
        "dp_config": {"sharding_level": 1},
        "mp_config": {"parallelize_plan": PLAN},
        "pp_config": {"split_spec": "layers"},
    }
    losses, text, _ = parallelized(data, mesh, config)
    np.testing.assert_allclose(losses, one_device(data), rtol=1e-5)
    strategy = hybrid(mp=2, sharding=2, pp=2, micro_batch_size=4)
    fleet_losses, fleet_text = fleet_program(
        data, strategy, fleetjax.build_mesh(dp=1, sharding=2, pp=2, mp=2)
    )
    np.testing.assert_allclose(losses, fleet_losses, rtol=1e-5)
    found = collectives(text)
    assert found == collectives(fleet_text)
    assert any(op == "collective-permute" for op, _, _ in found)  # the stages' hops


def test_what_parallelize_cannot_place_is_named():
    mesh = dist.ProcessMesh(np.arange(8).reshape(4, 2), dim_names=["dp", "mp"])
    model = Llama(Config(layers=2))
    with pytest.raises(ValueError, match=r"key 'layers.\*.attn.qkv' matches no layer .*close"):
        dist.parallelize(
            model,
            config={"mp_config": {"parallelize_plan": {"layers.*.attn.qkv": None}}},
            mesh=mesh,
        )
    with pytest.raises(ValueError, match="mesh dim 'pp'"):
        dist.parallelize(model, config={"pp_config": {"split_spec": "layers"}}, mesh=mesh)
    staged = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), dim_names=["pp", "dp", "mp"])
    with pytest.raises(ValueError, match="split_spec='blocks' names no list of blocks"):
        dist.parallelize(model, config={"pp_config": {"split_spec": "blocks"}}, mesh=staged)
    split = {"layers.0": dist.SplitPoint.BEGINNING}  # a boundary before the first block
    with pytest.raises(ValueError, match=r"cuts layers's 2 blocks at \[0\]"):
        dist.parallelize(model, config={"pp_config": {"split_spec": split}}, mesh=staged)
    with pytest.raises(NotImplementedError, match="cp_config"):
        dist.parallelize(model, config={"cp_config": {}}, mesh=mesh)
    with pytest.raises(ValueError, match="config keys are"):
        dist.parallelize(model, config={"tp_config": {}}, mesh=mesh)
    with pytest.warns(UserWarning, match="do nothing"):
        assert dist.parallelize(model) == (model, None)
    no_mp = dist.ProcessMesh(np.arange(8), dim_names=["dp"])
    with pytest.raises(ValueError, match="mesh dim 'mp'"):
        dist.parallelize(model, mesh=no_mp, config={"mp_config": {"parallelize_plan": PLAN}})


def test_a_split_spec_dict_of_even_stage_boundaries_is_the_prefix():
    staged = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), dim_names=["pp", "dp", "mp"])
    model = Llama(Config(layers=4))
    split = {"layers.1": dist.SplitPoint.END}
    dist.parallelize(model, config={"pp_config": {"split_spec": split}}, mesh=staged)
