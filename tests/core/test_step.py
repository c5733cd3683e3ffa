"""make_train_step: data parallel on 8 devices equals plain optax on one; what XLA compiled."""

import dataclasses
import math
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo import collectives
from jax.sharding import PartitionSpec

import fleetjax
from fleetjax.mesh import build_mesh


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def loss_with_aux(params, batch):
    loss = loss_fn(params, batch)
    return loss, {"twice": 2 * loss}


def make_params(seed=0):
    rng = np.random.RandomState(seed)
    return {
        "w1": rng.randn(16, 32).astype(np.float32) / 4,
        "b1": np.zeros(32, np.float32),
        "w2": rng.randn(32, 4).astype(np.float32) / 6,
    }


def make_batch(seed=1, rows=64):
    rng = np.random.RandomState(seed)
    return {"x": rng.randn(rows, 16).astype(np.float32), "y": rng.randn(rows, 4).astype(np.float32)}


def reference(params, batches, tx):
    """Plain optax on one device, the whole batch at once."""
    device = jax.devices()[0]
    params = jax.device_put(params, device)
    opt_state, losses = tx.init(params), []
    for batch in batches:
        loss, grads = jax.value_and_grad(loss_fn)(params, jax.device_put(batch, device))
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return params, losses


@pytest.mark.parametrize(
    "tx", [optax.sgd(0.1, momentum=0.9), optax.adamw(1e-2)], ids=["sgd", "adamw"]
)
def test_eight_devices_equal_one(tx):
    batches = [make_batch(seed) for seed in range(4)]
    step = fleetjax.make_train_step(loss_fn, tx)
    state = step.init(make_params())
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    expected_params, expected_losses = reference(make_params(), batches, tx)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    chex.assert_trees_all_close(state.params, expected_params, rtol=1e-5, atol=1e-6)
    assert int(state.step) == 4


def test_placement_and_compiled_all_reduce():
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    state = step.init(make_params())
    batch = step.shard_batch(make_batch())
    assert batch["x"].sharding.spec == PartitionSpec(("dp", "sharding"))
    assert {s.data.shape for s in batch["x"].addressable_shards} == {(8, 16)}
    assert state.params["w1"].sharding.is_fully_replicated
    found = collectives(step.lower(state, batch).compile().as_text())
    assert found, "XLA inserted no collective"
    assert {(c.op, c.group_size) for c in found} == {("all-reduce", 8)}
    assert "f32[32,16]" in "".join(c.shape for c in found)  # the w1 gradient


def test_per_device_argument_bytes():
    """Each device holds all parameters and optimizer state, and 1/8 of the batch."""
    tx = optax.adam(1e-3)
    step = fleetjax.make_train_step(loss_fn, tx)
    state = step.init(make_params())
    batch = make_batch(rows=256)
    memory = step.lower(state, batch).compile().memory_analysis()
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))  # noqa: E731
    state_bytes = nbytes(jax.device_get(state))
    assert memory.argument_size_in_bytes == state_bytes + nbytes(batch) // 8


def test_state_is_donated():
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    state = step.init(make_params())
    new_state, _ = step(state, make_batch())
    assert state.params["w1"].is_deleted()
    assert not new_state.params["w1"].is_deleted()


def test_aux_metrics():
    step = fleetjax.make_train_step(loss_with_aux, optax.sgd(0.1), has_aux=True)
    _, metrics = step(step.init(make_params()), make_batch())
    assert set(metrics) == {"loss", "twice"}
    np.testing.assert_allclose(metrics["twice"], 2 * metrics["loss"], rtol=1e-6)


def test_a_fresh_key_each_step():
    def loss(params, batch, rng):
        return loss_fn(params, batch), {"noise": jax.random.uniform(rng)}

    step = fleetjax.make_train_step(loss, optax.sgd(0.1), has_aux=True, has_rng=True)
    state = step.init(make_params(), seed=3)
    noises = []
    for _ in range(3):
        state, metrics = step(state, make_batch())
        noises.append(float(metrics["noise"]))
    expected = [
        float(jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(3), i))) for i in range(3)
    ]
    assert noises == expected
    assert len(set(noises)) == 3


