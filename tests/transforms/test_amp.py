"""AMP: per-operation precision (O1, O2), Paddle's dynamic loss scaling, skipped updates."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hlo import stablehlo_dtypes
from jax.extend.core.primitives import remat_p

import fleetjax
from fleetjax.transforms import amp, recompute
from fleetjax.transforms.loss_scale import DynamicLossScale


def mlp_loss(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()


def make(seed=0, rows=64):
    rng = np.random.RandomState(seed)
    params = {
        "w1": rng.randn(16, 32).astype(np.float32) / 4,
        "b1": np.zeros(32, np.float32),
        "w2": rng.randn(32, 10).astype(np.float32) / 6,
    }
    x = rng.randn(rows, 16).astype(np.float32)
    batch = {"x": x, "label": (x[:, :10].argmax(1)).astype(np.int32)}
    return params, batch


def amp_strategy(**configs):
    s = fleetjax.DistributedStrategy(amp=True)
    s.amp_configs = configs
    return s


def lowered_text(strategy, loss=mlp_loss):
    """The lowered train step (forward and backward)."""
    params, batch = make()
    step = fleetjax.make_train_step(loss, optax.sgd(0.1), strategy)
    return step.lower(step.init(params), batch)


def forward_text(policy, loss=mlp_loss):
    """The lowered forward pass alone: each operation appears once, at its precision."""
    params, batch = make()
    return jax.jit(amp.autocast(loss, policy)).lower(params, batch).as_text()


class TestLossScaleUpdate:
    # Paddle's test_update_loss_scaling cases (incr_every_n_steps=1000,
    # decr_every_n_nan_or_inf=2, incr_ratio=2, decr_ratio=0.5).
    @pytest.mark.parametrize(
        ("found_inf", "good", "bad", "scale", "expected"),
        [
            (False, 999, 0, 1024.0, (2048.0, 0, 0)),
            (True, 5, 1, 1024.0, (512.0, 0, 0)),
            (True, 5, 0, 1024.0, (1024.0, 0, 1)),
            (True, 0, 1, 1.0, (1.0, 0, 0)),
            (False, 10, 3, 1024.0, (1024.0, 11, 0)),
        ],
    )
    def test_paddle_cases(self, found_inf, good, bad, scale, expected):
        state = DynamicLossScale(
            jnp.float32(scale),
            jnp.int32(good),
            jnp.int32(bad),
            incr_every_n_steps=1000,
            decr_every_n_nan_or_inf=2,
            incr_ratio=2.0,
            decr_ratio=0.5,
        )
        new = state.adjust(jnp.asarray(not found_inf))
        assert (float(new.loss_scale), int(new.good_steps), int(new.bad_steps)) == expected

    def test_no_increase_past_overflow(self):
        state = DynamicLossScale.create(3e38, incr_every_n_steps=1, decr_every_n_nan_or_inf=1)
        new = state.adjust(jnp.asarray(True))
        assert float(new.loss_scale) == pytest.approx(3e38)


def paddle_trajectory(finite_steps, scale, incr_every, decr_every, incr, decr):
    """Paddle's update_loss_scaling, step by step, in plain Python."""
    good = bad = 0
    out = []
    for finite in finite_steps:
        out.append(scale)
        if finite:
            bad, good = 0, good + 1
            if good == incr_every:
                scale, good = scale * incr, 0
        else:
            good, bad = 0, bad + 1
            if bad == decr_every:
                scale, bad = max(scale * decr, 1.0), 0
    return out, (scale, good, bad)


def test_scripted_overflows_follow_paddle_and_skip_bit_identically():
    params, batch = make()
    s = amp_strategy(
        init_loss_scaling=1024.0, incr_every_n_steps=3, decr_every_n_nan_or_inf=2,
        incr_ratio=2.0, decr_ratio=0.5,
    )  # fmt: skip
    step = fleetjax.make_train_step(mlp_loss, optax.adam(1e-2), s)
    state = step.init(params)
    script = [True, True, True, False, True, False, False, True, True, True, True, False]
    scales, skipped = [], []
    for finite in script:
        bad = dict(batch)
        if not finite:  # one non-finite row on one device: every replica must skip
            bad["x"] = batch["x"].copy()
            bad["x"][5, 3] = np.inf
        before = jax.device_get((state.params, state.opt_state))
        state, metrics = step(state, bad)
        scales.append(float(metrics["loss_scale"]))
        skipped.append(bool(metrics["skipped"]))
        if not finite:
            after = jax.device_get((state.params, state.opt_state))
            for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    expected, final = paddle_trajectory(script, 1024.0, 3, 2, 2.0, 0.5)
    assert scales == expected
    assert skipped == [not f for f in script]
    ls = state.loss_scale
    assert (float(ls.loss_scale), int(ls.good_steps), int(ls.bad_steps)) == final


