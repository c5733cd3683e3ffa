"""Paddle's dygraph loop on the fleet (`loss = loss_layer(dp_model(x), y); loss.backward();
opt.step(); opt.clear_grad()`, and `opt.minimize(loss)`): the same losses, parameters and
compiled step as `make_train_step` of the same model and loss; any other computation on a
deferred value is an error that names the function form."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleetjax
from fleetjax import nn, optimizers
from fleetjax.fleet import DeferredLoss, DistributedModel
from fleetjax.nn import DeferredError

SHARDED = fleetjax.DistributedStrategy(
    sharding=True, sharding_configs={"stage": 2, "sharding_degree": 4}
)


class MLP(nnx.Module):
    def __init__(self) -> None:
        self.l1 = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
        self.l2 = nnx.Linear(8, 3, rngs=nnx.Rngs(1))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(jax.nn.relu(self.l1(x)))


def data(count=4, rows=16):
    rng = np.random.RandomState(0)
    return [
        (rng.randn(rows, 4).astype(np.float32), rng.randint(0, 3, (rows,)).astype(np.int64))
        for _ in range(count)
    ]


def functional(layer, strategy, batches):
    """make_train_step's step for `layer(model(x), y)`: its losses, last parameters, step."""
    graphdef, params = nnx.split(MLP())

    def loss_fn(params, batch):
        return layer(nnx.merge(graphdef, params)(batch["x"]), batch["y"])

    step = fleetjax.make_train_step(loss_fn, optimizers.adam(0.01), strategy)
    state, losses = step.init(params), []
    for x, y in batches:
        state, metrics = step(state, {"x": x, "y": y})
        losses.append(float(metrics["loss"]))
    return losses, state.params, step


SOURCE_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def hlo(step, state, batch):
    """The compiled module's instructions, without metadata and source tables."""
    blocks = step.lower(state, batch).compile().as_text().split("\n\n")
    text = "\n\n".join(b for b in blocks if not b.startswith(SOURCE_TABLES))
    return re.sub(r", metadata=\{[^}]*\}", "", text)


def test_the_dygraph_loop_is_make_train_steps_step(fresh_fleet):
    """backward + step + clear_grad, minimize after backward, minimize alone: the losses and
    parameters of the functional step, and the same compiled HLO (ZeRO-2 over 4 devices)."""
    f = fresh_fleet.init(strategy=SHARDED)
    adam = f.distributed_optimizer(optimizers.Adam(learning_rate=0.01))
    dp_model = f.distributed_model(MLP())
    assert isinstance(dp_model, DistributedModel) and dp_model.l1.kernel.shape == (4, 8)
    loss_fn = nn.CrossEntropyLoss()
    batches = data()
    expected, expected_params, step = functional(loss_fn, SHARDED, batches)

    losses = []
    for i, (x, y) in enumerate(batches):
        loss = loss_fn(dp_model(x), y)
        assert isinstance(loss, DeferredLoss)
        if i == 0:  # read before the step: the forward alone
            before = loss.item()
        if i < 3:
            loss.backward()
        if i < 2:
            adam.step()
        else:  # after backward: applies its gradients; alone: computes them too
            adam.minimize(loss)
        adam.clear_grad()
        losses.append(loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert before == pytest.approx(expected[0], rel=1e-6)
    params = nnx.state(dp_model.module, nnx.Param)
    expected_params = nnx.to_pure_dict(expected_params)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(params), expected_params)
    assert f.trainer.loss_fn == loss.loss_fn and int(f.trainer.state.step) == 4

    x, y = batches[0]
    trained = f.trainer.program
    compiled = hlo(trained, trained.abstract_state, loss.batch)
    assert compiled == hlo(step, step.abstract_state, {"x": x, "y": y})
    assert " all-reduce(" in compiled  # the gradients, reduced over the 8 devices


def test_loss_layers_made_anew_each_step_reuse_the_compiled_step(fresh_fleet):
    f = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    adam = f.distributed_optimizer(optimizers.sgd(0.1))
    dp_model = f.distributed_model(MLP())
    trainers = []
    for x, y in data(2):
        nn.CrossEntropyLoss()(dp_model(x), y).backward()
        adam.step()
        adam.clear_grad()
        trainers.append(f.trainer)
    assert trainers[0] is trainers[1]
    assert nn.CrossEntropyLoss() == nn.CrossEntropyLoss() != nn.CrossEntropyLoss(axis=0)