def test_device_arrays_as_batches():
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    state = step.init(make_params())
    batch = make_batch()
    state, m1 = step(state, jax.device_put(batch, step.batch_sharding))
    state, m2 = step(state, jax.device_put(batch, jax.devices()[3]))  # resharded by the step
    assert float(m2["loss"]) < float(m1["loss"])


def test_batch_that_does_not_split():
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    state = step.init(make_params())
    with pytest.raises(ValueError, match=(
        r"batch\['x'\] has 60 rows, which do not split evenly over the 8 data-parallel "
        r"devices \(dp=8 x sharding=1\)"
    )):  # fmt: skip
        step(state, make_batch(rows=60))
    with pytest.raises(ValueError, match=r"batch\['lr'\] is a scalar"):
        step(state, {**make_batch(), "lr": 0.1})


def test_data_axes_are_dp_and_sharding():
    mesh = build_mesh(dp=4, sharding=2)
    tx = optax.sgd(0.1)
    step = fleetjax.make_train_step(loss_fn, tx, mesh=mesh)
    _, metrics = step(step.init(make_params()), make_batch())
    assert step.shard_batch(make_batch())["x"].sharding.shard_shape((64, 16)) == (8, 16)
    _, expected = reference(make_params(), [make_batch()], tx)
    np.testing.assert_allclose(float(metrics["loss"]), expected[0], rtol=1e-6)


def test_model_axis_in_the_mesh_replicates_the_batch_over_it():
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), mesh=build_mesh(dp=2, mp=4))
    assert step.shard_batch(make_batch())["x"].sharding.shard_shape((64, 16)) == (32, 16)


def test_mesh_must_fit_the_strategy():
    s = fleetjax.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 8}
    with pytest.raises(ValueError, match="asks for dp degree 8, but the mesh's dp axis has size 4"):
        fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s, mesh=build_mesh(dp=4, mp=2))
    other = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    with pytest.raises(ValueError, match=r"mesh axes \['data'\] are not fleetjax axes"):
        fleetjax.make_train_step(loss_fn, optax.sgd(0.1), mesh=other)


def test_strategy_and_mesh_come_from_the_distributed_optimizer():
    s = fleetjax.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 8, "order": ["pp", "sharding", "mp", "dp"]}
    opt = fleetjax.distributed_optimizer(optax.sgd(0.1), s)
    step = fleetjax.make_train_step(loss_fn, opt)
    assert step.strategy == s
    assert step.mesh.axis_names == ("pp", "sharding", "mp", "dp")


def test_auto_parallel_strategy_is_accepted():
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), fleetjax.Strategy())
    _, metrics = step(step.init(make_params()), make_batch())
    assert math.isfinite(float(metrics["loss"]))


