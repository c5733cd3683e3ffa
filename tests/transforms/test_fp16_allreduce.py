"""fp16_allreduce: the data-parallel gradient all-reduce really runs in half precision."""

import re

import chex
import jax
import numpy as np
import optax
import pytest
from hlo import collectives, stablehlo_dtypes
from test_step import loss_fn, make_batch, make_params

import fleetjax
from fleetjax.transforms import grad_allreduce


def strategy(dtype=None, **extra):
    s = fleetjax.DistributedStrategy(fp16_allreduce=True, **extra)
    if dtype:
        s.fp16_allreduce_dtype = dtype
    return s


def test_gradient_all_reduce_is_half_precision():
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), strategy())
    state = step.init(make_params())
    short = "f16"
    found = collectives(step.lower(state, make_batch()).compile().as_text())
    assert {c.op for c in found} == {"all-reduce"} and {c.group_size for c in found} == {8}
    # The loss is averaged in f32; every gradient (w1, b1, w2) is summed in half precision.
    arrays = [a for c in found for a in re.findall(r"(\w+)\[([\d,]*)\]", c.shape)]
    assert sorted(arrays) == sorted(
        [("f32", ""), (short, "32"), (short, "16,32"), (short, "32,4")]
    ), found


def test_bfloat16_on_request():
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), strategy("bfloat16"))
    lowered = step.lower(step.init(make_params()), make_batch())
    # What fleetjax asks XLA for; XLA:CPU's AllReducePromotion then sums bf16 in f32, which it
    # does not do for f16 (GPUs all-reduce bf16 natively).
    assert stablehlo_dtypes(lowered.as_text(), "all_reduce") == {"f32", "bf16"}
    gradient_sums = [c for c in collectives(lowered.compile().as_text()) if "16,32" in c.shape]
    assert gradient_sums and all(c.group_size == 8 for c in gradient_sums)


def test_results_match_float32_within_half_precision_rounding():
    batches = [make_batch(seed) for seed in range(3)]
    half = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), strategy())
    full = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    a, b = half.init(make_params()), full.init(make_params())
    for batch in batches:
        a, ma = half(a, batch)
        b, mb = full(b, batch)
        np.testing.assert_allclose(ma["loss"], mb["loss"], rtol=1e-4)
    chex.assert_trees_all_close(a.params, b.params, rtol=2e-3, atol=2e-4)
    pairs = zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True)
    assert not all(np.array_equal(x, y) for x, y in pairs)  # it did round


def test_composes_with_in_step_gradient_merge_and_amp():
    s = strategy(amp=True)
    s.amp_configs = {"dtype": "bfloat16"}
    s.gradient_merge = True
    s.gradient_merge_configs = {"k_steps": 2, "mode": "in_step"}
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1), s)
    state, _ = step(step.init(make_params()), make_batch())
    full = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    expected, _ = full(full.init(make_params()), make_batch())
    chex.assert_trees_all_close(state.params, expected.params, rtol=2e-2, atol=2e-3)


def test_mean_in_keeps_other_float_dtypes():
    mesh = fleetjax.build_mesh()

    def grad_fn(params, model_state, batch):
        grads = {k: (v * batch.mean()).astype(v.dtype) for k, v in params.items()}
        return (batch.mean(), {}, model_state), grads

    f = grad_allreduce.data_parallel(
        grad_fn, mesh, ("dp", "sharding"), grad_allreduce.mean_in(np.float16)
    )
    params = {"f": np.ones(3, np.float32), "b": np.ones(3, jax.numpy.bfloat16)}
    (loss, _, _), grads = jax.jit(f)(params, None, np.arange(16, dtype=np.float32))
    assert float(loss) == 7.5
    np.testing.assert_allclose(grads["f"], 7.5)
    assert grads["b"].dtype == jax.numpy.bfloat16
    with pytest.raises(TypeError, match="gradients must be floating point, got int32"):
        jax.jit(f)({"i": np.ones(3, np.int32)}, None, np.arange(16, dtype=np.float32))
