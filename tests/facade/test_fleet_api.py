"""The rest of Paddle's Fleet API: `distributed_model`, the stateful `Trainer` (minimize,
backward / step / clear_grad) against the functional step, the optimizer's state_dict and
learning rate, and what `applied_strategy` reports."""

import pathlib
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fleetjax
from fleetjax import StrategyWarning, applied_strategy, distributed_model, optimizers
from fleetjax.fleet import Trainer
from fleetjax.layers import BatchNorm, ColumnParallelLinear, RowParallelLinear, partition_specs
from fleetjax.mesh import batch_sharding
from fleetjax.plan import mesh_for, read_plan
from fleetjax.transforms.pipeline import PipelineParams

DS = fleetjax.DistributedStrategy


class MLP(nnx.Module):
    def __init__(self, width: int = 8, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.l1 = nnx.Linear(4, width, rngs=rngs)
        self.l2 = nnx.Linear(width, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(jnp.tanh(self.l1(x)))


class Megatron(nnx.Module):
    """A tensor-parallel MLP block with a BatchNorm."""

    def __init__(self) -> None:
        self.up = ColumnParallelLinear(
            64, 128, has_bias=True, gather_output=False, rngs=nnx.Rngs(0)
        )
        self.down = RowParallelLinear(128, 64, input_is_parallel=True, rngs=nnx.Rngs(1))
        self.norm = nnx.BatchNorm(64, momentum=0.8, epsilon=1e-3, rngs=nnx.Rngs(2))


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(count=4, rows=16, seed=0):
    rng = np.random.RandomState(seed)
    return [
        {"x": rng.randn(rows, 4).astype(np.float32), "y": rng.randn(rows, 1).astype(np.float32)}
        for _ in range(count)
    ]


def pure_params(model):
    return jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def functional_losses(strategy, optimizer, data, width=8):
    """The functional step on the same model's parameters: (losses, final params)."""
    graphdef, params = nnx.split(MLP(width), nnx.Param)
    step = fleetjax.make_train_step(
        lambda p, b: mse(nnx.merge(graphdef, p), b), optimizer, strategy
    )
    state, losses = step.init(nnx.to_pure_dict(params)), []
    for batch in data:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state.params


def spec_of(x):
    return x.sharding.spec


# -- distributed_model ---------------------------------------------------------------------------


ZERO3_MP = DS(
    sharding=True,
    sharding_configs={"stage": 3, "sharding_degree": 2},
    hybrid_configs={"dp_degree": 2, "sharding_degree": 2, "mp_degree": 2},
)


def test_places_an_nnx_model_as_the_step_places_its_parameters():
    mesh = mesh_for(read_plan(ZERO3_MP))
    model = Megatron()
    specs = nnx.to_pure_dict(partition_specs(nnx.state(model, nnx.Param)))
    step = fleetjax.make_train_step(
        lambda p, b: 0.0, optax.sgd(0.1), ZERO3_MP, mesh, param_specs=specs
    )
    expected = jax.tree.map(spec_of, step.init(pure_params(model)).params)

    assert distributed_model(model, ZERO3_MP, mesh) is model
    placed = jax.tree.map(spec_of, pure_params(model))
    assert placed == expected
    # Tensor parallel from the logical names, then ZeRO-3 over `sharding` on top.
    assert placed["up"] == {"bias": P("mp"), "weight": P("sharding", "mp")}
    assert placed["down"]["weight"] == P("mp", "sharding")


def test_places_batch_norm_statistics_as_the_step_places_its_model_state():
    """The drift case: ZeRO-3 splits large parameters over `sharding`; batch-norm statistics
    are model state, which the step places by their logical names and never splits by ZeRO's
    rule (a copy of the placement code in distributed_model split the large ones too)."""
    zero3 = DS(
        sharding=True, sharding_configs={"stage": 3, "sharding_degree": 8}, sync_batch_norm=True
    )
    mesh = mesh_for(read_plan(zero3))

    class Wide(nnx.Module):
        def __init__(self) -> None:
            self.linear = nnx.Linear(4, 8192, rngs=nnx.Rngs(0))
            self.norm = nnx.BatchNorm(8192, rngs=nnx.Rngs(1))

    model = distributed_model(Wide(), zero3, mesh)
    stats = nnx.to_pure_dict(nnx.state(model, nnx.BatchStat))
    step = fleetjax.make_train_step(
        lambda p, s, b: (0.0, s), optax.sgd(0.1), zero3, mesh, has_state=True
    )
    state = step.init(pure_params(model), model_state=jax.tree.map(jnp.copy, stats))
    same = lambda a, b: a.sharding.is_equivalent_to(b.sharding, a.ndim)  # noqa: E731
    assert all(jax.tree.leaves(jax.tree.map(same, stats, state.model_state)))
    assert stats["norm"]["mean"].sharding.is_fully_replicated  # 8192 statistics on every device
    assert jax.tree.map(spec_of, pure_params(model)) == jax.tree.map(spec_of, state.params)
    assert pure_params(model)["linear"]["kernel"].sharding.spec == P(None, "sharding")


def test_places_pytrees_and_linen_variables():
    strategy = DS(hybrid_configs={"dp_degree": 4, "mp_degree": 2})
    mesh = mesh_for(read_plan(strategy))
    params = distributed_model({"w": np.ones((4, 8), np.float32)}, strategy, mesh)
    assert params["w"].sharding.is_fully_replicated and params["w"].sharding.mesh == mesh

    class Dense(nn.Module):
        @nn.compact
        def __call__(self, x):
            init = nn.with_logical_partitioning(nn.initializers.ones, ("embed", "mlp"))
            return nn.Dense(8, kernel_init=init)(x)

    variables = Dense().init(jax.random.key(0), jnp.ones((1, 4)))
    placed = distributed_model(variables, strategy, mesh)
    kernel = placed["params"]["Dense_0"]["kernel"]
    assert isinstance(kernel, nn.LogicallyPartitioned) and kernel.names == ("embed", "mlp")
    assert kernel.value.sharding.spec == P(None, "mp")
    with pytest.raises(TypeError, match="param_specs is for pytrees of arrays"):
        distributed_model(MLP(), strategy, mesh, param_specs={})


def test_linen_batch_norm_cannot_follow_local_statistics():
    strategy, variables = DS(), {"params": {}, "batch_stats": {"mean": np.zeros(3, np.float32)}}
    with pytest.warns(StrategyWarning, match="cannot convert flax linen BatchNorm"):
        distributed_model(variables, strategy, mesh_for(read_plan(strategy)))


def run_norm(layer, mesh, x):
    """One training forward of `layer` on `x` split over the data axes."""
    graphdef, state = nnx.split(layer)

    def forward(state, x):
        layer = nnx.merge(graphdef, state)
        return layer(x), nnx.state(layer)

    with jax.set_mesh(mesh):
        y, state = jax.block_until_ready(
            jax.jit(forward)(state, jax.device_put(x, batch_sharding(mesh)))
        )
    nnx.update(layer, state)
    return np.asarray(y)


@pytest.mark.parametrize("sync", [True, False])
def test_nnx_batch_norm_becomes_fleetjax_batch_norm_honouring_sync_batch_norm(sync):
    strategy = DS(sync_batch_norm=sync)  # dp=8
    mesh = mesh_for(read_plan(strategy))
    model = Megatron()
    model.norm.scale[...] = jnp.arange(64.0) / 64 + 0.5
    model.norm.mean[...] = jnp.full(64, 0.25)
    original = nnx.clone(model.norm)

    distributed_model(model, strategy, mesh)
    norm = model.norm
    assert isinstance(norm, BatchNorm) and norm.sync is sync
    assert (norm.momentum, norm.epsilon, norm.groups) == (0.8, 1e-3, 1 if sync else 8)
    np.testing.assert_array_equal(norm.scale[...], original.scale[...])
    np.testing.assert_array_equal(norm.mean[...], np.full((norm.groups, 64), 0.25))

    x = np.random.RandomState(0).randn(16, 64).astype(np.float32) * 3 + 1
    y = run_norm(norm, mesh, x)
    if sync:  # what the nnx layer computes over the whole batch
        expected, expected_mean = np.asarray(original(x)), np.asarray(original.mean[...])[None]
    else:  # what it computes on each replica's 2 rows
        parts = [nnx.clone(original) for _ in range(8)]
        expected = np.concatenate(
            [np.asarray(p(x[2 * r : 2 * r + 2])) for r, p in enumerate(parts)]
        )
        expected_mean = np.stack([np.asarray(p.mean[...]) for p in parts])
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(norm.mean[...], expected_mean, rtol=1e-5, atol=1e-6)


def test_fleetjax_batch_norms_follow_the_strategy():
    mesh = mesh_for(read_plan(DS()))
    explicit_sync, local = BatchNorm(4, sync=True), BatchNorm(4, replicas=2)
    distributed_model(nnx.List([explicit_sync, local]), DS(), mesh)
    assert explicit_sync.sync and explicit_sync.groups == 1  # Paddle never converts back
    assert not local.sync and local.mean[...].shape == (8, 4)  # one row per replica
    distributed_model(nnx.List([local]), DS(sync_batch_norm=True), mesh)
    assert local.sync and local.groups == 1


def test_a_batch_norm_model_is_returned_converted():
    converted = distributed_model(
        nnx.BatchNorm(3, rngs=nnx.Rngs(0)), DS(), mesh_for(read_plan(DS()))
    )
    assert isinstance(converted, BatchNorm) and converted.groups == 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"axis_name": "batch"}, r"model.norm is an nnx.BatchNorm with axis_name='batch'"),
        ({"use_fast_variance": False}, r"model.norm is an nnx.BatchNorm with use_fast_variance"),
    ],
)
def test_batch_norms_that_cannot_be_converted(kwargs, message):
    model = Megatron()
    model.norm = nnx.BatchNorm(64, rngs=nnx.Rngs(0), **kwargs)
    with pytest.raises(ValueError, match=message):
        distributed_model(model, DS(), mesh_for(read_plan(DS())))


