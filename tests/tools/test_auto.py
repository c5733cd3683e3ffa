"""`fleetjax.auto.search` (Paddle's `DistributedStrategy.auto`): with a budget too small for pure
data parallelism it picks a plan whose compiled per-device bytes fit and that trains like one
device; with a large budget it picks pure data parallelism; every candidate is reported."""

import dataclasses
import math
import os
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from tiny_gpt import EIGHT_HEADS as GPT_CONFIG
from tiny_gpt import make_gpt

import fleetjax
from fleetjax import auto, targets
from fleetjax.transforms.pipeline import PipelineLayer

MiB = 2**20
needs_plugin = pytest.mark.skipif(
    not targets.plugin_installed(),
    reason="jax's CUDA plugin is not installed: pip install -e '.[aot]'",
)

# An MLP whose Adam state under pure data parallelism overflows a 10 MiB budget: 4 MiB of
# parameters, 8 MiB of moments; 20 MiB per device compiled.
WIDTH, LAYERS, ROWS = 512, 4, 16


def mlp_loss(params, batch):
    layer = fleetjax.recompute(lambda w, h: jnp.tanh(h @ w))
    h = batch["x"]
    for i in range(LAYERS):
        h = layer(params[f"w{i}"], h)
    return jnp.mean((h - batch["y"]) ** 2)


def mlp_params(seed=0):
    rng = np.random.RandomState(seed)
    return {f"w{i}": rng.randn(WIDTH, WIDTH).astype(np.float32) / 16 for i in range(LAYERS)}


def mlp_batch(seed=1, rows=ROWS):
    rng = np.random.RandomState(seed)
    return {
        "x": rng.randn(rows, WIDTH).astype(np.float32),
        "y": rng.randn(rows, WIDTH).astype(np.float32),
    }


def compiled_bytes(step, state, batch):
    """What the planner counts, measured again on the step that trains."""
    m = step.lower(state, batch).compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def train(step, params, batches):
    state = step.init(params)
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state, np.array(losses)


def one_device(loss_fn, params, batches, tx):
    """Paddle's formula on one device: the optimizer on the whole batch's gradient."""
    params = jax.device_put(params, jax.devices()[0])
    opt_state, losses = tx.init(params), []
    for batch in batches:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return params, np.array(losses)


# -- reading the compiled HLO ------------------------------------------------------------------