def test_o1_runs_dots_in_half_and_softmax_and_reductions_in_float32():
    forward = forward_text(amp.policy("bfloat16"))
    assert stablehlo_dtypes(forward, "dot_general") == {"bf16"}
    for op in ("exponential", "log", "tanh", "add"):  # tanh and add follow the f32 bias
        assert stablehlo_dtypes(forward, op) <= {"f32", "i32"}, op
    assert stablehlo_dtypes(forward, "reduce") <= {"f32", "i1", "i32"}
    lowered = lowered_text(amp_strategy(dtype="bfloat16"))
    assert stablehlo_dtypes(lowered.as_text(), "dot_general") == {"bf16"}  # backward too
    # XLA:CPU has no bf16 dot: it keeps the rounding to bf16 and runs the dot in f32.
    assert "bf16[" in lowered.compile().as_text()
    # Without AMP, nothing is half precision.
    assert "bf16" not in lowered_text(fleetjax.DistributedStrategy()).as_text()


def test_o2_keeps_float32_master_weights_and_runs_gray_ops_in_half():
    params, batch = make()
    s = amp_strategy(use_pure_bf16=True)
    step = fleetjax.make_train_step(mlp_loss, optax.adam(1e-3), s)
    state = step.init(params)
    text = step.lower(state, batch).as_text()
    assert stablehlo_dtypes(text, "tanh") == {"bf16"}
    assert stablehlo_dtypes(text, "exponential") == {"f32"}
    state, _ = step(state, batch)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
    assert state.loss_scale is None  # bfloat16 needs no loss scaling


def test_float16_o1_scales_the_loss_by_default():
    params, batch = make()
    step = fleetjax.make_train_step(mlp_loss, optax.sgd(0.1), amp_strategy())
    state, metrics = step(step.init(params), batch)
    assert float(metrics["loss_scale"]) == 32768.0 and not bool(metrics["skipped"])
    assert stablehlo_dtypes(step.lower(state, batch).as_text(), "dot_general") == {"f16"}


@pytest.mark.parametrize(
    ("configs", "dtype"), [({}, "float16"), ({"dtype": "bfloat16"}, "bfloat16")]
)
def test_training_reaches_the_float32_loss(configs, dtype):
    params, _ = make()
    batches = [make(seed, rows=256)[1] for seed in range(1, 9)]

    def final_loss(strategy):
        step = fleetjax.make_train_step(mlp_loss, optax.adam(3e-3), strategy)
        state = step.init(params)
        for _ in range(25):
            for batch in batches:
                state, metrics = step(state, batch)
        return float(metrics["loss"])

    reference = final_loss(fleetjax.DistributedStrategy())
    mixed = final_loss(amp_strategy(**configs))
    assert mixed == pytest.approx(reference, rel=0.02), (dtype, reference, mixed)