def test_pipeline_places_the_stacked_layers_over_pp():
    strategy = DS(pipeline=True, hybrid_configs={"pp_degree": 2})
    mesh = mesh_for(read_plan(strategy))
    parts = PipelineParams({"e": np.ones(4, np.float32)}, {"w": np.ones((4, 8, 8), np.float32)}, {})
    placed = distributed_model(parts, strategy, mesh)
    assert placed.layers["w"].sharding.spec == P("pp")  # layers split by stage
    with pytest.raises(TypeError, match="pass the model's PipelineParams"):
        distributed_model(MLP(), strategy, mesh)


# -- Trainer -------------------------------------------------------------------------------------

STRATEGIES = {
    "dp8": DS(),
    "gradient_merge": DS(gradient_merge=True, gradient_merge_configs={"k_steps": 2}),
    "zero2": DS(
        sharding=True,
        sharding_configs={"stage": 2, "sharding_degree": 2},
        hybrid_configs={"dp_degree": 4, "sharding_degree": 2},
    ),
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_minimize_equals_the_functional_step(name):
    strategy, data = STRATEGIES[name], batches()
    expected_losses, expected_params = functional_losses(strategy, optimizers.adam(0.01), data)
    model = MLP()
    trainer = Trainer(mse, model, fleetjax.distributed_optimizer(optimizers.adam(0.01), strategy))
    losses = [float(trainer.minimize(batch)) for batch in data]
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)
    # The nnx model holds the trained parameters, the same arrays as the state.
    jax.tree.map(np.testing.assert_array_equal, pure_params(model), jax.device_get(expected_params))
    assert trainer.model is model and model.l1.kernel[...] is trainer.params["l1"]["kernel"]


