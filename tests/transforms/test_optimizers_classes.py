"""Paddle's optimizer classes (`SGD`, `Momentum`, `Adam`, `AdamW`) with Paddle's arguments: they
are the package's functions underneath, their gradient clips and `L2Decay` follow Paddle's
formulas, a strategy rebuilds them, and arguments without meaning warn or refuse."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_optimizers_basic import random_problem as problem
from test_optimizers_basic import run as run_with_state

import fleetjax
from fleetjax import StrategyWarning
from fleetjax import optimizers as opt

LARS = {"lars_coeff": 0.001, "lars_weight_decay": 0.0005, "epsilon": 0.0}


def run(tx, params, grads):
    return run_with_state(tx, params, grads)[0]


def paddle_momentum(params, grads, lr, mu, wd, clip):
    """Paddle's order: the clip (of all gradients of a step), the L2 decay, the momentum op."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    velocity = {k: np.zeros_like(v) for k, v in params.items()}
    for step_grads in grads:
        clipped = clip({k: g.astype(np.float64) for k, g in step_grads.items()})
        for k, g in clipped.items():
            velocity[k] = mu * velocity[k] + g + wd * params[k]
            params[k] = params[k] - lr * velocity[k]
    return params


def by_global_norm(clip_norm):
    def clip(grads):
        norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
        return {k: g * clip_norm / max(norm, clip_norm) for k, g in grads.items()}

    return clip


def by_value(low, high):
    return lambda grads: {k: np.clip(g, low, high) for k, g in grads.items()}


@pytest.mark.parametrize(
    ("cls_kwargs", "fn_kwargs"),
    [
        ({"weight_decay": opt.L2Decay(0.01)}, {"weight_decay": 0.01}),
        (
            {"weight_decay": 0.01, "grad_clip": opt.ClipGradByNorm(2.0)},
            {"weight_decay": 0.01, "clip_norm": 2.0},
        ),
        ({}, {}),
    ],
    ids=["l2decay", "float_decay_and_clip_by_norm", "defaults"],
)
@pytest.mark.parametrize(
    ("cls", "fn"),
    [(opt.SGD, opt.sgd), (opt.Momentum, opt.momentum), (opt.Adam, opt.adam)],
    ids=["SGD", "Momentum", "Adam"],
)
def test_a_class_is_its_function(cls, fn, cls_kwargs, fn_kwargs):
    made = cls(learning_rate=0.05, **cls_kwargs)
    assert isinstance(made, opt.PaddleOptimizer) and isinstance(made, cls)
    assert made.kind == cls.__name__
    assert made.hyperparams == fn(0.05, **fn_kwargs).hyperparams
    params, grads = problem()
    chex.assert_trees_all_close(run(made, params, grads), run(fn(0.05, **fn_kwargs), params, grads))


def test_adamw_is_adamw_with_decoupled_decay():
    made = opt.AdamW(learning_rate=0.01, weight_decay=0.1, grad_clip=opt.ClipGradByNorm(1.0))
    params, grads = problem()
    expected = run(opt.adamw(0.01, weight_decay=0.1, clip_norm=1.0), params, grads)
    chex.assert_trees_all_close(run(made, params, grads), expected)
    with pytest.raises(TypeError, match=r"AdamW weight_decay must be a float .* got L2Decay"):
        opt.AdamW(weight_decay=opt.L2Decay(0.1))


@pytest.mark.parametrize(
    ("grad_clip", "reference"),
    [
        (opt.ClipGradByGlobalNorm(clip_norm=1.5), by_global_norm(1.5)),
        (opt.ClipGradByValue(max=0.5), by_value(-0.5, 0.5)),
        (opt.ClipGradByValue(max=1.0, min=-0.25), by_value(-0.25, 1.0)),
    ],
    ids=["global_norm", "value", "value_with_min"],
)
def test_clips_come_before_the_l2_decay_as_in_paddle(grad_clip, reference):
    params, grads = problem()
    made = opt.Momentum(learning_rate=0.1, momentum=0.9, weight_decay=0.01, grad_clip=grad_clip)
    expected = paddle_momentum(params, grads, 0.1, 0.9, 0.01, reference)
    chex.assert_trees_all_close(run(made, params, grads), expected, rtol=1e-5, atol=1e-6)
    assert made.hyperparams["grad_clip"] == grad_clip
    assert opt.get_lr(made.init(params)) == pytest.approx(0.1)


