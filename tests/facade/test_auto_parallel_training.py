"""Paddle 3's two canonical auto-parallel scripts (issue 31), as written but for the imports and
an nnx model, on 8 CPU devices: the semi-auto dygraph loop (`shard_tensor` weights,
`shard_dataloader`, `shard_optimizer` with a `ShardingStage`) and `to_static` with a
`Strategy`. Their losses equal one device's, and each other's step for step; ZeRO 1/2/3 over a
named mesh dimension, gradient accumulation, AMP through `shard_scaler` and the state dict's
Paddle names apply as asked, and what fleetjax cannot train says why."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleetjax as paddle
import fleetjax.distributed as dist
from fleetjax import amp

mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])


class MLP(paddle.nn.Layer):
    """Paddle's MLP of the canonical script: fc1 column-parallel, fc2 row-parallel."""

    def __init__(self, placed: bool = True) -> None:
        rngs = nnx.Rngs(0)
        self.fc1 = nnx.Linear(16, 256, rngs=rngs)
        self.fc2 = nnx.Linear(256, 16, rngs=rngs)
        if placed:
            self.fc1.kernel = dist.shard_tensor(
                self.fc1.kernel, mesh, [dist.Replicate(), dist.Shard(1)]
            )
            self.fc2.kernel = dist.shard_tensor(
                self.fc2.kernel, mesh, [dist.Replicate(), dist.Shard(0)]
            )

    def forward(self, x):
        return self.fc2(paddle.nn.functional.relu(self.fc1(x)))


def batches(count=4, rows=8):
    rng = np.random.default_rng(0)
    return [
        (
            rng.normal(size=(rows, 16)).astype("float32"),
            rng.normal(size=(rows, 16)).astype("float32"),
        )
        for _ in range(count)
    ]


def one_device(data, merge=1, learning_rate=0.001):
    """The losses of plain JAX on one device: AdamW on the mean squared error, the gradients of
    `merge` steps averaged into each update."""
    graph, params = nnx.split(MLP(placed=False), nnx.Param)
    opt = paddle.optimizers.AdamW(learning_rate=learning_rate)
    state = opt.init(params)

    @jax.jit
    def grads(params, x, y):
        return jax.value_and_grad(lambda p: jnp.mean((nnx.merge(graph, p)(x) - y) ** 2))(params)

    losses, held = [], []
    for x, y in data:
        loss, g = grads(params, x, y)
        losses.append(float(loss))
        held.append(g)
        if len(held) == merge:
            mean = jax.tree.map(lambda *gs: sum(gs) / merge, *held)
            updates, state = opt.update(mean, state, params)
            params, held = optax.apply_updates(params, updates), []
    return losses


def test_the_dygraph_script_as_written_trains_to_one_devices_losses():
    data = batches()
    model = MLP()
    loader = dist.shard_dataloader(data, meshes=mesh, shard_dims="dp")
    opt = dist.shard_optimizer(
        paddle.optimizers.AdamW(parameters=model.parameters()), dist.ShardingStage1("dp", mesh)
    )
    losses = []
    for x, y in loader():
        loss = paddle.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss.item())
    np.testing.assert_allclose(losses, one_device(data), rtol=1e-5)

    # The step's mesh is the ProcessMesh's devices, its dims named by role: dp is ZeRO's
    # (ShardingStage1 names it) and carries the batch, mp the weights' split.
    step = opt.trainer.train_step
    assert dict(step.mesh.shape) == {"sharding": 2, "mp": 2, "dp": 1, "pp": 1}
    assert step.plan.sharding_stage == 1
    assert list(step.mesh.devices.flat) == list(mesh.jax_mesh.devices.flat)
    # The trained weights read as the user placed them.
    assert model.fc1.kernel.placements == [dist.Replicate(), dist.Shard(1)]
    assert model.fc1.kernel.process_mesh == mesh
    assert model.fc2.kernel.placements == [dist.Replicate(), dist.Shard(0)]


def test_to_static_applies_the_strategy_and_gives_the_dygraph_loops_losses():
    data = batches()
    model = MLP()
    loader = dist.shard_dataloader(data, meshes=mesh, shard_dims="dp")
    opt = dist.shard_optimizer(
        paddle.optimizers.AdamW(parameters=model.parameters()), dist.ShardingStage1("dp", mesh)
    )
    strategy = dist.Strategy()
    strategy.sharding.enable = True
    strategy.sharding.stage = 2
    strategy.sharding.degree = 2
    strategy.gradient_merge.enable = True
    strategy.gradient_merge.k_steps = 4
    with pytest.warns(paddle.StrategyWarning, match="replaces the optimizer's ShardingStage1"):
        dm = dist.to_static(model, loader, paddle.nn.MSELoss(), opt, strategy=strategy)
    dm.train()
    losses = [float(dm(x, y)) for x, y in loader()]
    # Gradient merge in one call averages 4 micro-batches: the gradient of the whole batch.
    np.testing.assert_allclose(losses, one_device(data), rtol=1e-5)
    plan = dm.trainer.train_step.plan
    assert plan.sharding_stage == 2 and plan.gradient_merge.k_steps == 4

    x, y = data[0]
    dm.eval()
    value = float(dm(x, y))
    assert value == pytest.approx(float(paddle.nn.MSELoss()(model.forward(x), y)), rel=1e-5)
    dm.predict()
    out = dm(x)
    assert out.shape == (8, 16)
    np.testing.assert_allclose(out, model.forward(x), rtol=1e-5, atol=1e-6)