def test_backward_step_clear_grad():
    data = batches(2)
    expected, _ = functional_losses(DS(), optimizers.sgd(0.1), data)
    trainer = Trainer(mse, MLP(), optimizers.sgd(0.1))
    with pytest.raises(RuntimeError, match=r"no gradients to apply: call backward\(batch\) first"):
        trainer.step()
    losses = []
    for batch in data:
        trainer.backward(batch)
        losses.append(float(trainer.step()))
        with pytest.raises(RuntimeError, match="already applied"):
            trainer.step()
        with pytest.raises(RuntimeError, match=r"still held: call clear_grad\(\) first"):
            trainer.backward(batch)
        with pytest.raises(RuntimeError, match="still held"):
            trainer.minimize(batch)
        trainer.clear_grad()
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    # clear_grad drops gradients that step() did not apply.
    before = pure_params(trainer.model)
    trainer.backward(data[0])
    trainer.clear_grad()
    assert int(trainer.state.step) == 2
    jax.tree.map(np.testing.assert_array_equal, pure_params(trainer.model), before)


def test_batch_statistics_are_carried_from_step_to_step():
    class Normed(MLP):
        def __init__(self):
            super().__init__()
            self.norm = nnx.BatchNorm(1, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(super().__call__(x))

    data = batches(3)
    trainer = Trainer(mse, Normed(), optax.sgd(0.1))
    losses = [float(trainer.minimize(batch)) for batch in data]
    # By hand on one device: the statistics of each step feed the next.
    model = Normed()
    graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

    @jax.jit
    def step(params, stats, batch):
        def loss(p):
            net = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, stats))
            return mse(net, batch), nnx.state(net, nnx.BatchStat)

        (value, stats), grads = jax.value_and_grad(loss, has_aux=True)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), stats, value

    expected = []
    for batch in data:
        params, stats, value = step(params, stats, batch)
        expected.append(float(value))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    np.testing.assert_allclose(
        trainer.model.norm.mean[...], stats["norm"]["mean"][...], rtol=1e-5, atol=1e-7
    )
    assert np.abs(trainer.model.norm.mean[...]).max() > 0  # it did move