def test_hlo_cost_counts_each_loop_trip_and_the_costlier_branch():
    """A scan of 5 matmuls with an all-reduce each, then a cond whose costly branch has 2."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))

    def f(x, w):
        def body(h, _):
            h = jnp.tanh(h @ w)
            return h + jax.lax.psum(h.sum(), "x"), None

        h, _ = jax.lax.scan(body, x, None, length=5)
        return jax.lax.cond(h.sum() > 0, lambda h: h @ w @ w, lambda h: h, h)

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
    compiled = g.lower(
        jax.ShapeDtypeStruct((64, 32), jnp.float32), jax.ShapeDtypeStruct((32, 32), jnp.float32)
    ).compile()
    cost = auto.hlo_cost(compiled.as_text(), auto.device_spec(), 8)
    one = 2 * 8 * 32 * 32  # one [8, 32] x [32, 32] matmul on a device
    assert cost.matmul_flops == 7 * one
    assert cost.collectives == 5
    assert cost.collective_bytes == 5 * 4
    assert cost.wire_bytes == 5 * 2 * 7 / 8 * 4  # a ring all-reduce over 8 devices
    assert compiled.cost_analysis()["flops"] < 7 * one  # XLA counts the loop body once


def test_matmul_flops_are_the_models_and_micro_batches_do_not_hide_them():
    params = mlp_params()
    rows = 64

    def measured(strategy):
        step = fleetjax.make_train_step(mlp_loss, optax.adam(1e-3), strategy)
        state = step.abstract_init(params)
        compiled = step.lower(state, mlp_batch(rows=rows)).compile()
        return auto.hlo_cost(compiled.as_text(), auto.device_spec(), 8), compiled

    plain, _ = measured(fleetjax.DistributedStrategy())
    # Per device (rows / 8): 4 forward matmuls, 4 weight gradients, 3 input gradients.
    assert plain.matmul_flops == 11 * 2 * (rows // 8) * WIDTH * WIDTH
    assert plain.collective_bytes >= 4 * WIDTH * WIDTH * 4  # the gradient all-reduce
    merged, compiled = measured(
        fleetjax.DistributedStrategy(
            gradient_merge=True, gradient_merge_configs={"k_steps": 2, "mode": "in_step"}
        )
    )
    assert merged.matmul_flops == plain.matmul_flops
    assert compiled.cost_analysis()["flops"] < plain.matmul_flops


# -- choosing ----------------------------------------------------------------------------------


def test_large_budget_picks_pure_data_parallelism():
    found = auto.search(mlp_loss, optax.adam(1e-3), mlp_params(), mlp_batch())
    assert found.degrees == {"dp": 8, "sharding": 1, "pp": 1, "mp": 1}
    assert found.chosen.layout == auto.Layout(8) and found.chosen.index == 1
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert found.memory_budget == host // 8
    assert found.strategy.auto is False and found.strategy.sharding is False
    # Every layout is reported: dp=8 compiled, the nine ZeRO layouts skipped by dominance.
    layouts = [c.layout for c in found.candidates]
    assert len(layouts) == 10 and {c.sharding for c in layouts} == {1, 2, 4, 8}
    assert all(c.note == "#1 fits and costs no more" for c in found.candidates[1:])
    report = str(found)
    for c in found.candidates:
        assert re.search(rf"^\*?{c.index}\s+{re.escape(str(c.layout))}\s", report, re.M)
    assert "chosen: #1 dp=8: pure data parallelism fits" in report


def test_tight_budget_picks_a_plan_that_fits_and_trains_like_one_device():
    budget = 10 * MiB
    params, batches = mlp_params(), [mlp_batch()] * 3  # one batch: the loss must fall
    found = auto.search(mlp_loss, optax.adam(1e-3), params, batches[0], memory_budget=budget)
    pure = found.candidates[0]
    assert pure.layout == auto.Layout(8) and pure.device_bytes > budget
    assert pure.status == "over budget"
    assert found.chosen.fits and found.chosen.device_bytes <= budget
    assert found.chosen.layout.sharding > 1
    # The fastest that fits: no compiled candidate that fits is estimated faster.
    fitting = [c for c in found.candidates if c.fits]
    assert found.chosen.time_s == min(c.time_s for c in fitting)
    assert "pure data parallelism needs 20.0 MiB per device, over the budget" in found.reason

    step = found.make_train_step()
    state, losses = train(step, params, batches)
    assert compiled_bytes(step, state, batches[0]) == found.chosen.device_bytes
    expected_params, expected_losses = one_device(mlp_loss, params, batches, optax.adam(1e-3))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert np.all(np.diff(losses) < 0)
    chex.assert_trees_all_close(
        jax.device_get(state.params), jax.device_get(expected_params), rtol=1e-5, atol=2e-5
    )


def deep_loss(params, batch):
    layer = fleetjax.recompute(lambda w, h: jnp.tanh(h @ w))
    h, _ = jax.lax.scan(lambda h, w: (layer(w, h), None), batch["x"], params["w"])
    return jnp.mean((h - batch["y"]) ** 2)


def test_memory_savers_where_only_the_activations_overflow():
    """Eight scanned layers on 256 rows per device: activations dominate; data parallelism
    is fixed, so the savers decide. Micro-batching costs no extra flops and, reduced once per
    step, no extra communication, so it beats recompute."""
    rng = np.random.RandomState(0)
    params = {"w": rng.randn(8, 128, 128).astype(np.float32) / 12}
    batches = [
        {"x": r.randn(2048, 128).astype(np.float32), "y": r.randn(2048, 128).astype(np.float32)}
        for r in map(np.random.RandomState, (1, 2))
    ]
    strategy = fleetjax.DistributedStrategy(hybrid_configs={"dp_degree": 8})
    found = auto.search(
        deep_loss, optax.sgd(0.1), params, batches[0], strategy=strategy, memory_budget=2.9 * MiB
    )
    base, chosen = found.candidates[0], found.chosen
    assert base.layout == auto.Layout(8) and base.status == "over budget"
    assert base.state_bytes < 2.9 * MiB < base.device_bytes
    assert chosen.layout == auto.Layout(8, micro_batches=8) and chosen.fits
    assert chosen.cost.matmul_flops == base.cost.matmul_flops
    assert chosen.cost.wire_bytes == base.cost.wire_bytes
    recomputed = [c for c in found.candidates if c.layout.recompute]
    assert recomputed and all(c.status == "skipped" for c in recomputed)

    # Recompute alone, when asked for: the forward matmuls run again (8 forward, 8
    # weight-gradient and 8 input-gradient ones, plus 8 recomputed), and it fits too.
    found = auto.search(
        deep_loss,
        optax.sgd(0.1),
        params,
        batches[0],
        strategy=strategy,
        memory_budget=2.9 * MiB,
        candidates=[{"dp": 8}, {"dp": 8, "recompute": True}],
    )
    base, chosen = found.candidates
    assert chosen.layout == auto.Layout(8, recompute=True) and found.chosen is chosen
    assert chosen.cost.matmul_flops == base.cost.matmul_flops * 4 / 3
    assert found.strategy.recompute and found.strategy.recompute_configs["policy"] == (
        "nothing_saveable"
    )
    step = found.make_train_step()
    state, losses = train(step, params, batches)
    assert compiled_bytes(step, state, batches[0]) <= 2.9 * MiB
    _, expected = one_device(deep_loss, params, batches, optax.sgd(0.1))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)


# -- overrides --------------------------------------------------------------------------------


def test_given_candidates_are_exactly_the_ones_compiled():
    zero2 = fleetjax.DistributedStrategy(
        sharding=True,
        sharding_configs={"sharding_degree": 8, "stage": 2},
        hybrid_configs={"dp_degree": 1, "sharding_degree": 8},
    )
    found = auto.search(
        mlp_loss,
        optax.adam(1e-3),
        mlp_params(),
        mlp_batch(),
        memory_budget=10 * MiB,
        candidates=[{"sharding": 8, "stage": 3}, zero2, {"dp": 8}],
    )
    layouts = [c.layout for c in found.candidates]
    assert layouts == [auto.Layout(1, 8, 3), auto.Layout(1, 8, 2), auto.Layout(8)]
    assert all(c.device_bytes is not None for c in found.candidates)
    assert [c.fits for c in found.candidates] == [True, True, False]
    assert found.chosen.layout in layouts[:2]


@pytest.mark.parametrize(
    ("candidate", "message"),
    [
        ({"zero": 2}, "candidates: unknown key 'zero' in {'zero': 2}; keys are dp, sharding"),
        (
            {"dp": 2, "mp": 2},
            "candidates: {'dp': 2, 'mp': 2} does not multiply to the 8 devices "
            "(dp x sharding x mp x pp x cp = 2 x 1 x 2 x 1 x 1)",
        ),
        ({"sharding": 8, "stage": 0}, "has stage=0; ZeRO stages 1, 2 and 3 need sharding > 1"),
    ],
)
def test_bad_candidates_are_named(candidate, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        auto.search(mlp_loss, optax.sgd(0.1), mlp_params(), mlp_batch(), candidates=[candidate])


def test_fixed_degrees_and_the_distributed_optimizers_strategy():
    """`hybrid_configs` degrees stay fixed (they do not turn auto off, as in Paddle); the
    optimizer's strategy is the base every candidate keeps (here AMP)."""
    strategy = fleetjax.DistributedStrategy(
        auto=True, amp=True, hybrid_configs={"sharding_degree": 4}
    )
    optimizer = fleetjax.distributed_optimizer(optax.adam(1e-3), strategy)
    found = auto.search(mlp_loss, optimizer, mlp_params(), mlp_batch())
    assert {(c.layout.dp, c.layout.sharding) for c in found.candidates} == {(2, 4)}
    assert sorted(c.layout.stage for c in found.candidates) == [1, 2, 3]
    assert found.degrees["sharding"] == 4 and found.strategy.sharding
    assert found.strategy.amp and not found.strategy.auto
    assert found.optimizer is optimizer.user


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("budget", [0, -1, float("nan"), float("inf"), True, "1GB"])
def test_memory_budget_must_be_a_positive_number(budget):
    message = f"memory_budget must be a positive number of bytes per device, got {budget!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        auto.search(mlp_loss, optax.sgd(0.1), mlp_params(), mlp_batch(), memory_budget=budget)