class TestNothingIsSilentlyIgnored:
    @pytest.mark.parametrize(
        ("setting", "message"),
        [
            ({"asp": True}, "DistributedStrategy.asp=True: 2:4 structured sparsity"),
            ({"qat": True}, "DistributedStrategy.qat=True: quantization-aware training"),
            ({"semi_auto": True}, "DistributedStrategy.semi_auto=True: semi-automatic"),
            (
                {"auto_search": True},
                r"^DistributedStrategy.auto_search=True: fleetjax's automatic parallel search is a "
                r"call, which needs the parameters and an example batch: found = "
                r"fleetjax.auto.search\(loss_fn, optimizer, params, batch, strategy=strategy\) ",
            ),
            ({"gradient_scale_configs": {"scale_strategy": "sum"}}, "scale_strategy='sum'"),
        ],
    )
    def test_features_not_built_yet_raise(self, setting, message):
        s = fleetjax.DistributedStrategy(setting)
        with pytest.raises(NotImplementedError, match=message):
            fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)

    def test_a_model_axis_with_nothing_split_over_it(self):
        s = fleetjax.DistributedStrategy(hybrid_configs={"mp_degree": 2})
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
        with pytest.raises(ValueError, match="an mp axis of size 2, but no parameter is split"):
            step.init(make_params())

    def test_a_fused_pass_without_enable_warns_as_paddle_ignores_it(self):
        s = fleetjax.Strategy({"fused_passes": {"gemm_epilogue": True}})
        with pytest.warns(fleetjax.StrategyWarning, match="only with fused_passes.enable=True"):
            fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)

    def test_merge_of_one_step_is_plain_training(self):
        s = fleetjax.DistributedStrategy(gradient_merge=True)  # k_steps=1, as in Paddle
        assert s.gradient_merge_configs.k_steps == 1
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)  # no warning, no error
        batches = [make_batch(seed) for seed in range(3)]
        state, losses = step.init(make_params()), []
        for batch in batches:  # the optimizer steps on every call
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        expected_params, expected_losses = reference(make_params(), batches, optax.sgd(0.1))
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        chex.assert_trees_all_close(state.params, expected_params, rtol=1e-5, atol=1e-6)

    def test_performance_knobs_warn_once(self):
        s = fleetjax.DistributedStrategy(nccl_comm_num=2)
        with pytest.warns(
            fleetjax.StrategyWarning,
            match="nccl_comm_num=2 has no effect in fleetjax: the number of NCCL",
        ):
            fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)  # already warned

    def test_parameter_server_knobs_warn_with_the_reason(self):
        s = fleetjax.DistributedStrategy(a_sync_configs={"send_queue_size": 32})
        with pytest.warns(
            fleetjax.StrategyWarning,
            match="a_sync_configs.send_queue_size=32 has no effect.*communicator",
        ):
            fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)

    def test_asynchronous_parameter_server_training_runs_synchronously_and_says_why(self):
        s = fleetjax.DistributedStrategy()
        s.a_sync = True  # Paddle's async mode (the setter sets a_sync_configs.k_steps to 0)
        with pytest.warns(
            fleetjax.StrategyWarning,
            match="a_sync=True has no effect in fleetjax: asynchronous parameter-server "
            "training .* has no SPMD counterpart: every step runs synchronously",
        ):
            fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)

    def test_defaults_do_not_warn(self):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fleetjax.make_train_step(loss_fn, optax.sgd(0.1), fleetjax.DistributedStrategy())
            fleetjax.make_train_step(loss_fn, optax.sgd(0.1), fleetjax.Strategy())