# -- optimizer state and learning rate -----------------------------------------------------------


def test_state_dict_is_a_nested_dict_that_loads_onto_another_strategy():
    data = batches(3)
    dp = Trainer(mse, MLP(width=1024), optimizers.adam(0.01))
    for batch in data[:2]:
        dp.minimize(batch)
    state_dict = dp.state_dict()
    moment = state_dict["0"]["inner_state"]["0"]["mu"]["l1"]["kernel"]
    assert isinstance(moment, jax.Array) and moment.shape == (4, 1024)

    zero1 = DS(sharding=True, sharding_configs={"stage": 1, "sharding_degree": 4},
               hybrid_configs={"dp_degree": 2, "sharding_degree": 4})  # fmt: skip
    sharded = Trainer(mse, dp.model, fleetjax.distributed_optimizer(optimizers.adam(0.01), zero1))
    sharded.set_state_dict(jax.tree.map(np.asarray, state_dict))  # numpy arrays load too
    loaded = sharded.state.opt_state[0].inner_state[0].mu["l1"]["kernel"]
    assert loaded.sharding.spec == P(None, "sharding")  # placed as ZeRO-1 places it
    np.testing.assert_array_equal(loaded, moment)

    expected = float(dp.minimize(data[2]))
    assert float(sharded.minimize(data[2])) == pytest.approx(expected, rel=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
        pure_params(sharded.model),
        pure_params(dp.model),
    )


def test_set_state_dict_names_what_does_not_fit():
    trainer = Trainer(mse, MLP(), optimizers.adam(0.01))
    good = trainer.state_dict()
    with pytest.raises(TypeError, match="state_dict must be a nested dict of arrays, got list"):
        trainer.set_state_dict([])
    bad = trainer.state_dict()
    del bad["0"]["inner_state"]["0"]["nu"]["l1"]["bias"]
    bad["0"]["inner_state"]["0"]["mu"]["l1"]["kernel"] = np.zeros((3, 3))
    bad["extra"] = np.zeros(2)
    with pytest.raises(ValueError) as error:
        trainer.set_state_dict(bad)
    message = str(error.value)
    assert "'0/inner_state/0/nu/l1/bias' is missing" in message
    assert "'extra' is not in the optimizer state" in message
    assert "'0/inner_state/0/mu/l1/kernel' has shape (3, 3), the optimizer state's is (4, 8)" in (
        message
    )
    merged = DS(gradient_merge=True, gradient_merge_configs={"k_steps": 2})
    other = Trainer(mse, MLP(), fleetjax.distributed_optimizer(optimizers.adam(0.01), merged))
    with pytest.raises(ValueError, match="'acc_grads/l1/bias' is missing"):
        other.set_state_dict(good)


def test_get_lr_set_lr():
    trainer = Trainer(mse, MLP(), optimizers.sgd(0.01))
    assert trainer.get_lr() == pytest.approx(0.01)
    for lr in [0.2, 0.3, 0.4, 0.5, 0.6]:  # Paddle's example
        trainer.set_lr(lr)
        assert trainer.get_lr() == pytest.approx(lr)
    # The next step uses it: p - 0.6 * grad.
    batch, before = batches(1)[0], pure_params(trainer.model)
    graphdef = nnx.graphdef(trainer.model)
    grads = jax.grad(lambda p: mse(nnx.merge(graphdef, p), batch))(before)
    trainer.minimize(batch)
    expected = jax.tree.map(lambda p, g: p - 0.6 * g, before, grads)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        pure_params(trainer.model),
        expected,
    )


