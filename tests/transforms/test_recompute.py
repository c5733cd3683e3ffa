"""Recompute: named checkpoints, policies, offload, and the memory XLA compiled."""

import contextlib
import io
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import print_saved_residuals

import fleetjax
from fleetjax.transforms.recompute import POLICIES, remat

LAYERS, WIDTH, ROWS = 16, 128, 4096


def block(w, x):
    hidden = fleetjax.checkpoint_name(jnp.tanh(x @ w["a"]), "hidden")
    return jnp.tanh(hidden @ w["b"]) + x


def loss_fn(params, batch):
    def body(x, w):
        return fleetjax.recompute(block)(w, x), None

    x, _ = jax.lax.scan(body, batch["x"], params["layers"])
    return jnp.mean((x - batch["y"]) ** 2)


def make(rows=ROWS, width=WIDTH, layers=LAYERS):
    rng = np.random.RandomState(0)
    layer = lambda: rng.randn(layers, width, width).astype(np.float32) / 12  # noqa: E731
    params = {"layers": {"a": layer(), "b": layer()}}
    batch = {
        "x": rng.randn(rows, width).astype(np.float32),
        "y": rng.randn(rows, width).astype(np.float32),
    }
    return params, batch


def strategy(**configs):
    s = fleetjax.DistributedStrategy()
    if configs:
        s.recompute = True
        s.recompute_configs = configs
    return s


def saved_residuals(fn, *args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    return [line for line in out.getvalue().splitlines() if "from the argument" not in line]


def test_saved_residuals_are_exactly_the_named_checkpoints():
    w = {"a": jnp.ones((32, 32)), "b": jnp.ones((32, 32))}
    x = jnp.ones((4, 32))
    assert len(saved_residuals(block, w, x)) > 1  # without remat, tanh outputs etc. are saved
    kept = saved_residuals(remat(block, ["hidden"]), w, x)
    assert len(kept) == 1 and "named 'hidden'" in kept[0]
    assert saved_residuals(remat(block, policy="nothing_saveable"), w, x) == []


@pytest.mark.parametrize(
    "configs",
    [{"checkpoints": ["hidden"]}, {"policy": "nothing_saveable"}, {"policy": "dots_saveable"}],
    ids=["named", "nothing_saveable", "dots_saveable"],
)
def test_gradients_equal_the_plain_step(configs):
    params, batch = make(rows=64, width=32, layers=4)
    plain = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    remat_step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), strategy(**configs))
    a, ma = plain(plain.init(params), batch)
    b, mb = remat_step(remat_step.init(params), batch)
    np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-6)
    chex.assert_trees_all_close(a.params, b.params, rtol=1e-5, atol=1e-6)


def test_temp_memory_falls_on_a_16_layer_scanned_mlp():
    params, batch = make()

    def temp_bytes(s):
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
        return step.lower(step.init(params), batch).compile().memory_analysis().temp_size_in_bytes

    plain = temp_bytes(strategy())
    named = temp_bytes(strategy(checkpoints=["hidden"]))
    nothing = temp_bytes(strategy(policy="nothing_saveable"))
    assert named <= 0.6 * plain, (plain, named)
    assert nothing < named, (named, nothing)


def test_offload_keeps_checkpoints_in_host_memory_and_equals():
    # On CPU, pinned host memory is where device memory already is, so the move compiles to
    # nothing; JAX's residual report shows where each checkpoint lives (GPU: benchmarks/).
    w = {"a": jnp.ones((32, 32)), "b": jnp.ones((32, 32))}
    kept = saved_residuals(remat(block, ["hidden"], offload=True), w, jnp.ones((4, 32)))
    assert len(kept) == 1 and re.match(r"f32<host>\[4,32\]", kept[0]), kept

    params, batch = make(rows=64, width=32, layers=4)
    s = strategy(checkpoints=["hidden"], enable_offload=True, checkpoint_shape=[8, 32])
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
    new, metrics = step(step.init(params), batch)
    plain = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    ref, ref_metrics = plain(plain.init(params), batch)
    np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
    chex.assert_trees_all_close(new.params, ref.params, rtol=1e-5, atol=1e-6)


def test_markers_do_nothing_without_the_strategy():
    params, batch = make(rows=8, width=16, layers=2)
    assert loss_fn(params, batch) == pytest.approx(float(loss_fn(params, batch)))
    jaxpr = str(jax.make_jaxpr(loss_fn)(params, batch))
    assert "checkpoint" not in jaxpr.replace("checkpoint_name", "")


class TestErrors:
    def test_nothing_to_keep(self):
        with pytest.raises(
            ValueError, match=r"keeps nothing: set recompute_configs\['checkpoints'\]"
        ):
            fleetjax.make_train_step(loss_fn, optax.sgd(0.1), strategy(enable_offload=False))

    def test_unknown_checkpoint_name(self):
        params, batch = make(rows=16, width=8, layers=2)
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), strategy(checkpoints=["hiden"]))
        with pytest.raises(ValueError, match=r"checkpoints \['hiden'\] are not named in the loss"):
            step(step.init(params), batch)

    def test_no_marked_layers(self):
        params, batch = make(rows=16, width=8, layers=2)

        def unmarked(params, batch):
            return jnp.mean(batch["x"] @ params["layers"]["a"][0])

        step = fleetjax.make_train_step(unmarked, optax.sgd(0.1), strategy(checkpoints=["x"]))
        with pytest.raises(ValueError, match="marks no layer with fleetjax.recompute"):
            step(step.init(params), batch)

    def test_checkpoint_shape_is_checked(self):
        params, batch = make(rows=16, width=8, layers=2)
        s = strategy(checkpoints=["hidden"], checkpoint_shape=[3, 8])
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
        expected = (
            r"checkpoint_shape is \[3, 8\], but checkpoint 'hidden' has shape \[16, 8\] "
            r"\(\[2, 8\] per data replica\)"
        )
        with pytest.raises(ValueError, match=expected):
            step(step.init(params), batch)

    def test_policy_names(self):
        assert all(callable(getattr(jax.checkpoint_policies, p)) for p in POLICIES)
        with pytest.raises(ValueError, match="recompute_configs.policy must be one of ''"):
            fleetjax.DistributedStrategy().recompute_configs = {"policy": "save_all"}
        with pytest.raises(ValueError, match="cannot be combined with a named policy"):
            remat(block, ["hidden"], policy="dots_saveable", offload=True)

    def test_auto_parallel_strategy(self):
        params, batch = make(rows=16, width=8, layers=2)
        s = fleetjax.Strategy({"recompute": {"enable": True, "checkpoints": ["hidden"]}})
        step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
        _, metrics = step(step.init(params), batch)
        assert np.isfinite(metrics["loss"])
        with pytest.raises(ValueError, match=r"Strategy.recompute.enable is on but keeps nothing"):
            fleetjax.make_train_step(
                loss_fn, optax.sgd(0.1), fleetjax.Strategy({"recompute": {"enable": True}})
            )