def test_nothing_fits_names_the_smallest_candidate_and_the_budget():
    with pytest.raises(ValueError) as error:
        auto.search(mlp_loss, optax.adam(1e-3), mlp_params(), mlp_batch(), memory_budget=MiB)
    message = str(error.value)
    # ZeRO-3 over 8 devices holds an eighth of the parameters, of Adam's moments and of the
    # gradients: 2.0 MiB (and the step counter). No offload: a CPU device's memory is the host's.
    assert message.startswith(
        "no candidate fits the memory budget of 1.0 MiB (1048576 bytes) per device: the "
        "smallest, #10 dp=1 sharding=8 (stage 3), needs at least 2.0 MiB (its state and "
        "gradients) per device."
    )
    assert "offload" not in message and "To simulate" not in message  # 8 devices already
    assert "dp=8" in message and "over budget: its state and gradients alone are" in message


def test_nothing_fits_on_one_cpu_device_says_how_to_simulate_more():
    mlp = (mlp_loss, optax.adam(1e-3), mlp_params(), mlp_batch())
    with pytest.raises(ValueError) as error:
        auto.search(*mlp, memory_budget=MiB, devices=jax.devices()[:1])
    first = str(error.value).splitlines()[0]
    assert first.endswith(
        "Raise memory_budget, use more devices, or shrink the model or batch. The search had 1 "
        "CPU device, and more devices hold less each. To simulate 8 CPU devices, set "
        "JAX_NUM_CPU_DEVICES=8 (or XLA_FLAGS=--xla_force_host_platform_device_count=8) before JAX "
        "starts, e.g. as the first lines of the script: import os; "
        "os.environ['JAX_NUM_CPU_DEVICES'] = '8'."
    ), first