def test_learning_rate_errors():
    with pytest.raises(ValueError, match="fleetjax.optimizers.sgd/momentum/adam/adamw"):
        Trainer(mse, MLP(), optax.adam(0.01)).get_lr()
    scheduled = Trainer(mse, MLP(), optimizers.sgd(optax.constant_schedule(0.05)))
    assert scheduled.get_lr() == pytest.approx(0.05)
    with pytest.raises(ValueError, match="cannot change a learning rate that follows a schedule"):
        scheduled.set_lr(0.1)
    with pytest.raises(TypeError, match="set_lr needs a number"):
        Trainer(mse, MLP(), optimizers.sgd(0.01)).set_lr("fast")


def test_per_replica_learning_rate_and_model():
    localsgd = DS(localsgd=True, localsgd_configs={"k_steps": 2})
    model = MLP()
    trainer = Trainer(mse, model, fleetjax.distributed_optimizer(optimizers.sgd(0.1), localsgd))
    assert trainer.get_lr() == pytest.approx(0.1)
    trainer.set_lr(0.05)
    assert trainer.get_lr() == pytest.approx(0.05)
    trainer.minimize(batches(1)[0])
    # Each replica has its own parameters; the model holds replica 0's.
    assert trainer.params["l1"]["kernel"].shape == (8, 4, 8)
    np.testing.assert_array_equal(model.l1.kernel[...], trainer.params["l1"]["kernel"][0])


# -- the fleet's dygraph calls -------------------------------------------------------------------


def test_fleet_trains_the_distributed_model(fresh_fleet):
    f = fresh_fleet.init(strategy=DS())
    data = batches(3)
    with pytest.raises(RuntimeError, match=r"call fleet.distributed_optimizer\(optimizer\) first"):
        f.get_lr()
    with pytest.raises(
        RuntimeError, match=r"call fleet.distributed_model\(model\) before training"
    ):
        f.minimize(mse, data[0])
    model = f.distributed_model(MLP())
    f.distributed_optimizer(optimizers.sgd(0.1))
    expected, _ = functional_losses(DS(), optimizers.sgd(0.1), data[:2])
    assert float(f.minimize(mse, data[0])) == pytest.approx(expected[0], rel=1e-6)
    assert f.get_lr() == pytest.approx(0.1)
    f.set_state_dict(f.state_dict())
    f.backward(mse, data[1])
    assert float(f.step()) == pytest.approx(expected[1], rel=1e-6)
    f.clear_grad()
    assert f.trainer.model is model.module  # the DistributedModel's module, trained in place

    def mae(model, batch):  # another loss goes on from the same state
        return jnp.mean(jnp.abs(model(batch["x"]) - batch["y"]))

    f.minimize(mae, data[2])
    assert f.trainer.loss_fn is mae and int(f.trainer.state.step) == 3


def seed_004_batch(rows=16, seed=0):
    rng = np.random.RandomState(seed)
    return {"x": rng.randn(rows, 4).astype(np.float32), "y": rng.randn(rows, 1).astype(np.float32)}


def test_the_optimizer_does_seed_004s_calls_on_the_fleets_trainer(fresh_fleet):
    """Seed 004: `adam = fleet.distributed_optimizer(adam)`, then `adam.get_lr()`,
    `adam.set_lr(...)`, `adam.state_dict()` before training, then `loss.backward();
    adam.step(); adam.clear_grad()` and `adam.minimize(loss)`."""
    f = fresh_fleet.init(strategy=DS())
    adam = f.distributed_optimizer(optimizers.Adam(learning_rate=0.01))
    assert isinstance(adam, fleetjax.DistributedOptimizer) and adam.fleet is f
    model = f.distributed_model(MLP()).module
    assert adam.get_lr() == 0.01 and f.get_lr() == 0.01  # Paddle's print(lr): 0.01
    assert adam.state_dict() == {}  # Paddle's optimizer makes its state at the first step
    adam.set_state_dict({})
    for lr in [0.2, 0.3, 0.4, 0.5, 0.6]:  # Paddle's example prints exactly these
        adam.set_lr(lr)
        assert adam.get_lr() == lr
    adam.clear_grad()  # nothing to clear yet

    data = [seed_004_batch(seed=i) for i in range(3)]
    expected, expected_params = functional_losses(DS(), optimizers.adam(0.6), data)
    adam.backward(mse, data[0])
    losses = [float(adam.step())]
    adam.clear_grad()
    losses += [float(adam.minimize(mse, batch)) for batch in data[1:]]
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    jax.tree.map(np.testing.assert_array_equal, pure_params(model), jax.device_get(expected_params))
    assert adam.get_lr() == 0.6 and f.trainer.loss_fn is mse
    first = adam.state_dict()["0"]["inner_state"]["0"]["mu"]["l1"]["kernel"]
    assert first.shape == (4, 8) and np.abs(first).sum() > 0