class TestLists:
    def test_custom_black_list_keeps_matmul_in_float32(self):
        text = lowered_text(amp_strategy(dtype="bfloat16", custom_black_list=["matmul"])).as_text()
        assert stablehlo_dtypes(text, "dot_general") == {"f32"}

    def test_custom_white_list_moves_exp_to_half(self):
        s = amp_strategy(dtype="bfloat16", custom_white_list=["exp"])
        assert stablehlo_dtypes(lowered_text(s).as_text(), "exponential") == {"bf16"}

    def test_jax_primitive_names_are_accepted(self):
        policy = amp.policy("float16", custom_black_list=["dot_general"])
        assert "dot_general" in policy.black and "dot_general" not in policy.white

    def test_overlap_is_an_error(self):
        overlap = "The given custom_white_list overlaps custom_black_list with < softmax >"
        with pytest.raises(ValueError, match=overlap):
            amp.policy("float16", custom_white_list=["softmax"], custom_black_list=["softmax"])
        with pytest.raises(ValueError, match="< matmul > and < mul > .*dot_general"):
            amp.policy("float16", custom_white_list=["matmul"], custom_black_list=["mul"])

    def test_unknown_operator(self):
        with pytest.raises(ValueError, match="custom_white_list entry 'conv9d' is neither"):
            amp.policy("float16", custom_white_list=["conv9d"])

    def test_black_varnames_stay_float32(self):
        def loss(params, batch):
            hidden = fleetjax.checkpoint_name(batch["x"] @ params["w1"], "proj")
            return jnp.sum(jnp.tanh(hidden + params["b1"]) @ params["w2"])

        o2 = dict(dtype="bfloat16", level="O2")
        plain = forward_text(amp.policy(**o2), loss)
        kept = forward_text(amp.policy(**o2, custom_black_varnames=["proj"]), loss)
        assert stablehlo_dtypes(plain, "add") == {"bf16"}
        assert stablehlo_dtypes(kept, "add") == {"f32"}  # hidden + b1 consumes "proj"
        assert stablehlo_dtypes(kept, "dot_general") == {"bf16"}

    def test_fp16_guard(self):
        def guarded(params, batch):
            with fleetjax.fp16_guard():
                hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
            logits = hidden @ params["w2"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

        s = amp_strategy(use_pure_fp16=True)  # use_fp16_guard defaults to True, as in Paddle
        text = lowered_text(s, guarded).as_text()
        assert stablehlo_dtypes(text, "tanh") == {"f16"}
        assert "f16" not in stablehlo_dtypes(text, "exponential")
        with pytest.raises(ValueError, match=r"no fleetjax.fp16_guard\(\) region"):
            lowered_text(s)
        assert stablehlo_dtypes(
            lowered_text(amp_strategy(use_pure_fp16=True, use_fp16_guard=False)).as_text(), "tanh"
        ) == {"f16"}

    def test_pure_fp16_and_bf16_together(self):
        with pytest.raises(ValueError, match="use_pure_fp16 and use_pure_bf16 cannot both"):
            fleetjax.make_train_step(
                mlp_loss, optax.sgd(0.1), amp_strategy(use_pure_fp16=True, use_pure_bf16=True)
            )


def test_autocast_through_scan_cond_while_and_custom_jvp():
    def fn(w, x):
        x = jax.nn.relu(x @ w)

        def body(c, _):
            return jnp.sin(c @ w), c.sum()

        x, ys = jax.lax.scan(body, x, None, length=3)
        x = jax.lax.cond(ys.sum() > 0, lambda v: v * 2, lambda v: v, x)
        n = jax.lax.while_loop(lambda c: c < 3.0, lambda c: c + 1.0, 0.0)
        return jnp.sum(x) + n

    w, x = jnp.eye(8) * 0.5, jnp.ones((4, 8))
    cast = amp.autocast(fn, amp.policy("bfloat16"))
    np.testing.assert_allclose(cast(w, x), fn(w, x), rtol=2e-2)
    grads = jax.grad(cast)(w, x)
    assert grads.dtype == jnp.float32
    chex.assert_trees_all_close(grads, jax.grad(fn)(w, x), rtol=5e-2, atol=5e-2)
    text = jax.jit(cast).lower(w, x).as_text()
    assert stablehlo_dtypes(text, "dot_general") == {"bf16"}


def test_autocast_through_recompute_runs_the_recomputed_layers_in_half():
    """A layer marked with `fleetjax.recompute` under a recompute strategy is a
    `jax.checkpoint` (primitive ``remat2`` in recent JAX): its dots run in bf16 too, in the
    forward pass and in the backward pass that recomputes it."""

    def layer(w, x):
        return jnp.tanh(x @ w)

    def loss(w, x):
        def body(h, _):
            return fleetjax.recompute(layer)(w, h), None

        return jnp.sum(jax.lax.scan(body, x, None, length=2)[0])

    w, x = jnp.eye(8) * 0.5, jnp.ones((4, 8))
    cast = amp.autocast(loss, amp.policy("bfloat16"))
    with recompute.recompute_scope(policy="nothing_saveable"):
        jaxpr = jax.make_jaxpr(cast)(w, x)
        text = jax.jit(jax.grad(cast)).lower(w, x).as_text()
    assert f"{remat_p.name}[" in str(jaxpr)  # the layer stayed rematerialised
    assert stablehlo_dtypes(text, "dot_general") == {"bf16"}


def test_autocast_on_explicit_axes_with_a_sharded_gather():
    """jnp runs a gather with out_sharding inside `auto_axes`; replaying it keeps that context."""
    mesh = jax.make_mesh((4, 2), ("dp", "mp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    place = lambda x, *spec: jax.device_put(x, jax.NamedSharding(mesh, jax.P(*spec)))  # noqa: E731
    table = place(jnp.arange(64.0).reshape(16, 4) / 64, "mp", None)
    ids = place(jnp.arange(24, dtype=jnp.int32).reshape(8, 3) % 16, "dp", None)

    def fn(t, i):
        return jnp.sum(t.at[i].get(out_sharding=jax.P("dp", None, None)) @ jnp.ones((4, 4)))

    with jax.set_mesh(mesh):
        cast = jax.jit(amp.autocast(fn, amp.policy("bfloat16")))
        np.testing.assert_allclose(cast(table, ids), jax.jit(fn)(table, ids), rtol=1e-2)
        assert stablehlo_dtypes(cast.lower(table, ids).as_text(), "dot_general") == {"bf16"}


def test_auto_parallel_strategy_amp():
    s = fleetjax.Strategy({"amp": {"enable": True, "dtype": "bfloat16", "level": "o2"}})
    params, batch = make()
    step = fleetjax.make_train_step(mlp_loss, optax.sgd(0.1), s)
    state, metrics = step(step.init(params), batch)
    assert np.isfinite(metrics["loss"]) and "loss_scale" not in metrics
    assert stablehlo_dtypes(step.lower(state, batch).as_text(), "tanh") == {"bf16"}