@pytest.mark.parametrize(
    "switch", ["sharding", "pipeline", "tensor_parallel", "recompute", "gradient_merge", "dgc"]
)
def test_auto_with_another_parallel_switch_is_an_error_naming_both(switch):
    strategy = fleetjax.DistributedStrategy(auto=True, **{switch: True})
    with pytest.raises(ValueError, match=rf"^DistributedStrategy.auto=True and {switch}=True: "):
        auto.search(mlp_loss, optax.sgd(0.1), mlp_params(), mlp_batch(), strategy=strategy)


def test_strategy_must_be_a_distributed_strategy():
    with pytest.raises(TypeError, match="strategy must be a fleetjax.DistributedStrategy"):
        auto.search(
            mlp_loss, optax.sgd(0.1), mlp_params(), mlp_batch(), strategy=fleetjax.Strategy()
        )


def test_a_loss_that_is_no_scalar_is_named_before_any_candidate():
    # Was JAX's "Gradient only defined for scalar-output functions" from the cost model's trace.
    def per_row(params, batch):
        return jnp.sum((batch["x"] @ params["w1"]) ** 2, axis=-1)

    message = (
        "the loss must be a floating-point scalar, got float32[16] (with has_aux=False, "
        "has_state=False it returns the loss alone)"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}"):  # JAX adds a note
        auto.search(per_row, optax.sgd(0.1), mlp_params(), mlp_batch(), isolate=False)


def test_device_constants_must_be_positive():
    with pytest.raises(ValueError, match=r"^DeviceSpec.latency must be a positive number"):
        auto.DeviceSpec("mine", 1e12, 1e11, 0.0)
    assert auto.device_spec().name == "XLA:CPU (simulated devices)"


# -- the example GPT ---------------------------------------------------------------------------

KiB = 2**10


@pytest.fixture(scope="module")
def gpt():
    model, params = make_gpt(GPT_CONFIG, seed=0)
    key = jax.random.key(1)
    batches = [
        {"tokens": np.asarray(jax.random.randint(k, (8, 9), 0, GPT_CONFIG.vocab_size))}
        for k in jax.random.split(key, 3)
    ]
    return model, params, batches


def gpt_reference(model, params, batches):
    """The loss curve with everything on one device."""
    one = fleetjax.build_mesh(dp=1, devices=jax.devices()[:1])
    step = fleetjax.make_train_step(
        model.loss_fn, optax.adam(1e-2), fleetjax.DistributedStrategy(), one
    )
    return train(step, params, batches)[1]