def test_state_set_before_training_is_loaded_when_the_trainer_is_made(fresh_fleet):
    f = fresh_fleet.init(strategy=DS())
    data = seed_004_batch()
    trained = Trainer(mse, MLP(), optimizers.sgd(0.1))
    trained.minimize(data)
    saved = jax.device_get(trained.state_dict())
    opt = f.distributed_optimizer(optimizers.momentum(0.1))
    f.distributed_model(MLP())
    with pytest.raises(TypeError, match="state_dict must be a nested dict of arrays, got list"):
        opt.set_state_dict([])
    opt.set_state_dict(saved)  # an SGD's state: it does not fit the momentum's
    with pytest.raises(ValueError, match=r"state_dict does not fit this optimizer state"):
        opt.minimize(mse, data)
    opt = f.distributed_optimizer(optimizers.sgd(0.5))
    opt.set_state_dict(saved)  # the rate 0.1 comes with the state; set_lr goes on top
    opt.set_lr(0.3)
    opt.minimize(mse, data)
    assert opt.get_lr() == 0.3


def test_an_optimizer_a_later_call_replaced_refuses(fresh_fleet):
    f = fresh_fleet.init(strategy=DS())
    first = f.distributed_optimizer(optimizers.sgd(0.1))
    f.distributed_optimizer(optimizers.sgd(0.2))
    with pytest.raises(RuntimeError, match=r"replaced by a later fleet.distributed_optimizer"):
        first.get_lr()


def test_a_functional_distributed_optimizer_points_to_the_fleets():
    opt = fleetjax.distributed_optimizer(optimizers.sgd(0.1))
    with pytest.raises(AttributeError, match=r"has no step\(\): .* fleet.distributed_optimizer"):
        opt.step()
    with pytest.raises(AttributeError, match="'DistributedOptimizer' object has no attribute 'x'"):
        _ = opt.x


def test_learning_rate_calls_before_training_check_as_after(fresh_fleet):
    f = fresh_fleet.init(strategy=DS())
    with pytest.raises(RuntimeError, match=r"call fleet.distributed_optimizer\(optimizer\) first"):
        f.state_dict()
    f.distributed_optimizer(optimizers.sgd(optax.linear_schedule(0.5, 0.0, 10)))
    assert f.get_lr() == 0.5
    with pytest.raises(ValueError, match="cannot change a learning rate that follows a schedule"):
        f.set_lr(0.1)
    f.distributed_optimizer(optimizers.sgd(0.1))
    with pytest.raises(TypeError, match="set_lr needs a number"):
        f.set_lr("fast")
    f.distributed_optimizer(optax.sgd(0.1))
    with pytest.raises(ValueError, match="holds no injected learning rate"):
        f.get_lr()


def test_paddles_save_persistables_saves_the_fleets_trainer(fresh_fleet, tmp_path):
    f = fresh_fleet.init(strategy=DS())
    opt = f.distributed_optimizer(optimizers.adam(0.01))
    f.distributed_model(MLP())
    with pytest.raises(RuntimeError, match=r"save_persistables\(executor, dirname\) saves the"):
        f.save_persistables(None, tmp_path / "a")
    opt.minimize(mse, seed_004_batch())
    StrategyWarning.reset()
    with pytest.warns(StrategyWarning, match=r"executor= has no meaning in JAX") as record:
        f.save_persistables(object(), tmp_path / "a")
        f.save_persistables(executor=object(), dirname=tmp_path / "b", main_program=None)
    assert len(record) == 1
    state = f.trainer.state
    for name in ("a", "b"):
        restored = f.load_persistables(tmp_path / name, state)
        jax.tree.map(np.testing.assert_array_equal, restored, state)
    f.save_persistables(tmp_path / "c", {"w": jnp.ones(3)})  # fleetjax's form
    f.save_persistables(dirname=tmp_path / "d", state={"w": jnp.ones(3)})
    assert f.load_persistables(tmp_path / "d", {"w": jnp.zeros(3)})["w"].tolist() == [1.0] * 3


