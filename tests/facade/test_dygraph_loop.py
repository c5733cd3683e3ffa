"""Paddle's dygraph loop on the fleet, as a Paddle user meets it: the messages point the way
(backward() twice shows gradient merge, which keeps the loop at one backward and one step per
batch; step() without backward() names loss.backward(); a batch that does not split names
the model's argument), a `DistributedModel` works with flax nnx's functions and has Paddle's
`parameters()`, `state_dict()` and `set_state_dict()`, and a loss goes from `fleet.minimize`
to the update through each module of the facade once."""

import inspect
import re

import jax
import numpy as np
import pytest
from flax import nnx

import fleetjax
from fleetjax import nn, optimizers


class MLP(nnx.Module):
    def __init__(self) -> None:
        self.l1 = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.bn = nnx.BatchNorm(8, rngs=nnx.Rngs(1))
        self.l2 = nnx.Linear(8, 3, rngs=nnx.Rngs(2))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(jax.nn.relu(self.bn(self.l1(x))))


def data(count, rows=16):
    rng = np.random.RandomState(0)
    return [
        (rng.randn(rows, 4).astype(np.float32), rng.randint(0, 3, (rows,)).astype(np.int64))
        for _ in range(count)
    ]


def params(model):
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def snippet(message: str) -> str:
    """The indented code block of an error message."""
    return "\n".join(line[4:] for line in message.splitlines() if line.startswith("    "))


def test_backward_twice_shows_gradient_merge_which_keeps_one_backward_and_step_per_batch(
    fresh_fleet,
):
    fleet = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    adam = fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01))
    dp_model = fleet.distributed_model(MLP())
    (x, y), *_ = data(1)
    nn.CrossEntropyLoss()(dp_model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"gradient_merge") as raised:
        nn.CrossEntropyLoss()(dp_model(x), y).backward()
    code = snippet(str(raised.value))
    assert "strategy.gradient_merge = True" in code

    # The snippet, run as it stands, and Paddle's loop of one backward() and step() per batch.
    strategy = fleetjax.DistributedStrategy()
    exec(code, {"strategy": strategy, "fleet": fleet})
    k = strategy.gradient_merge_configs.k_steps
    assert k > 1
    adam = fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01))
    dp_model = fleet.distributed_model(MLP())
    start, losses, seen = params(dp_model.module), [], []
    for x, y in data(k):
        loss = nn.CrossEntropyLoss()(dp_model(x), y)
        loss.backward()
        adam.step()
        adam.clear_grad()
        losses.append(loss.item())
        seen.append(params(dp_model.module))
    for before in seen[:-1]:  # the gradients are merged: the parameters wait for the k-th step
        jax.tree.map(np.testing.assert_array_equal, before, start)

    # The same as make_train_step's step under the strategy.
    graphdef, param_state, rest = nnx.split(
        fleetjax.distributed_model(MLP(), strategy, fleet.mesh), nnx.Param, ...
    )

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        out = nn.CrossEntropyLoss()(model(batch["x"]), batch["y"])
        return out, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))

    step = fleetjax.make_train_step(loss_fn, optimizers.adam(0.01), strategy, has_state=True)
    train_state = step.init(nnx.to_pure_dict(param_state), model_state=nnx.to_pure_dict(rest))
    expected = []
    for x, y in data(k):
        train_state, metrics = step(train_state, {"x": x, "y": y})
        expected.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6)  # noqa: E731
    jax.tree.map(close, seen[-1], jax.device_get(train_state.params))
    assert not np.array_equal(seen[-1]["l1"]["kernel"], start["l1"]["kernel"])


def test_step_without_backward_names_loss_backward(fresh_fleet):
    fleet = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    adam = fleet.distributed_optimizer(optimizers.sgd(0.1))
    dp_model = fleet.distributed_model(MLP())
    message = r"optimizer.step\(\) has no gradients to apply: call loss.backward\(\) first"
    with pytest.raises(RuntimeError, match=message):  # before any training
        adam.step()
    (x, y), *_ = data(1)
    nn.CrossEntropyLoss()(dp_model(x), y).backward()
    adam.step()
    adam.clear_grad()
    with pytest.raises(RuntimeError, match=message):  # after a batch, cleared
        adam.step()
    with pytest.raises(RuntimeError, match=message):  # on the fleet too
        fleet.step()


def test_a_batch_that_does_not_split_is_named_as_the_user_wrote_it(fresh_fleet):
    fleet = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    adam = fleet.distributed_optimizer(optimizers.sgd(0.1))
    dp_model = fleet.distributed_model(MLP())
    (x, y), *_ = data(1, rows=10)
    rows = r"has 10 rows, which do not split evenly over the 8 data-parallel devices"
    with pytest.raises(ValueError, match=rf"^the distributed model's argument 0 {rows}") as raised:
        nn.CrossEntropyLoss()(dp_model(x), y).backward()
    assert "batch[" not in str(raised.value)
    (x, _), *_ = data(1)
    # A label of other rows than the outputs: the loss layer names both, before the step.
    with pytest.raises(
        ValueError, match=r"^CrossEntropyLoss: input has shape \[16, 3\] and label \[10\]"
    ):
        adam.minimize(nn.CrossEntropyLoss()(dp_model(x), y))
    with pytest.raises(ValueError, match=rf"^the distributed model's argument 0 {rows}"):
        dp_model(x[:10]).numpy()  # the forward alone checks the rows too