class TestSeveralStepsPerCall:
    """`TrainStep.run`: execution_strategy.num_iteration_per_run steps in one compiled scan."""

    @pytest.mark.parametrize(
        "fields",
        [
            {},
            {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
            {"amp": True},
            {"sharding": True, "sharding_configs": {"sharding_degree": 8, "stage": 3}},
        ],
        ids=["dp", "merge", "amp", "zero3"],
    )
    def test_a_run_of_k_equals_k_steps(self, fields):
        strategy = fleetjax.DistributedStrategy(
            execution_strategy={"num_iteration_per_run": 4}, **fields
        )
        step = fleetjax.make_train_step(loss_fn, optax.adam(1e-2), strategy)
        batches = [make_batch(seed) for seed in range(4)]
        one_by_one, losses = step.init(make_params()), []
        for batch in batches:
            one_by_one, metrics = step(one_by_one, batch)
            losses.append(metrics["loss"])
        at_once, metrics = step.run(step.init(make_params()), batches)
        np.testing.assert_allclose(metrics["loss"], losses, rtol=1e-6)
        chex.assert_trees_all_close(at_once, one_by_one, rtol=1e-6, atol=1e-7)
        assert metrics["loss"].shape == (4,)

    def test_the_steps_are_one_compiled_loop(self):
        strategy = fleetjax.DistributedStrategy(execution_strategy={"num_iteration_per_run": 2})
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), strategy)
        state = step.init(make_params())
        step.run(state, [make_batch(), make_batch()])
        compiled = step.compiled(state, 2)
        hlo = compiled.lower(state, [step.shard_batch(make_batch())] * 2).compile().as_text()
        assert " while(" in hlo

    def test_the_number_of_batches_is_the_strategys(self):
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), fleetjax.DistributedStrategy())
        with pytest.raises(
            ValueError, match=r"run\(\) got 2 batches, but .*num_iteration_per_run=3"
        ):
            step.run(step.init(make_params()), [make_batch(), make_batch()])
        auto = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), fleetjax.Strategy())
        _, metrics = auto.run(auto.init(make_params()), [make_batch(), make_batch()])
        assert metrics["loss"].shape == (2,)
        with pytest.raises(ValueError, match=r"run\(\) got no batches"):
            auto.run(auto.init(make_params()), [])

    def test_batches_of_different_shapes_are_named(self):
        # Was jnp.stack's error from inside the scan's trace.
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), fleetjax.Strategy())
        short = {name: x[:8] for name, x in make_batch().items()}
        with pytest.raises(ValueError, match=r"^run\(\) stacks its batches into one scan, so they "
                           r"must have the same leaves, shapes and dtypes, but batch 1 has "
                           r"batch\['x'\] float32\[8, \d+\], "):  # fmt: skip
            step.run(step.init(make_params()), [make_batch(), short])


# -- the step as a pure function of its spec -----------------------------------------------------


def test_the_step_is_a_pure_function_of_its_spec():
    step = fleetjax.make_train_step(loss_fn, optax.adamw(1e-2))
    state, batch = step.init(make_params()), make_batch()
    spec = step.spec(state)
    assert isinstance(spec, fleetjax.StepSpec) and spec.placement is step.placement
    assert spec.optimizer is step.optimizer and spec.tables is None
    pure = jax.jit(lambda s, b: fleetjax.step.train_step(spec, s, b))
    expected, expected_metrics = pure(state, step.shard_batch(batch))
    new, metrics = step(state, batch)
    chex.assert_trees_all_close(new, expected)
    np.testing.assert_allclose(metrics["loss"], expected_metrics["loss"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.plan = None


def test_the_placement_does_not_depend_on_the_order_of_calls():
    """A step's placement is its parameters', whatever order `init`, `abstract_init` and
    `lower` ran in; each state shape has its own spec and compiled step, and a step that made
    states of two shapes has no one placement (an error says what to use instead)."""
    small, large = make_params(), {**make_params(), "w1": np.zeros((16, 64), np.float32)}
    large["b1"], large["w2"] = np.zeros(64, np.float32), np.zeros((64, 4), np.float32)
    batch = make_batch()
    other = fleetjax.make_train_step(loss_fn, optax.sgd(0.1)).abstract_init(large)

    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    state = step.init(small)
    placement, compiled = step.placement, step.compiled(state)
    step.lower(other, batch)  # another shape: its own spec, the step's state unchanged
    assert step.placement is placement and step.compiled(state) is compiled
    assert step.spec(other) is not step.spec(state)
    state, _ = step(state, batch)
    assert step.compiled(state) is compiled
    step.abstract_init(small)  # the same shape again: the same spec
    assert step.placement is placement

    lowered_first = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    lowered_first.lower(other, batch)
    with pytest.raises(ValueError, match=r"call step.init\(params\) or step.abstract_init"):
        _ = lowered_first.placement
    lowered_first.init(small)
    assert lowered_first.placement.params == placement.params

    for first, second in [(small, large), (large, small)]:
        both = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
        both.abstract_init(first)
        made = both.init(second)
        with pytest.raises(ValueError, match=r"made states of 2 shapes .* step.spec\(state\)"):
            _ = both.placement
        assert both.spec(made).placement.params == (
            placement.params if second is small else step.spec(other).placement.params
        )