class Classifier(nnx.Module):
    def __init__(self) -> None:
        self.l1 = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.norm = nnx.BatchNorm(8, rngs=nnx.Rngs(1))
        self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(2))
        self.l2 = nnx.Linear(8, 1, rngs=nnx.Rngs(3))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.drop(jax.nn.relu(self.norm(self.l1(x)))))


def test_paddles_save_inference_model_exports_the_trained_model(fresh_fleet, tmp_path):
    f = fresh_fleet.init(strategy=DS(sync_batch_norm=True))
    opt = f.distributed_optimizer(optimizers.sgd(0.1))
    model = f.distributed_model(Classifier()).module
    batch = seed_004_batch()
    opt.minimize(mse, batch)
    opt.minimize(mse, batch)

    def predict(model, feeds):
        return model(feeds["x"])

    StrategyWarning.reset()
    with pytest.warns(StrategyWarning, match=r"main_program= has no meaning in JAX"):
        f.save_inference_model(None, tmp_path, ["x", "y"], [predict, mse], main_program="main")
    exported = f.load_inference_model(tmp_path)
    model.eval()  # Paddle's inference program: running statistics, no dropout
    expected = model(batch["x"][:8])[:5]  # (the fleet's model splits its rows over 8 devices)
    outputs = exported(batch["x"][:5], batch["y"][:5])  # any number of rows
    np.testing.assert_allclose(outputs[0], expected, rtol=1e-6)
    np.testing.assert_allclose(outputs[1], np.mean((expected - batch["y"][:5]) ** 2), rtol=1e-6)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        ((None, "d", ["z"], []), {}, ValueError, r"\['z'\] are not in the batch .* \['x', 'y'\]"),
        ((None, "d", "x", []), {}, TypeError, r"feeded_var_names must be a non-empty list"),
        ((None, "d", ["x"], ["out"]), {}, TypeError, r"target_vars must be a list of functions"),
        (
            (None, "d", ["x"], [mse]),
            {"export_for_deployment": False},
            ValueError,
            r"export_for_deployment must be True",
        ),
    ],
)
def test_paddles_save_inference_model_says_what_is_wrong(
    fresh_fleet, tmp_path, args, kwargs, error, message
):
    f = fresh_fleet.init(strategy=DS())
    opt = f.distributed_optimizer(optimizers.sgd(0.1))
    f.distributed_model(MLP())
    with pytest.raises(RuntimeError, match=r"the fleet has not trained yet"):
        f.save_inference_model(None, tmp_path, ["x"], [mse])
    opt.minimize(mse, seed_004_batch())
    with pytest.raises(error, match=message):
        f.save_inference_model(*args, **kwargs)


# -- applied_strategy and explain ----------------------------------------------------------------


def test_explain_reports_the_plan():
    strategy = DS(
        amp=True,
        recompute=True,
        recompute_configs={"checkpoints": ["hidden"]},
        gradient_merge=True,
        gradient_merge_configs={"k_steps": 4, "avg": False},
        sharding=True,
        sharding_configs={"stage": 2, "sharding_degree": 2, "optimize_offload": True},
        hybrid_configs={"mp_degree": 2},
        lars=True,
        sync_batch_norm=True,
    )
    report = applied_strategy(strategy)
    assert report.plan == read_plan(strategy)
    assert report.mesh == {"dp": -1, "sharding": 2, "pp": 1, "mp": 2}
    assert [s.feature for s in report.applied] == [
        "data parallel", "tensor parallel", "sharding", "amp", "recompute", "gradient merge",
        "optimizer", "steps per run", "sync batch norm",
    ]  # fmt: skip
    how = dict(report.applied)
    assert how["sharding"] == (
        "ZeRO stage 2 over sharding=2: optimizer state, gradients split; the optimizer state "
        "lives in pinned host memory"
    )
    assert how["gradient merge"] == (
        "k_steps=4, sum of the gradients; the optimizer steps once every 4 calls"
    )
    assert how["amp"].startswith("float16 O1, dynamic loss scaling from 32768 (x2 after 1000")
    assert how["recompute"].endswith("keeps ['hidden']")
    assert how["optimizer"].startswith("a Momentum is rebuilt as LARS momentum: lars_configs")
    text = str(report)
    assert (
        text.splitlines()[0] == "DistributedStrategy on a mesh dp=rest x sharding=2 x pp=1 x mp=2"
    )
    assert "XLA flags: none" in text and "no effect: none" in text