def test_lars_keeps_the_users_clip_and_dgc_refuses_one_not_by_norm_as_paddle_does():
    clip = opt.ClipGradByValue(max=0.5)  # LARS is blind to a clip that only scales
    configs = {**LARS, "exclude_from_weight_decay": []}
    rebuilt = opt.rebuild(opt.Momentum(0.1, grad_clip=clip), "lars", configs, 1)
    assert rebuilt.kind == "LarsMomentum" and rebuilt.hyperparams["grad_clip"] == clip
    params, grads = problem()
    lars = opt.lars(0.1, 0.9, **LARS, exclude_from_weight_decay=[])
    expected = run(optax.chain(clip.transformation(), lars), params, grads)
    chex.assert_trees_all_close(run(rebuilt, params, grads), expected)
    dgc = {"rampup_begin_step": 0, "rampup_step": 1, "sparsity": [0.999]}
    global_norm = opt.ClipGradByGlobalNorm(1.0)
    with pytest.raises(TypeError, match=r"DGCMomentumOptimizer only supports ClipGradByNorm"):
        opt.rebuild(opt.Momentum(0.1, grad_clip=global_norm), "dgc", dgc, 8)


def test_a_class_trains_under_a_strategy_as_its_rebuild_on_one_device():
    strategy = fleetjax.DistributedStrategy(lars=True)
    user = opt.Momentum(learning_rate=0.1, grad_clip=opt.ClipGradByValue(max=0.5))
    optimizer = fleetjax.distributed_optimizer(user, strategy)
    assert optimizer.rebuilt.kind == "LarsMomentum"

    def loss(params, batch):
        return jnp.mean((batch @ params["w"] - 1.0) ** 2)

    step = fleetjax.make_train_step(loss, optimizer)
    params, batch = {"w": jnp.ones((4, 2))}, np.arange(32, dtype=np.float32).reshape(8, 4)
    state, _ = step(step.init(params), batch)
    lars = opt.lars(0.1, 0.9, **LARS, exclude_from_weight_decay=[])
    expected = run(
        optax.chain(optax.clip_by_global_norm(1.0), lars), params, [jax.grad(loss)(params, batch)]
    )
    chex.assert_trees_all_close(state.params, expected, rtol=1e-5)


def test_arguments_without_meaning_warn_once():
    StrategyWarning.reset()
    with pytest.warns(StrategyWarning, match=r"parameters= has no effect in fleetjax") as record:
        opt.Adam(parameters=[np.zeros(3)])
        opt.SGD(parameters=[np.zeros(3)])
    assert len(record) == 1
    with pytest.warns(StrategyWarning, match=r"lazy_mode= has no effect .* dense arrays"):
        opt.Adam(lazy_mode=True)
    with pytest.warns(StrategyWarning, match=r"multi_precision= has no effect .* amp O2"):
        opt.Momentum(multi_precision=True)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: opt.Adam(amsgrad=True), NotImplementedError, r"amsgrad=True .* optax.amsgrad"),
        (lambda: opt.Momentum(rescale_grad=0.5), NotImplementedError, r"rescale_grad=0.5"),
        (
            lambda: opt.AdamW(apply_decay_param_fun=lambda name: True),
            NotImplementedError,
            r"apply_decay_param_fun=.* optax.adamw\(\.\.\., mask=\.\.\.\)",
        ),
        (
            lambda: opt.SGD(parameters=[{"params": [], "learning_rate": 0.1}]),
            NotImplementedError,
            r"parameter groups .* optax.multi_transform",
        ),
        (lambda: opt.SGD(weight_decay="0.1"), TypeError, r"weight_decay must be a float or"),
        (lambda: opt.SGD(grad_clip=1.0), TypeError, r"grad_clip must be .* got float"),
        (lambda: opt.ClipGradByNorm(0), ValueError, r"clip_norm must be > 0, got 0"),
        (lambda: opt.ClipGradByGlobalNorm(-1.0), ValueError, r"clip_norm must be >= 0"),
        (lambda: opt.ClipGradByValue(max=-1.0), ValueError, r"max must be > 0 when min is not"),
        (lambda: opt.ClipGradByValue(max=1.0, min=2.0), ValueError, r"min < max, got min=2.0"),
        (lambda: opt.L2Decay(-0.1), ValueError, r"L2Decay coeff must be >= 0"),
    ],
)
def test_bad_arguments_say_what_is_wrong(make, error, message):
    with pytest.raises(error, match=message):
        make()