def search_gpt(gpt, **options):
    """`auto.search` of the example GPT's loss (Adam) for its first batch, with `options`."""
    model, params, batches = gpt
    return auto.search(
        model.loss_fn,
        optax.adam(1e-2),
        params,
        batches[0],
        param_specs=model.partition_specs(),
        **options,
    )


def check_gpt_search(found, model, params, batches, budget):
    assert found.chosen.fits and found.chosen.device_bytes <= budget
    step = found.make_train_step()
    state, losses = train(step, params, batches)
    assert compiled_bytes(step, state, batches[0]) <= budget
    np.testing.assert_allclose(losses, gpt_reference(model, params, batches), rtol=2e-6)
    assert np.all(np.diff(losses) < 0)


@pytest.mark.slow
def test_gpt_given_candidates_under_a_tight_budget(gpt):
    model, params, batches = gpt
    budget = 350 * KiB
    found = search_gpt(gpt, memory_budget=budget, candidates=[{"dp": 8}, {"mp": 8}])
    pure, tensor = found.candidates
    assert pure.device_bytes > budget and not pure.fits
    assert found.chosen is tensor and found.degrees["mp"] == 8
    check_gpt_search(found, model, params, batches, budget)


@pytest.mark.slow
def test_gpt_search_with_a_large_budget_picks_pure_data_parallelism(gpt):
    found = search_gpt(gpt)
    assert found.degrees == {"dp": 8, "sharding": 1, "pp": 1, "mp": 1}
    assert {c.layout.mp for c in found.candidates} == {1, 2, 4, 8}  # mp: the specs split it


@pytest.mark.slow
def test_gpt_search_with_a_tight_budget_fits_and_trains_like_one_device(gpt):
    model, params, batches = gpt
    budget = 300 * KiB
    found = search_gpt(gpt, memory_budget=budget)
    assert found.candidates[0].device_bytes > budget
    # Pruning keeps planning to a handful of compiles per device-count factor.
    assert sum(c.device_bytes is not None for c in found.candidates) <= 20
    check_gpt_search(found, model, params, batches, budget)


@pytest.mark.slow
def test_gpt_pipeline_layer_adds_pipeline_candidates(gpt):
    model, params, batches = gpt
    layer = PipelineLayer(model.embed, model.stage, model.head_loss)
    specs = model.pipeline_params(model.partition_specs())
    found = auto.search(
        layer,
        optax.adam(1e-2),
        model.pipeline_params(params),
        batches[0],
        param_specs=specs,
        memory_budget=250 * KiB,
    )
    piped = [c for c in found.candidates if c.layout.pp == 2]
    assert piped and all(c.strategy.pipeline for c in piped)
    assert {c.layout.micro_batches for c in piped} >= {2}
    compiled = [c for c in piped if c.cost is not None]
    assert compiled and all(math.isfinite(c.time_s) for c in compiled)
    # The stage is not marked with fleetjax.recompute: the one recompute candidate lowered says
    # so; every other is left uncompiled (pruned before lowering).
    failed = [c for c in found.candidates if c.status == "cannot apply"]
    assert len(failed) == 1 and "marks no layer with fleetjax.recompute" in failed[0].note
    others = [c for c in found.candidates if c.layout.recompute and c is not failed[0]]
    assert others and all(c.device_bytes is None for c in others)
    assert found.chosen.fits and found.chosen.device_bytes <= 250 * KiB


def test_a_sequence_parallel_layout_trains_the_form_it_is_given():
    plain, sequence_parallel = (lambda p, b: 0.0), (lambda p, b: 1.0)
    layout = auto.Layout(4, mp=2, sequence_parallel=True)
    assert layout.loss(plain, sequence_parallel) is sequence_parallel
    assert auto.Layout(4, mp=2).loss(plain, sequence_parallel) is plain
    assert str(layout) == "dp=4 mp=2 sequence-parallel"
    with pytest.raises(ValueError, match=r"pass the model's sequence-parallel form as auto"):
        layout.loss(plain)


