"""MoELayer's public surface: bad arguments are named before anything runs; a call's losses and
load reach the training loss and the step's metrics through `nnx.capture` and `moe_aux`;
Paddle's `gate.get_loss()`; the aux-loss-free bias as model state of a fleetjax step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from moe_models import D_MODEL, EXPERTS, HIDDEN, inputs, make_layer

import fleetjax
from fleetjax.layers import ExpertMLP, GShardGate, MoEAux, MoELayer, TopKRouter, moe_aux


def experts(count=EXPERTS, hidden=HIDDEN):
    rngs = nnx.Rngs(0)
    return [ExpertMLP(D_MODEL, hidden, rngs=rngs) for _ in range(count)]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: MoELayer(D_MODEL, [*experts(1), *experts(1, 32)], rngs=nnx.Rngs(0)),
         "experts of different shapes: experts[1]'s 'down' is float32[32, 8], experts[0]'s "
         "float32[16, 8]"),
        (lambda: MoELayer(D_MODEL, [*experts(1), nnx.Linear(D_MODEL, D_MODEL, rngs=nnx.Rngs(0))],
                          rngs=nnx.Rngs(0)),
         "experts[1] (Linear) does not have experts[0]'s structure (ExpertMLP)"),
        (lambda: MoELayer(D_MODEL, [nnx.BatchNorm(D_MODEL, rngs=nnx.Rngs(0))], rngs=nnx.Rngs(0)),
         "experts[0] holds BatchStat 'mean': experts must hold parameters (nnx.Param) only"),
        (lambda: MoELayer(D_MODEL, [], rngs=nnx.Rngs(0)), "experts must be a non-empty list"),
        (lambda: MoELayer(D_MODEL, experts(), {"type": "gshard", "top_k": 9}, rngs=nnx.Rngs(0)),
         "gate top_k=9 is more than the 8 experts"),
        (lambda: MoELayer(D_MODEL, experts(), {"type": "topk", "top_k": 9}, rngs=nnx.Rngs(0)),
         "gate top_k=9 is more than the 8 experts"),
        (lambda: MoELayer(D_MODEL, experts(), {"type": "sinkhorn"}, rngs=nnx.Rngs(0)),
         "gate['type'] must be one of ('naive', 'gshard', 'switch', 'topk') or None, got "
         "'sinkhorn'"),
        (lambda: MoELayer(D_MODEL, experts(), {"type": "naive", "capacity": 2}, rngs=nnx.Rngs(0)),
         "a 'naive' gate takes the keys 'type' and 'top_k' only, got ['capacity']"),
        (lambda: MoELayer(D_MODEL, experts(), {"type": "gshard", "top_k": 1}, rngs=nnx.Rngs(0)),
         "GShardGate: topk must be 2 (Paddle asserts it), got 1"),
        (lambda: MoELayer(D_MODEL, experts(), {"type": "naive"}), "needs rngs=nnx.Rngs(...)"),
        (lambda: MoELayer(D_MODEL, experts(), GShardGate(D_MODEL, 4, 1, rngs=nnx.Rngs(0))),
         "the gate routes to 4 experts (num_expert x world_size) but experts has 8"),
        (lambda: MoELayer(D_MODEL, experts(), moe_group=object(), rngs=nnx.Rngs(0)),
         "moe_group must be mesh axis names"),
        (lambda: MoELayer(D_MODEL, experts(), capacity_factor=0, rngs=nnx.Rngs(0)),
         "capacity_factor must be None (dropless) or a number > 0, got 0"),
        (lambda: MoELayer(D_MODEL, experts(), dispatcher="flex", rngs=nnx.Rngs(0)),
         "dispatcher must be one of ('alltoall', 'allgather'), got 'flex'"),
        (lambda: MoELayer(D_MODEL, experts(), drop_policy="random", rngs=nnx.Rngs(0)),
         "drop_policy must be one of ('probs', 'position'), got 'random'"),
        (lambda: MoELayer(D_MODEL, experts(), buffer=-0.5, rngs=nnx.Rngs(0)),
         "buffer must be a number >= 0, got -0.5"),
        (lambda: TopKRouter(D_MODEL, 8, 2, score_function="tanh", rngs=nnx.Rngs(0)),
         "score_function must be one of ('softmax', 'sigmoid'), got 'tanh'"),
        (lambda: TopKRouter(D_MODEL, 8, 2, num_groups=3, group_top_k=1, rngs=nnx.Rngs(0)),
         "group-limited routing needs num_groups dividing the experts"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(build, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        build()


def lower(layer, shape, mesh_shape, names):
    graphdef, state = nnx.split(layer)
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * len(names))
    with jax.set_mesh(mesh):
        forward = lambda s, x: nnx.merge(graphdef, s)(x)  # noqa: E731
        jax.jit(forward).lower(state, jnp.zeros(shape))  # traces only: nothing runs


def test_layouts_that_do_not_fit_are_named_when_traced():
    four = MoELayer(D_MODEL, experts(4), {"type": "naive"}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape("4 experts do not split over the expert "
                                                   "axes ep=8")):  # fmt: skip
        lower(four, (8, 4, D_MODEL), (8,), ("ep",))
    with pytest.raises(ValueError, match=re.escape("12 tokens do not split over the axes its "
                                                   "dispatch splits them over, ep=8")):  # fmt: skip
        lower(make_layer(), (3, 4, D_MODEL), (8,), ("ep",))


class TwoLayers(nnx.Module):
    def __init__(self):
        self.first, self.second = make_layer(), make_layer(seed=1)

    def __call__(self, x):
        return self.second(self.first(x))


def test_capture_and_moe_aux_reach_the_loss_and_metrics():
    model = TwoLayers()
    graphdef, state = nnx.split(model)
    x, _ = inputs()

    @jax.jit
    def forward(state, x):
        model = nnx.merge(graphdef, state)
        _, captured = nnx.capture(model, MoEAux)(x)
        return moe_aux(captured), captured

    (loss, metrics), captured = forward(state, x)
    stats = [captured[name]["stats"].get_value()[0] for name in ("first", "second")]
    np.testing.assert_allclose(loss, stats[0].loss + stats[1].loss, rtol=1e-6)
    assert sorted(metrics) == sorted(
        f"moe/{layer}/{name}"
        for layer in ("first", "second")
        for name in ("aux_loss", "seq_aux_loss", "z_loss", "max_violation", "dropped", "rounds")
    )
    counts = np.asarray(stats[0].tokens_per_expert)
    assert counts.sum() == x.shape[0] * x.shape[1] * 2
    np.testing.assert_allclose(metrics["moe/first/max_violation"], counts.max() / counts.mean() - 1)
    # Paddle's way: the gate's loss of its last call
    gate_loss = nnx.jit(lambda layer, x: (layer(x), layer.gate.get_loss())[1])
    np.testing.assert_allclose(gate_loss(model.first, x), stats[0].loss, rtol=1e-6)


def test_balancing_bias_is_model_state_of_a_fleetjax_step():
    rngs = nnx.Rngs(0)
    rate = 0.01
    gate = TopKRouter(D_MODEL, EXPERTS, 2, bias_update_rate=rate, aux_loss_coeff=0.01, rngs=rngs)
    layer = MoELayer(D_MODEL, experts(), gate)
    graphdef, params, state = nnx.split(layer, nnx.Param, ...)

    def loss_fn(params, model_state, batch):
        model = nnx.merge(graphdef, params, model_state)
        out, captured = nnx.capture(model, MoEAux)(batch["x"])
        aux_loss, metrics = moe_aux(captured)
        loss = jnp.mean((out - batch["y"]) ** 2) + aux_loss
        return loss, metrics, nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))

    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), has_aux=True, has_state=True)
    train = step.init(nnx.to_pure_dict(params), model_state=nnx.to_pure_dict(state))
    x, y = (v.reshape(8, 4, D_MODEL) for v in inputs())  # 8 rows: one a data-parallel device
    biases = []
    for _ in range(3):
        train, metrics = step(train, {"x": x, "y": y})
        biases.append(np.asarray(train.model_state["gate"]["expert_bias"]))
    assert {"moe/layer/aux_loss", "moe/layer/max_violation"} <= set(metrics)
    np.testing.assert_array_equal(biases[0], np.zeros(EXPERTS))  # no load seen before step 1
    steps = np.diff(biases, axis=0)
    assert np.all(np.isclose(np.abs(steps), rate) | (steps == 0)) and np.any(steps != 0)
