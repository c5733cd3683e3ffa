"""The zero-bubble schedules (Paddle's ZBH1 and ZBVPP, Qi et al. 2023) and Eager1F1B: their
tables (the backward split into B and W, the bubble, the in-flight count), Paddle's conditions,
and the GPT under them with dp x mp x pp. (The pipeline under each giving the unpipelined
model's loss and gradients: tests/test_pipeline.py.)"""

import jax
import numpy as np
import optax
import pytest
from tiny_gpt import EIGHT_HEADS as CONFIG
from tiny_gpt import make_gpt

import fleetjax
from fleetjax.transforms.pipeline import (
    PipelineLayer,
    pipeline_schedule,
)


def test_zbh1_table_defers_the_first_weight_gradients_of_each_stage():
    p, m = 4, 8
    zb, one = pipeline_schedule("ZBH1", p, m), pipeline_schedule("1F1B", p, m)
    # B runs where 1F1B's backward runs: the input gradient is on the same critical path.
    np.testing.assert_array_equal(zb.forward, one.forward)
    np.testing.assert_array_equal(zb.backward, one.backward)
    assert zb.split_backward and not one.split_backward
    for s in range(p):
        b = {int(zb.backward[t, s]): t for t in np.nonzero(zb.backward[:, s] >= 0)[0]}
        w = {int(zb.weight[t, s]): t for t in np.nonzero(zb.weight[:, s] >= 0)[0]}
        assert sorted(w) == list(range(m))
        late = [i for i in range(m) if w[i] != b[i]]
        assert late == list(range(s))  # Paddle's ZBH1: stage s holds its first s Ws back
        assert all(w[i] > max(b.values()) for i in late)  # into ticks it would idle
    np.testing.assert_array_equal(zb.weights_held, range(p))
    # The same peak of micro-batches in flight (residuals held until W) as 1F1B's.
    assert zb.in_flight.max() == one.in_flight.max() == 2 * p - 1
    assert zb.ticks == one.ticks


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("costs", [(1, 2, 1), (1, 3, 1), (2, 3, 1)])
def test_bubble_against_1f1b(p, costs):
    """With a forward costing F, the input gradient B and the weight gradient W, 1F1B idles
    (P - 1)(F + B + W) and ZBH1 (P - 1)(F + B): a third less where F = B = W (the paper's
    asynchronous ZB-H1 idles (P - 1)(F + B - W); in lockstep a hop costs a tick)."""
    f, backward, w = costs
    b = backward - w
    for m in (p, 2 * p, 4 * p + 1):
        busy = m * (f + b + w)
        zb = pipeline_schedule("ZBH1", p, m).idle_fraction(f, backward, w)
        one = pipeline_schedule("1F1B", p, m).idle_fraction(f, backward, w)
        assert zb == pytest.approx((p - 1) * (f + b) / (busy + (p - 1) * (f + b)))
        assert one == pytest.approx((p - 1) * (f + b + w) / (busy + (p - 1) * (f + b + w)))
        for v in (2, 3):
            vpp = pipeline_schedule("VPP", p, m, v)
            zbvpp = pipeline_schedule("ZBVPP", p, m, v)
            assert zbvpp.idle_fraction(f, backward, w) < vpp.idle_fraction(f, backward, w)
            assert zbvpp.in_flight.max() == vpp.in_flight.max()


def test_eager_1f1b_is_the_lockstep_1f1b_table():
    eager, one = pipeline_schedule("Eager1F1B", 4, 8), pipeline_schedule("1F1B", 4, 8)
    for field in ("forward", "backward", "weight"):
        np.testing.assert_array_equal(getattr(eager, field), getattr(one, field))
    # Paddle's Eager1F1B warm-up: stage s runs 2 (P - s) - 1 forwards before its first backward.
    for s in range(4):
        first_backward = np.nonzero(eager.backward[:, s] >= 0)[0][0]
        assert (eager.forward[: first_backward + 1, s] >= 0).sum() == 2 * (4 - s) - 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("Eager1F1B", 4, 6), "'Eager1F1B' needs accumulate_steps >= 7 for pp_degree=4"),
        (("ZBH1", 4, 3), "'ZBH1' needs accumulate_steps >= 4 for pp_degree=4"),
        (("ZBVPP", 4, 3, 2), "'ZBVPP' needs accumulate_steps >= 4 for pp_degree=4"),
        (("ZBVPP", 4, 8), "'ZBVPP' needs vpp_degree >= 2 virtual stages per device, got 1"),
        (("ZBH1", 4, 8, 2), "vpp_degree=2 needs schedule_mode 'VPP' (interleaved 1F1B), got"),
    ],
)  # fmt: skip
def test_paddle_conditions(args, message):
    with pytest.raises(ValueError) as error:
        pipeline_schedule(*args)
    assert message in str(error.value)


def test_a_model_without_chunks_for_zbvpp_is_refused():
    model, params = make_gpt(CONFIG, seed=0)
    strategy = fleetjax.DistributedStrategy(pipeline=True, hybrid_configs={"pp_degree": 2})
    strategy.pipeline_configs = {
        "schedule_mode": "ZBVPP", "accumulate_steps": 4, "micro_batch_size": 2
    }  # fmt: skip
    layer = PipelineLayer(model.embed, model.stage, model.head_loss)  # one chunk per stage
    step = fleetjax.make_train_step(layer, optax.sgd(0.1), strategy)
    batch = {"tokens": jax.numpy.zeros((8, CONFIG.max_position_embeddings + 1), "int32")}
    with pytest.raises(ValueError, match="schedule_mode 'ZBVPP' needs vpp_degree >= 2"):
        step(step.init(model.pipeline_params(params)), batch)


def test_printed_table_shows_the_split_backward():
    lines = str(pipeline_schedule("ZBH1", 2, 2)).splitlines()
    assert lines[0] == "ZBH1: P=2, m=2, idle 25.0%"
    assert lines[2].split() == ["stage", "0", "F0", "F1", "B0", "W0", "B1", "W1"]
    assert lines[3].split() == ["stage", "1", ".", "F0", "B0", "F1", "B1", "W1", "W0"]
    assert lines[-1] == (
        "Fi / Bi / Wi: forward / backward (input gradient) / weight gradient of micro-batch i"
    )


@pytest.mark.slow  # 30 s: two GPT steps compiled
def test_gpt_with_dp_mp_pp_trains_as_under_1f1b():
    model, params = make_gpt(CONFIG, seed=0)
    layer = PipelineLayer(model.embed, model.stage, model.head_loss)
    specs = model.pipeline_params(model.partition_specs())
    keys = jax.random.split(jax.random.key(1), 2)
    batches = [{"tokens": jax.random.randint(k, (8, 9), 0, 64)} for k in keys]

    def losses(mode):
        s = fleetjax.DistributedStrategy(pipeline=True)
        s.hybrid_configs = {"dp_degree": 2, "pp_degree": 2, "mp_degree": 2}
        s.pipeline_configs = {"schedule_mode": mode, "accumulate_steps": 2, "micro_batch_size": 2}
        step = fleetjax.make_train_step(layer, optax.adam(1e-2), s, param_specs=specs)
        state, out = step.init(model.pipeline_params(params)), []
        for batch in batches:
            state, metrics = step(state, batch)
            out.append(float(metrics["loss"]))
        return out

    np.testing.assert_allclose(losses("ZBH1"), losses("1F1B"), rtol=2e-6)