@pytest.mark.slow  # 20 s: a search and 3 steps trained; the Layout test above runs by default
def test_layouts_with_mp_train_the_sequence_parallel_form_where_there_is_one(gpt):
    """With the model's sequence-parallel form, a layout with mp > 1 trains it (the report says
    so) and trains like one device (tests/core/test_sequence_axes.py checks its collectives);
    without the form such a layout cannot apply."""
    model, params, batches = gpt
    sequence_parallel, _ = make_gpt(dataclasses.replace(GPT_CONFIG, sequence_parallel=True))
    found = search_gpt(
        gpt,
        candidates=[{"dp": 4, "mp": 2}],
        sequence_parallel=sequence_parallel.loss_fn,
        isolate=False,
    )
    assert found.chosen.layout.sequence_parallel and "mp=2 sequence-parallel" in str(found)
    assert found.make_train_step().loss_fn == sequence_parallel.loss_fn
    check_gpt_search(found, model, params, batches, found.memory_budget)
    with pytest.raises(ValueError, match=r"pass the model's sequence-parallel form as auto"):
        found.chosen.layout.loss(model.loss_fn)  # a sequence-parallel layout, no form


def test_make_train_step_points_to_the_planner():
    strategy = fleetjax.DistributedStrategy(auto=True)
    with pytest.raises(ValueError, match=r"auto=True: the planner needs .*fleetjax\.auto\.search"):
        fleetjax.make_train_step(lambda p, b: jnp.sum(p["w"] * b), optax.sgd(0.1), strategy)


def test_auto_with_another_parallel_switch_names_both():
    strategy = fleetjax.DistributedStrategy(auto=True, sharding=True)
    with pytest.raises(ValueError, match=r"auto=True and sharding=True"):
        fleetjax.read_plan(strategy)  # as fleet.init and make_train_step do


@pytest.mark.slow  # 20 s: four GPT steps at 1024 tokens compiled
def test_a_sequence_too_long_for_every_layout_is_split_over_cp():
    """One sequence of 1024 tokens: neither tensor parallelism nor recompute fits it in 10 MiB
    per device (attention over the whole sequence keeps its [heads, 1024, 1024] probabilities
    for the backward pass: 22.2 MiB under mp=8, 11.7 MiB with recompute); split over cp (ring
    attention, blocks of 1/cp of it) it does (8.3 MiB)."""
    config = dataclasses.replace(GPT_CONFIG, max_position_embeddings=1024, num_hidden_layers=2)
    model, params = make_gpt(config, seed=0)
    found = auto.search(
        model.loss_fn,
        optax.adam(1e-3),
        jax.eval_shape(lambda: params),
        {"tokens": jax.ShapeDtypeStruct((1, 1025), jnp.int32)},
        param_specs=model.partition_specs(),
        memory_budget=10 * MiB,
    )
    others = [c for c in found.candidates if c.layout.cp == 1]
    assert others and not any(c.fits for c in others)
    assert found.degrees == {"dp": 1, "sharding": 1, "pp": 1, "mp": 1, "cp": 8}
    assert found.strategy.hybrid_configs["cp_degree"] == 8
    assert found.chosen.device_bytes <= 10 * MiB
    assert "dp=1 cp=8" in str(found)


# -- compiling in a worker process -----------------------------------------------------------


def test_compiling_in_the_worker_gives_what_compiling_here_gives():
    """`isolate=True` (the default) compiles each candidate in a worker process from the module
    and options jax would compile here: the same bytes, HLO costs and estimates."""
    candidates = [{"dp": 8}, {"sharding": 8, "stage": 3}, {"dp": 2, "sharding": 4, "stage": 2}]
    found = [
        auto.search(
            mlp_loss,
            optax.adam(1e-3),
            mlp_params(),
            mlp_batch(),
            candidates=candidates,
            isolate=isolate,
        )
        for isolate in (True, False)
    ]
    for there, here in zip(*(f.candidates for f in found), strict=True):
        assert there.memory == here.memory
        assert there.device_bytes == here.device_bytes
        assert (there.xla_flops, there.cost, there.time_s) == (
            here.xla_flops,
            here.cost,
            here.time_s,
        )