def test_paddles_rules_for_held_gradients(fresh_fleet):
    f = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    adam = f.distributed_optimizer(optimizers.sgd(0.1))
    dp_model = f.distributed_model(MLP())
    (x, y), *_ = data(1)
    loss = nn.CrossEntropyLoss()(dp_model(x), y)
    loss.backward()
    with pytest.raises(RuntimeError, match=r"call clear_grad\(\) first \(Paddle would add"):
        nn.CrossEntropyLoss()(dp_model(x), y).backward()
    adam.step()
    with pytest.raises(RuntimeError, match=r"step\(\) already applied the gradients"):
        adam.step()
    adam.clear_grad()
    output = dp_model(x)
    adam.minimize(nn.CrossEntropyLoss()(dp_model(x), y))
    with pytest.raises(RuntimeError, match=r"was made before the last 1 step\(s\): its value"):
        output.numpy()
    with pytest.raises(ValueError, match=r"loss.backward\(\) needs one number, but "):
        nn.CrossEntropyLoss(reduction="none")(dp_model(x), y).backward()
    with pytest.raises(TypeError, match=r"minimize\(\) got a ArrayImpl: a loss computed"):
        adam.minimize(jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"minimize\(loss_fn, batch\) needs the batch"):
        adam.minimize(lambda model, batch: 0.0)
    with pytest.raises(TypeError, match=r"is a int: a distributed model's call"):
        dp_model(x, 3)
    stale = nn.CrossEntropyLoss()(dp_model(x), y)
    f.distributed_model(MLP())
    with pytest.raises(RuntimeError, match=r"of a model that a later fleet.init\(\) or"):
        stale.backward()


@pytest.mark.parametrize(
    "compute",
    [
        lambda out, y: out - y,
        lambda out, y: jnp.mean((out - y) ** 2),
        lambda out, y: jnp.mean(out),
        lambda out, y: optax.softmax_cross_entropy_with_integer_labels(out, y).mean(),
        lambda out, y: np.mean(out),
        lambda out, y: out.mean(),
        lambda out, y: out[:, 0],
        lambda out, y: float(nn.CrossEntropyLoss()(out, y)) + 0,  # reading a value is allowed
        lambda out, y: nn.CrossEntropyLoss()(out, y) * 2,
        lambda out, y: nn.MSELoss()(nn.CrossEntropyLoss()(out, y), y),
        lambda out, y: nn.MSELoss()(y, out),
    ],
)
def test_any_other_computation_names_the_function_form(fresh_fleet, compute):
    f = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    f.distributed_optimizer(optimizers.sgd(0.1))
    dp_model = f.distributed_model(MLP())
    (x, y), *_ = data(1)
    try:
        result = compute(dp_model(x), y)
    except DeferredError as e:
        assert "`def loss_fn(model, batch): return ...`" in str(e)
        assert "optimizer.minimize(loss_fn, batch)" in str(e)
        return
    assert isinstance(result, float)  # only reading a value goes through


def test_outputs_shape_and_values_without_a_step(fresh_fleet):
    f = fresh_fleet.init(strategy=fleetjax.DistributedStrategy())
    f.distributed_optimizer(optimizers.sgd(0.1))
    model = MLP()
    dp_model = f.distributed_model(model)
    (x, _), *_ = data(1)
    out = dp_model(x)
    assert (out.shape, out.dtype) == ((16, 3), jnp.float32)
    np.testing.assert_allclose(out.numpy(), model(x), rtol=1e-6)
    assert dp_model.module is model and repr(dp_model) == "DistributedModel(MLP)"


# -- the loss layers: Paddle's formulas (its unit tests' numpy references) -----------------------


def test_paddles_documented_values():
    # Paddle's docstring examples of BCEWithLogitsLoss and binary_cross_entropy
    bce_logits = nn.BCEWithLogitsLoss()(np.array([5.0, 1.0, 3.0]), np.array([1.0, 0.0, 1.0]))
    assert float(bce_logits) == pytest.approx(0.45618808, rel=1e-6)
    bce = nn.BCELoss()(np.array([0.5, 0.6, 0.7]), np.array([1.0, 0.0, 1.0]))
    assert float(bce) == pytest.approx(0.65537095, rel=1e-6)
    assert float(nn.BCELoss(reduction="sum")(np.array([0.0]), np.array([1.0]))) == 100.0  # clip
    with pytest.raises(ValueError, match=r"'reduction' in MSELoss should be 'sum', 'mean' or"):
        nn.MSELoss(reduction="avg")


