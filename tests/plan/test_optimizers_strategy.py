"""Paddle's optimizer switches (`optimizers.rebuild` on a plan's switch): its rebuilds (LARS
from Momentum, LAMB from Adam, DGC from Momentum), the LocalSGD wrappers, and a clear error
wherever Paddle would drop a switch."""

import chex
import numpy as np
import optax
import pytest

import fleetjax
from fleetjax import optimizers as opt
from fleetjax.plan import read_plan
from fleetjax.vocabulary import DATA_AXES


def strategy(**switches):
    s = fleetjax.DistributedStrategy()
    for name, configs in switches.items():
        setattr(s, name, True)
        if configs:
            setattr(s, f"{name}_configs", configs)
    return s


def rebuilt(tx, s, data_parallel_size, axis_names=DATA_AXES):
    """What `s` trains with: `tx`, or its switch's rebuild."""
    switch = read_plan(s).optimizer
    if switch is None:
        return tx
    return opt.rebuild(tx, switch.name, switch.configs, data_parallel_size, axis_names)


def one_update(tx, params):
    grads = {"w": np.full((3, 2), 0.5, np.float32)}
    return tx.update(grads, tx.init(params), params)[0]


def test_nothing_to_rebuild():
    tx = optax.adam(1e-3)
    assert rebuilt(tx, fleetjax.DistributedStrategy(), 8) is tx
    assert rebuilt(tx, fleetjax.Strategy(), 8) is tx


def test_lars_from_momentum():
    configs = {"lars_coeff": 0.01, "epsilon": 1e-6, "exclude_from_weight_decay": ["bias"]}
    user = opt.momentum(0.1, 0.8, weight_decay=1e-4, clip_norm=2.0)
    tx = rebuilt(user, strategy(lars=configs), 8)
    assert tx.kind == "LarsMomentum"
    assert dict(tx.hyperparams) == {
        "learning_rate": 0.1,
        "momentum": 0.8,
        "lars_coeff": 0.01,
        "lars_weight_decay": 0.0005,
        "epsilon": 1e-6,
        "exclude_from_weight_decay": ("bias",),
        "weight_decay": 1e-4,
        "clip_norm": 2.0,
    }
    params = {"w": np.arange(6, dtype=np.float32).reshape(3, 2)}
    direct = opt.lars(0.1, 0.8, 0.01, 0.0005, 1e-6, ["bias"], weight_decay=1e-4, clip_norm=2.0)
    chex.assert_trees_all_equal(one_update(tx, params), one_update(direct, params))


def test_lamb_from_adam():
    user = opt.adam(0.01, 0.8, 0.95, clip_norm=1.0)
    tx = rebuilt(user, strategy(lamb={"lamb_weight_decay": 0.02}), 1)
    assert tx.kind == "Lamb"
    # Fleet passes the Adam's epsilon (1e-8), not Lamb's default 1e-6.
    assert (tx.hyperparams["epsilon"], tx.hyperparams["beta1"], tx.hyperparams["beta2"]) == (
        1e-8,
        0.8,
        0.95,
    )
    assert tx.hyperparams["lamb_weight_decay"] == 0.02
    assert tx.hyperparams["clip_norm"] == 1.0


def test_dgc_from_momentum():
    configs = {"rampup_begin_step": 5, "rampup_step": 10, "sparsity": [0.99, 0.999]}
    user = opt.momentum(0.1, 0.9, use_nesterov=True, clip_norm=3.0)
    tx = rebuilt(user, strategy(dgc=configs), 8, axis_names=("dp",))
    assert tx.kind == "DGCMomentum"
    assert dict(tx.hyperparams) == {
        "learning_rate": 0.1,
        "momentum": 0.9,
        "use_nesterov": True,
        "weight_decay": 0.0,
        "clip_norm": 3.0,
        "rampup_begin_step": 5,
        "rampup_step": 10,
        "sparsity": (0.99, 0.999),
        "axis_names": ("dp",),
    }


@pytest.mark.parametrize("switch", ["localsgd", "adaptive_localsgd"])
def test_localsgd_wraps_any_optimizer(switch):
    user = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    tx = rebuilt(user, strategy(**{switch: {"begin_step": 3}}), 2)
    state = tx.init({"w": np.zeros(2, np.float32)})
    assert int(state.step) == 0 and float(opt.get_lr(state)) == pytest.approx(0.1)


@pytest.mark.parametrize(
    "user, switches, dp, error, message",
    [
        (opt.adam(), {"lars": None}, 8, ValueError,
         r"strategy.lars needs the optimizer to be Momentum \(Paddle does not apply it to Adam "
         r"and trains without it\), got Adam\(learning_rate=0.001"),
        (optax.sgd(0.1, 0.9), {"lars": None}, 8, TypeError,
         r"strategy.lars rebuilds the optimizer from the user's Momentum, as Paddle does, so it "
         r"needs to know its hyper-parameters: pass fleetjax.optimizers.momentum\(...\) instead "
         r"of GradientTransformationExtraArgs"),
        (opt.adamw(), {"lamb": None}, 8, ValueError,
         "strategy.lamb needs the optimizer to be Adam"),
        (opt.momentum(), {"dgc": None}, 1, ValueError,
         "strategy.dgc needs more than one data-parallel replica .* data_parallel_size is 1"),
        (opt.sgd(), {"localsgd": None}, 1, ValueError,
         "strategy.localsgd needs more than one data-parallel replica"),
        (opt.adam(), {"adaptive_localsgd": None}, 8, ValueError,
         "strategy.adaptive_localsgd needs the optimizer to be SGD or Momentum"),
        (opt.momentum(), {"lars": None, "dgc": None}, 8, ValueError,
         "strategy turns on lars and dgc; Paddle applies at most one of lars, lamb, dgc, "
         "localsgd, adaptive_localsgd"),
        (opt.momentum(use_nesterov=True), {"lars": None}, 8, ValueError,
         "Paddle's lars_momentum has no Nesterov variant"),
        (opt.adam(weight_decay=0.1), {"lamb": None}, 8, ValueError,
         r"strategy.lamb: the Adam's weight_decay=0.1 would be lost"),
    ],
)  # fmt: skip
def test_switches_that_cannot_apply(user, switches, dp, error, message):
    with pytest.raises(error, match=message):
        rebuilt(user, strategy(**switches), dp)