def zero3_table_loss(params, batch):
    """The rows of `batch["ids"]` in `params["table"]`, each data-parallel replica's looked up in
    a `shard_map` manual over ``dp`` (the planner also traces it once without a mesh, for its
    flops). With the table split over ``mp`` and, by ZeRO-3, ``sharding``, XLA's SPMD
    partitioner aborts the process compiling this gather (a failed check in
    spmd_partitioner_util.cc, jaxlib 0.10.2): the isolation test's candidate that aborts."""

    def rows(table, ids):
        return jnp.mean(jnp.take(table, ids, axis=0) ** 2, keepdims=True)

    if not jax.sharding.get_abstract_mesh().empty:
        rows = jax.shard_map(rows, axis_names={"dp"}, in_specs=(P(), P("dp")), out_specs=P("dp"))
    return jnp.mean(rows(params["table"], batch["ids"]))


def test_a_candidate_xla_aborts_on_fails_with_xlas_message_and_the_search_goes_on():
    found = auto.search(
        zero3_table_loss,
        optax.sgd(0.1),
        {"table": jnp.zeros((512, 64))},
        {"ids": jnp.zeros((16, 4), jnp.int32)},
        param_specs={"table": P("mp", None)},
        candidates=[
            {"dp": 2, "sharding": 2, "stage": 3, "mp": 2},  # aborts XLA
            {"dp": 2, "sharding": 2, "stage": 1, "mp": 2},  # compiles (a new worker)
        ],
    )
    aborted, fine = found.candidates
    assert aborted.status == "failed" and aborted.device_bytes is None
    assert re.match(
        r"XLA aborted compiling it \(killed by SIGABRT\) at spmd_partitioner_util\.cc:\d+: "
        r"Check failed: ",
        aborted.note,
    )
    assert "failed: XLA aborted compiling it (killed by SIGABRT) at spmd_partitioner" in str(found)
    assert found.chosen is fine and fine.fits


@pytest.mark.parametrize(
    ("h100", "layout", "width"),
    [
        pytest.param(False, {"sharding": 2, "stage": 3, "pp": 2, "mp": 2}, 32, id="8-cpu"),
        pytest.param(
            True,
            {"sharding": 16, "stage": 3, "pp": 8, "mp": 8},
            1024,
            marks=[pytest.mark.slow, needs_plugin],
            id="1024-h100",
        ),
    ],
)
def test_a_gpt_with_a_jnp_take_embedding_compiles_under_zero3_pp_and_mp(h100, layout, width):
    """Issue 21's abort: a GPT whose embedding is a plain `jnp.take` of its table (not
    `VocabParallelEmbedding`; the example GPT's aborted alike), ZeRO-3 x pp x mp with recompute
    and pp micro-batches. XLA's partitioner aborted on the lookup inside the pipeline; the
    pipeline now gathers the embedding's ZeRO-3 split first, and the step compiles (isolated,
    so that a regression fails this test instead of ending the run)."""
    from flax import nnx
    from gpt import GPT, GPTConfig, GPTFunctions

    pp = layout["pp"]
    config = GPTConfig(GPT_CONFIG.vocab_size * 8, 8, width, 8, pp, 4 * width)
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    gpt, params = GPTFunctions(model), nnx.to_pure_dict(nnx.state(model))

    def take_embed(p, batch):
        tokens = batch["tokens"][:, :-1]
        words = jnp.take(p["word_embeddings"]["weight"], tokens, axis=0)
        return words + p["position_embeddings"][: tokens.shape[-1]]

    rows = layout["sharding"] * pp  # one row per micro-batch
    devices = math.prod(layout[a] for a in ("sharding", "pp", "mp"))
    found = auto.search(
        PipelineLayer(take_embed, fleetjax.recompute(gpt.stage), gpt.head_loss),
        optax.adam(1e-4),
        gpt.pipeline_params(params),
        {"tokens": jax.ShapeDtypeStruct((rows, 9), jnp.int32)},
        param_specs=gpt.pipeline_params(gpt.partition_specs()),
        candidates=[{**layout, "recompute": True, "micro_batches": pp}],
        devices=targets.devices("h100", devices) if h100 else None,
        memory_budget=2**40,
    )
    (candidate,) = found.candidates
    assert candidate.status == "fits", candidate.note
    assert candidate.layout.stage == 3 and candidate.strategy.pipeline