def np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("ignore_index", [-100, 1])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_and_nll_hard_labels(ignore_index, weighted, reduction):
    rng = np.random.RandomState(0)
    logits = rng.randn(6, 4)
    label = np.array([0, 1, 2, 3, 1, 2])
    weight = rng.rand(4) if weighted else None
    w = (weight[label] if weighted else np.ones(6)) * (label != ignore_index)
    per_row = -np_log_softmax(logits)[np.arange(6), label] * w
    if reduction == "sum":
        expected = per_row.sum()
    elif reduction == "none":
        expected = per_row
    elif weighted:
        expected = per_row.sum() / w.sum()
    elif ignore_index >= 0:  # Paddle: only then are ignored rows left out of the count
        expected = per_row.sum() / (label != ignore_index).sum()
    else:
        expected = per_row.mean()
    kwargs = {"weight": weight, "ignore_index": ignore_index, "reduction": reduction}
    got = nn.CrossEntropyLoss(**kwargs)(logits, label)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    column = nn.CrossEntropyLoss(**kwargs)(logits, label[:, None])  # [N, 1] labels
    np.testing.assert_allclose(
        column, expected if reduction != "none" else expected[:, None], rtol=1e-6
    )
    nll = nn.NLLLoss(**kwargs)(np_log_softmax(logits), label)
    if reduction == "mean":  # NLLLoss divides by the weights of the rows not ignored
        expected = per_row.sum() / w.sum()
    np.testing.assert_allclose(nll, expected, rtol=1e-6)


def test_cross_entropy_soft_labels_and_smoothing():
    rng = np.random.RandomState(1)
    logits, weight = rng.randn(5, 3), rng.rand(3)
    soft = rng.rand(5, 3)
    soft /= soft.sum(-1, keepdims=True)
    per_row = -(soft * np_log_softmax(logits)).sum(-1)
    got = nn.CrossEntropyLoss(soft_label=True, reduction="none")(logits, soft)
    np.testing.assert_allclose(got, per_row[:, None], rtol=1e-6)
    weighted = nn.CrossEntropyLoss(soft_label=True, weight=weight)(logits, soft)
    expected = (per_row * (soft @ weight)).sum() / (soft @ weight).sum()
    np.testing.assert_allclose(weighted, expected, rtol=1e-6)
    label = np.array([0, 2, 1, 1, 0])
    smoothed = np.eye(3)[label] * 0.9 + 0.1 / 3
    expected = -(smoothed * np_log_softmax(logits)).sum(-1).mean()
    got = nn.CrossEntropyLoss(label_smoothing=0.1)(logits, label)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    probs = np.exp(np_log_softmax(logits))
    np.testing.assert_allclose(
        nn.CrossEntropyLoss(use_softmax=False)(probs, label),
        nn.CrossEntropyLoss()(logits, label),
        rtol=1e-6,
    )


def test_binary_cross_entropies_match_paddles_references():
    rng = np.random.RandomState(2)
    logit, label = rng.randn(4, 5), rng.randint(0, 2, (4, 5)).astype(np.float64)
    pos_weight, weight = rng.rand(5), rng.rand(4, 5)
    # Paddle's test_bce_with_logits_loss.calc_bce_with_logits_loss
    log_term = np.log(1 + np.exp(-np.abs(logit))) * ((pos_weight - 1) * label + 1)
    expected = weight * (np.maximum(logit, 0) - logit * label + log_term)
    got = nn.BCEWithLogitsLoss(weight=weight, pos_weight=pos_weight, reduction="none")
    np.testing.assert_allclose(got(logit, label), expected, rtol=1e-6)
    p = 1 / (1 + np.exp(-logit))
    bce = -weight * (label * np.log(p) + (1 - label) * np.log(1 - p))
    np.testing.assert_allclose(nn.BCELoss(weight=weight)(p, label), bce.mean(), rtol=1e-6)
    l1 = nn.L1Loss(reduction="sum")(p, label)
    np.testing.assert_allclose(l1, np.abs(p - label).sum(), rtol=1e-6)