def test_dygraph_and_to_static_agree_step_for_step():
    data = batches()
    runs = []
    for static in (False, True):
        model = MLP()
        loader = dist.shard_dataloader(data, meshes=mesh, shard_dims="dp")
        opt = dist.shard_optimizer(
            paddle.optimizers.AdamW(learning_rate=0.01, parameters=model.parameters()),
            dist.ShardingStage2("dp", mesh),
        )
        if static:
            dm = dist.to_static(model, loader, paddle.nn.MSELoss(), opt)
            runs.append([float(dm(x, y)) for x, y in loader()])
            continue
        losses = []
        for x, y in loader():
            loss = paddle.nn.MSELoss()(model(x), y)
            loss.backward()
            opt.step()
            opt.clear_grad()
            losses.append(loss.item())
        runs.append(losses)
    assert runs[0] == runs[1]
    np.testing.assert_allclose(runs[0], one_device(data, learning_rate=0.01), rtol=1e-5)


def test_zero_3_and_shard_layer_split_the_parameters_over_the_named_dim_and_hook_the_input():
    data = batches(3)
    model = MLP(placed=False)

    def shard_fn(name, layer, process_mesh):
        if name in ("fc1", "fc2"):
            dim = 1 if name == "fc1" else 0
            placements = [dist.Replicate(), dist.Shard(dim)]
            layer.kernel = dist.shard_tensor(layer.kernel, process_mesh, placements)

    hooked = []

    def input_fn(inputs, process_mesh):  # a forward pre-hook: in the step, a constraint
        hooked.append(inputs[0].shape)
        return (dist.reshard(inputs[0], process_mesh, [dist.Shard(0), dist.Replicate()]),)

    dist.shard_layer(model, mesh, shard_fn, input_fn=input_fn)
    assert model.fc1.bias.placements == [dist.Replicate(), dist.Replicate()]
    opt = dist.shard_optimizer(
        paddle.optimizers.AdamW(parameters=model.parameters()), dist.ShardingStage3("dp")
    )
    losses = []
    for x, y in dist.shard_dataloader(data, mesh, shard_dims=0):
        loss = paddle.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss.item())
    np.testing.assert_allclose(losses, one_device(data), rtol=1e-5)
    assert hooked and all(shape == data[0][0].shape for shape in hooked), hooked
    # ZeRO-3 over dp: fc1's kernel [16, 64] is split over mp (dim 1) and dp (dim 0).
    assert model.fc1.kernel.placements == [dist.Shard(0), dist.Shard(1)]


def test_gradient_accumulation_averages_that_many_steps_into_one_update():
    data = batches(4)
    model = MLP()
    opt = dist.shard_optimizer(
        paddle.optimizers.AdamW(parameters=model.parameters()), gradient_accumulation_steps=2
    )
    losses = []
    for x, y in dist.shard_dataloader(data, mesh, shard_dims="dp"):
        loss = paddle.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(loss.item())
    np.testing.assert_allclose(losses, one_device(data, merge=2), rtol=1e-5)


def test_amp_through_shard_scaler_casts_and_scales_in_the_step():
    data = batches(3)
    model = MLP()
    opt = dist.shard_optimizer(paddle.optimizers.AdamW(parameters=model.parameters()))
    scaler = dist.shard_scaler(amp.GradScaler(init_loss_scaling=1024))
    losses = []
    for x, y in dist.shard_dataloader(data, mesh, shard_dims="dp"):
        with amp.auto_cast(level="O1", dtype="float16"):
            loss = paddle.nn.functional.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        losses.append(loss.item())
    plan = opt.trainer.train_step.plan
    assert plan.amp.loss_scaling.init_loss_scaling == 1024
    assert opt.trainer.metrics["loss_scale"] == 1024
    np.testing.assert_allclose(losses, one_device(data), rtol=3e-3)  # float16 matmuls
    with pytest.raises(TypeError, match="GradScaler"):
        dist.shard_scaler(object())