def test_docs_show_what_explain_prints():
    docs = (pathlib.Path(__file__).parents[2] / "docs" / "fleet.md").read_text()
    shown = docs.split("```text\n")[1].split("\n```")[0]
    strategy = DS(
        amp=True,
        gradient_merge=True,
        gradient_merge_configs={"k_steps": 4},
        sharding=True,
        sharding_configs={"stage": 2, "sharding_degree": 2},
        hybrid_configs={"dp_degree": 2, "sharding_degree": 2, "mp_degree": 2},
        nccl_comm_num=2,
        fuse_grad_size_in_MB=16,
    )
    with pytest.warns(StrategyWarning, match="nccl_comm_num=2 has no effect"):
        assert str(applied_strategy(strategy)) == shown


def test_explain_an_auto_parallel_strategy():
    strategy = fleetjax.Strategy(
        {
            "sharding": {"enable": True, "stage": 3, "degree": 2},
            "amp": {"enable": True, "dtype": "bfloat16", "level": "O2"},
            "pipeline": {"enable": True, "pp_degree": 2, "schedule_mode": "VPP", "vpp_degree": 2},
        }
    )
    how = dict(applied_strategy(strategy).applied)
    assert how["amp"] == "bfloat16 O2, no loss scaling"
    assert how["pipeline"] == "VPP over pp=2, micro_batch_size=1, accumulate_steps=1, vpp_degree=2"
    assert (
        how["sharding"]
        == "ZeRO stage 3 over sharding=2: optimizer state, gradients, parameters split"
    )


def test_explain_lists_the_xla_flags(every_flag_strategy):
    report = applied_strategy(every_flag_strategy)
    assert report.xla_flags == read_plan(every_flag_strategy).xla_flags
    lines = str(report).splitlines()
    assert any(
        "--xla_gpu_autotune_level=0" in line and line.endswith("cudnn_exhaustive_search=False")
        for line in lines
    )


def test_no_effect_lists_exactly_what_warns():
    strategy = DS(
        nccl_comm_num=2,
        elastic=True,
        fp16_allreduce=True,
        sharding=True,
        sharding_configs={"sharding_degree": 2},
        a_sync_configs={"k_steps": 4},
        build_strategy={"fuse_bn_add_act_ops": False},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = applied_strategy(strategy)
    warned = [str(w.message) for w in caught if issubclass(w.category, StrategyWarning)]
    assert len(report.ignored) == len(warned) == 5
    for knob, why in report.ignored:
        path = knob.split("=")[0]
        assert any(path in message and why in message for message in warned), knob
    assert ("nccl_comm_num=2", dict(report.ignored)["nccl_comm_num=2"]) in report.ignored


def test_fleet_applied_strategy(fresh_fleet, every_flag_strategy):
    every_flag_strategy.hybrid_configs = {"dp_degree": 4, "mp_degree": 2}
    every_flag_strategy.lars = True
    with pytest.warns(StrategyWarning, match="too late"):
        f = fresh_fleet.init(strategy=every_flag_strategy)
    f.distributed_optimizer(optimizers.momentum(0.1))
    report = f.applied_strategy()
    assert report.mesh == {"dp": 4, "sharding": 1, "pp": 1, "mp": 2}
    assert report.xla_flags == ()  # the backend had started: none is in effect
    asked = read_plan(every_flag_strategy).xla_flags
    gpu = [f for f in asked if f.name.startswith("xla_gpu_")]
    assert gpu and len(gpu) < len(asked)
    for flag in asked:  # on CPU devices XLA:GPU's flags do nothing, whenever they came
        expected = "no effect on this backend" if flag in gpu else f"{flag} is not in effect"
        assert (flag.knob, expected) in [(i.knob, i.why[: len(expected)]) for i in report.ignored]
    assert "Momentum(learning_rate=0.1" in dict(report.applied)["optimizer"]
    assert "became LarsMomentum(" in dict(report.applied)["optimizer"]
