"""The strategy's optimizers inside make_train_step: LARS, LAMB, DGC, LocalSGD on 8 devices."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo import collectives

import fleetjax
from fleetjax import optimizers as fo


def loss_fn(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


def make(seed=0, rows=64):
    rng = np.random.RandomState(seed)
    params = {
        "w1": rng.randn(128, 128).astype(np.float32) / 11,  # 16384 elements: DGC-eligible
        "w2": rng.randn(128, 4).astype(np.float32) / 11,
    }
    batch = {
        "x": rng.randn(rows, 128).astype(np.float32),
        "y": rng.randn(rows, 4).astype(np.float32),
    }
    return params, batch


def run(strategy, optimizer, steps=3):
    params, _ = make()
    step = fleetjax.make_train_step(loss_fn, optimizer, strategy)
    state = step.init(params)
    for seed in range(1, steps + 1):
        state, metrics = step(state, make(seed)[1])
    return jax.device_get(state), metrics, step


def plain(optimizer, steps=3):
    """The same optimizer, plain optax on one device, on the whole batches."""
    params, _ = make()
    opt_state = optimizer.init(params)
    for seed in range(1, steps + 1):
        grads = jax.grad(loss_fn)(params, make(seed)[1])
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


@pytest.mark.parametrize(
    ("switch", "user", "rebuilt"),
    [
        ("lars", fo.momentum(0.1, 0.9), fo.lars(0.1, 0.9)),
        ("lamb", fo.adam(0.01), fo.lamb(0.01, epsilon=1e-8)),  # eps from the Adam
    ],
)
def test_lars_and_lamb_are_rebuilt_from_the_users_optimizer(switch, user, rebuilt):
    state, _, step = run(fleetjax.DistributedStrategy(**{switch: True}), user)
    assert step.optimizer.kind == rebuilt.kind
    # The same step with the rebuilt optimizer given directly: the same numbers to the bit.
    expected, _, _ = run(fleetjax.DistributedStrategy(), rebuilt)
    chex.assert_trees_all_equal(state.params, expected.params)


def test_fleet_distributed_optimizer_rebuilds(monkeypatch):
    monkeypatch.delenv("PADDLE_TRAINER_ENDPOINTS", raising=False)
    fleet = fleetjax.fleet.Fleet()
    fleet.init(strategy=fleetjax.DistributedStrategy(lars=True))
    opt = fleet.distributed_optimizer(fo.momentum(0.1))
    assert opt.rebuilt.kind == "LarsMomentum" and opt.user.kind == "Momentum"
    step = fleetjax.make_train_step(loss_fn, opt)
    assert step.optimizer is opt.rebuilt


def test_dgc_before_rampup_is_dense_momentum():
    s = fleetjax.DistributedStrategy(dgc=True, dgc_configs={"rampup_begin_step": 100})
    state, _, _ = run(s, fo.momentum(0.1, 0.9))
    chex.assert_trees_all_close(state.params, plain(fo.momentum(0.1, 0.9)), rtol=1e-5, atol=1e-6)
    assert {x.shape[0] for x in jax.tree.leaves(state.opt_state)} == {8}  # stacked per replica


def test_dgc_sends_only_the_top_k_of_the_eligible_gradient():
    s = fleetjax.DistributedStrategy(dgc=True)  # sparsity 0.999 from step 0
    state, metrics, step = run(s, fo.momentum(0.1, 0.9))
    assert np.isfinite(metrics["loss"])
    found = collectives(step.lower(step.init(make()[0]), make(1)[1]).compile().as_text())
    gathers = [c for c in found if c.op == "all-gather"]
    dense = [c for c in found if c.op == "all-reduce" and "128,128" in c.shape]
    assert gathers and not dense, found
    # Every replica keeps the same parameters.
    assert state.params["w1"].shape == (128, 128)


def test_localsgd_with_k_1_is_synchronous_sgd():
    s = fleetjax.DistributedStrategy(localsgd=True, localsgd_configs={"k_steps": 1})
    state, _, _ = run(s, fo.sgd(0.1))
    expected = plain(fo.sgd(0.1))
    for replica in range(8):
        chex.assert_trees_all_close(
            jax.tree.map(lambda x, i=replica: x[i], state.params), expected, rtol=1e-5, atol=1e-6
        )


def test_localsgd_replicas_drift_between_syncs_and_agree_after():
    s = fleetjax.DistributedStrategy(
        localsgd=True, localsgd_configs={"k_steps": 3, "begin_step": 1}
    )
    params, _ = make()
    step = fleetjax.make_train_step(loss_fn, fo.sgd(0.5), s)
    state = step.init(params)
    spreads = []
    for seed in range(1, 5):  # syncs on steps 1 and 4
        state, _ = step(state, make(seed)[1])
        w1 = np.asarray(state.params["w1"])
        spreads.append(float(np.max(np.abs(w1 - w1.mean(0)))))
    assert spreads[0] < 1e-6 and spreads[3] < 1e-6
    assert spreads[1] > 1e-4 and spreads[2] > 1e-4


def test_amp_skip_is_agreed_by_every_replica():
    s = fleetjax.DistributedStrategy(amp=True, localsgd=True)
    params, batch = make()
    step = fleetjax.make_train_step(loss_fn, fo.sgd(0.1), s)
    state = step.init(params)
    bad = dict(batch)
    bad["x"] = batch["x"].copy()
    bad["x"][3, 0] = np.inf  # only replica 0's rows
    before = jax.device_get(state.params)
    state, metrics = step(state, bad)
    assert bool(metrics["skipped"])
    chex.assert_trees_all_equal(jax.device_get(state.params), before)


class TestRefusals:
    def test_plain_optax_cannot_be_rebuilt(self):
        with pytest.raises(TypeError, match=r"pass fleetjax.optimizers.momentum\(...\)"):
            fleetjax.make_train_step(
                loss_fn, optax.sgd(0.1), fleetjax.DistributedStrategy(lars=True)
            )

    def test_wrong_kind(self):
        with pytest.raises(ValueError, match="strategy.lars needs the optimizer to be Momentum"):
            fleetjax.make_train_step(loss_fn, fo.adam(0.1), fleetjax.DistributedStrategy(lars=True))

    def test_one_replica(self):
        with pytest.raises(ValueError, match="strategy.dgc needs more than one data-parallel"):
            fleetjax.make_train_step(
                loss_fn,
                fo.momentum(0.1),
                fleetjax.DistributedStrategy(dgc=True),
                mesh=fleetjax.build_mesh(devices=jax.devices()[:1]),
            )

    def test_fp16_allreduce_with_dgc(self):
        with pytest.raises(ValueError, match="fp16_allreduce does not combine with dgc"):
            fleetjax.make_train_step(
                loss_fn,
                fo.momentum(0.1),
                fleetjax.DistributedStrategy(dgc=True, fp16_allreduce=True),
            )