def test_nnx_functions_see_the_module(fresh_fleet):
    fleet = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    dp_model = fleet.distributed_model(MLP())
    module = dp_model.module
    expected = nnx.state(module)
    assert nnx.state(dp_model) == expected
    graphdef, param_state, rest = nnx.split(dp_model, nnx.Param, ...)
    assert param_state == nnx.state(module, nnx.Param)

    copy = nnx.merge(graphdef, param_state, rest)  # the round trip: a module like it
    assert type(copy) is MLP and copy is not module
    x, _ = data(1)[0]
    copy.eval(), module.eval()
    np.testing.assert_allclose(copy(x), module(x), rtol=1e-6)

    doubled = jax.tree.map(lambda v: v * 2, param_state)
    nnx.update(dp_model, doubled)  # writes the module's variables
    np.testing.assert_array_equal(module.l1.kernel[...], doubled["l1"]["kernel"][...])


def test_paddles_parameters_state_dict_and_set_state_dict(fresh_fleet):
    fleet = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    adam = fleet.distributed_optimizer(optimizers.sgd(0.1))
    dp_model = fleet.distributed_model(MLP())
    module = dp_model.module
    parameters = dp_model.parameters()
    assert len(parameters) == 6 and all(isinstance(p, nnx.Param) for p in parameters)
    assert parameters[0] is module.bn.bias  # nnx.state's order; the module's own variables

    saved = jax.device_get(dp_model.state_dict())
    layers = {
        "l1": ("kernel", "bias"),
        "bn": ("scale", "bias", "mean", "var"),
        "l2": ("kernel", "bias"),
    }
    assert set(saved) == {f"{layer}.{name}" for layer, names in layers.items() for name in names}
    batches = data(3)
    for x, y in batches[:2]:
        adam.minimize(nn.CrossEntropyLoss()(dp_model(x), y))
    assert not np.array_equal(dp_model.state_dict()["l1.kernel"], saved["l1.kernel"])

    # Loaded after training: the next step trains on from the loaded values.
    dp_model.set_state_dict(saved)
    np.testing.assert_array_equal(module.l1.kernel[...], saved["l1.kernel"])
    x, y = batches[2]
    loss = nn.CrossEntropyLoss()(dp_model(x), y)
    loaded = loss.item()  # the forward alone, on the module's loaded variables
    np.testing.assert_allclose(adam.minimize(loss), loaded, rtol=1e-6)  # the step's, on them too

    wrong = {**saved, "l1.kernel": np.zeros((3, 3), np.float32), "extra": np.zeros(1)}
    del wrong["l2.bias"]
    message = (
        r"'l2.bias' is missing; 'extra' is not in the model; 'l1.kernel' has shape \(3, 3\), "
        r"the model's is \(4, 8\)"
    )
    with pytest.raises(ValueError, match=message):
        dp_model.set_state_dict(wrong)


def test_a_loss_goes_from_fleet_minimize_to_the_update_through_each_module_once(
    fresh_fleet, monkeypatch
):
    """The modules of the Python frames between `fleet.minimize` and the train step, in call
    order: each appears in one run (the facade does not call back into a module it left)."""
    stacks = []
    call = fleetjax.TrainStep.__call__

    def recorded(self, state, batch):
        stacks.append([frame.frame.f_globals["__name__"] for frame in inspect.stack()])
        return call(self, state, batch)

    monkeypatch.setattr(fleetjax.TrainStep, "__call__", recorded)
    fleet = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    adam = fleet.distributed_optimizer(optimizers.sgd(0.1))
    dp_model = fleet.distributed_model(MLP())
    (x, y), *_ = data(1)
    fleet.minimize(nn.CrossEntropyLoss()(dp_model(x), y))  # a deferred loss
    fleet.minimize(lambda model, batch: nn.CrossEntropyLoss()(model(batch["x"]), batch["y"]),
                   {"x": x, "y": y})  # a loss function  # fmt: skip
    loss = nn.CrossEntropyLoss()(dp_model(x), y)
    loss.backward()
    adam.step()
    assert len(stacks) == 3
    for stack in stacks:
        modules = [name for name in reversed(stack) if name.startswith("fleetjax")]
        runs = [name for i, name in enumerate(modules) if i == 0 or modules[i - 1] != name]
        assert len(runs) == len(set(runs)), runs
        assert re.match(r"fleetjax\.fleet\._(fleet|loop)$", runs[0]), runs