def test_the_state_dict_has_paddles_names_and_loads_back():
    data = batches(2)
    model = MLP()
    loader = dist.shard_dataloader(data, mesh, shard_dims="dp")
    opt = dist.shard_optimizer(paddle.optimizers.AdamW(parameters=model.parameters()))
    dm = dist.to_static(model, loader, paddle.nn.MSELoss(), opt)
    assert dm.state_dict("opt") == {}  # Paddle's optimizer makes its state at the first step
    dm(*data[0])
    saved = {k: np.asarray(v) for k, v in dm.state_dict().items()}
    assert set(dm.state_dict("param")) == {"fc1.kernel", "fc1.bias", "fc2.kernel", "fc2.bias"}
    opt_names = set(dm.state_dict("opt"))
    assert {"fc1.kernel_moment1_0", "fc1.kernel_moment2_0", "learning_rate_0"} <= opt_names
    assert {"fc1.kernel_beta1_pow_acc_0", "fc2.bias_beta2_pow_acc_0"} <= opt_names
    assert saved["fc1.kernel_beta1_pow_acc_0"] == pytest.approx([0.9])  # beta1 ** 1 step
    assert dm.state_dict("opt")["fc1.kernel_moment1_0"].placements == [
        dist.Replicate(),
        dist.Shard(1),
    ]
    second = float(dm(*data[1]))

    # A fresh model and DistModel load it before their first step, and go on alike.
    fresh = MLP()
    opt2 = dist.shard_optimizer(paddle.optimizers.AdamW(parameters=fresh.parameters()))
    dm2 = dist.to_static(fresh, loader, paddle.nn.MSELoss(), opt2)
    dm2.set_state_dict(saved)
    assert float(dm2(*data[1])) == pytest.approx(second, rel=1e-6)
    with pytest.raises(ValueError, match="'fc1.kernel_moment1_0' is missing"):
        dm2.set_state_dict({k: v for k, v in saved.items() if k != "fc1.kernel_moment1_0"})


def test_distmodel_modes_follow_paddles_defaults_and_messages():
    model = MLP()
    x, y = batches(1)[0]
    assert dist.to_static(model, None, paddle.nn.MSELoss())._mode == "eval"
    dm = dist.to_static(model, None)
    assert dm._mode == "predict"
    dm.train()
    with pytest.raises(ValueError, match="Please set optimizer and loss function"):
        dm(x, y)
    with pytest.raises(ValueError, match="state_dict's mode"):
        dm.state_dict("weights")


def test_a_dim_used_in_two_roles_is_an_error_naming_both():
    model = MLP()
    opt = dist.shard_optimizer(paddle.optimizers.AdamW(parameters=model.parameters()))
    x = dist.shard_tensor(batches(1)[0][0], mesh, [dist.Replicate(), dist.Shard(0)])
    with pytest.raises(ValueError, match=r"mesh dim 'mp' is used in two roles: mp .*fc\w+.kernel"):
        model(x)
    del opt


def test_layers_on_sub_meshes_are_refused_naming_split_spec():
    stages = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["pp", "dp"])
    model = MLP(placed=False)
    model.fc1.kernel = dist.shard_tensor(
        model.fc1.kernel, stages.get_mesh_with_dim("pp", 0), [dist.Replicate()]
    )
    model.fc2.kernel = dist.shard_tensor(
        model.fc2.kernel, stages.get_mesh_with_dim("pp", 1), [dist.Replicate()]
    )
    dist.shard_optimizer(paddle.optimizers.AdamW(parameters=model.parameters()))
    with pytest.raises(ValueError, match="split_spec"):
        model(batches(1)[0][0])


def test_bad_requests_are_clear_errors():
    model = MLP()
    with pytest.raises(ValueError, match="'sharding' is not a dimension"):
        dist.shard_optimizer(
            paddle.optimizers.AdamW(parameters=model.parameters()),
            dist.ShardingStage1("sharding", mesh),
        )
    with pytest.raises(TypeError, match="ShardingStage1/2/3"):
        dist.shard_optimizer(paddle.optimizers.AdamW(), lambda key, p, acc: acc)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        dist.shard_optimizer(paddle.optimizers.AdamW(), None, 0)
    with pytest.raises(ValueError, match="'x' is not a dimension"):
        dist.shard_dataloader([], mesh, shard_dims="x")
    with pytest.raises(ValueError, match="several meshes"):
        dist.shard_dataloader([], [mesh, mesh.get_mesh_with_dim("dp", 0)])
    with pytest.raises(ValueError, match="is not `dist.ProcessMesh` type"):
        dist.shard_layer(model, "mesh")
    opt = dist.shard_optimizer(paddle.optimizers.AdamW())  # no parameters: no layer
    with pytest.raises(RuntimeError, match="parameters=model.parameters()"):
        opt.step()


def test_a_layer_defines_forward_as_in_paddle():
    with pytest.raises(TypeError, match="defines __call__"):

        class Wrong(paddle.nn.Layer):
            def __call__(self, x):
                return x

    model = MLP(placed=False)
    x = batches(1)[0][0]
    assert isinstance(model(x), jax.Array)  # no optimizer trains it: the forward runs
    assert [n for n, _ in model.named_parameters()] == [
        "fc1.bias",
        "fc1.kernel",
        "fc2.bias",
        "fc2.kernel",
    ]
    assert [n for n, _ in model.named_sublayers()] == ["fc1", "fc2"]
