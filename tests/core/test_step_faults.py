"""Bad state, bad inputs and bad settings: each a clear error (or a warning) before anything runs,
naming the leaf, field or number (issue 16's step and input cases)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fleetjax
from fleetjax.transforms.pipeline import PipelineLayer, PipelineParams

DS = fleetjax.DistributedStrategy


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def make_params(width=4):
    return {"w": jnp.ones((width, 1), jnp.float32)}


def make_batch(rows=16, width=4):
    rng = np.random.default_rng(0)
    return {
        "x": rng.normal(size=(rows, width)).astype(np.float32),
        "y": rng.normal(size=(rows, 1)).astype(np.float32),
    }


def step_for(strategy=None, optimizer=None, **kw):
    return fleetjax.make_train_step(loss_fn, optimizer or optax.sgd(0.1), strategy, **kw)


# -- the state ------------------------------------------------------------------------------------


def test_a_donated_state_is_refused_not_a_crash():
    step = step_for()
    state = step.init(make_params())
    step(state, make_batch())  # donates `state`
    with pytest.raises(ValueError, match=r"state.step was donated to an earlier call"):
        step(state, make_batch())


def test_the_state_the_step_returned_goes_on():
    step = step_for()
    state = step.init(make_params())
    for _ in range(3):
        state, metrics = step(state, make_batch())
    assert np.isfinite(float(metrics["loss"]))


def test_a_state_from_another_optimizer_names_the_difference():
    adam = step_for(optimizer=optax.adam(1e-3)).init(make_params())
    step = step_for()
    step.init(make_params())
    with pytest.raises(ValueError, match="does not fit the step .another optimizer"):
        step(adam, make_batch())


def test_a_state_from_another_optimizer_on_the_first_call():
    momentum = step_for(optimizer=optax.sgd(0.1, momentum=0.9)).init(make_params())
    with pytest.raises(
        ValueError,
        match=r"^the state's optimizer state was made by another optimizer \(its TraceState, "
        r"EmptyState, this step's optimizer makes ScaleByAdamState, EmptyState\): pass a state "
        "that this step's init made",
    ):
        step_for(optimizer=optax.adam(1e-3))(momentum, make_batch())


@pytest.mark.parametrize(
    "optimizer",
    [
        optax.multi_transform({"a": optax.sgd(0.1), "b": optax.adam(0.1)}, {"w": "a"}),
        optax.adamw(0.1, mask={"w": True}),
    ],
    ids=["multi_transform labels", "weight-decay mask"],
)
def test_an_optimizer_tree_unlike_the_params_names_them(optimizer):
    params = {"w": jnp.ones((4, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}
    with pytest.raises(
        ValueError,
        match=r"^the optimizer does not fit the parameters: a tree it was given \(an optax "
        r"multi_transform's param_labels, a weight-decay mask\) must have the parameters' tree "
        r"\(params\['b'\], params\['w'\]\)\. JAX: pytree structure error: .* symmetric "
        "difference on key sets is b",
    ):
        step_for(optimizer=optimizer).init(params)


def test_param_specs_that_lack_a_parameter_or_name_none():
    from jax.sharding import PartitionSpec as P

    params = {"w": jnp.ones((4, 1), jnp.float32), "b": jnp.zeros((1,), jnp.float32)}
    with pytest.raises(
        ValueError,
        match=r"^param_specs must give a PartitionSpec for each parameter \(params\['b'\], "
        r"params\['w'\]\): no spec for params\['b'\]; param_specs\['v'\] names no parameter$",
    ):
        step_for(param_specs={"w": P(), "v": P()}).init(params)


def test_a_state_of_another_model_names_the_leaf():
    other = step_for().init(make_params(width=4))
    step = step_for()
    step.init({"w": jnp.ones((4, 2), jnp.float32)})
    with pytest.raises(ValueError, match=r"state.params\['w'\] is float32\[4, 1\], but the step's"):
        step(other, make_batch())


def test_a_state_placed_for_another_zero_stage_is_refused():
    zero3 = DS(sharding=True, sharding_configs={"stage": 3, "sharding_degree": 8})
    params = {"w": jnp.ones((4096, 2), jnp.float32)}
    plain_state = step_for().init(params)
    step = step_for(zero3)
    step.init(params)
    with pytest.raises(
        ValueError, match=r"state.params\['w'\] is placed as .*another mesh or ZeRO"
    ):
        step(plain_state, make_batch(width=4096))


# -- the loss and the parameters ------------------------------------------------------------------


def test_has_aux_with_a_scalar_loss_says_what_to_return():
    step = step_for(has_aux=True)
    with pytest.raises(TypeError, match=r"has_aux=True, has_state=False the loss must return "
                                       r"\(loss, aux_dict\), got float32\[\]"):  # fmt: skip
        step(step.init(make_params()), make_batch())


def test_has_aux_with_an_aux_that_is_not_a_dict_says_what_to_return():
    step = fleetjax.make_train_step(lambda p, b: (loss_fn(p, b), 1.0), optax.sgd(0.1), has_aux=True)
    with pytest.raises(
        TypeError,
        match=r"^with has_aux=True the loss must return \(loss, aux_dict\), a dict of metrics by "
        r"name, but its aux is float: return e.g. \(loss, \{'accuracy': acc\}\)",
    ):
        step(step.init(make_params()), make_batch())


def test_a_loss_that_is_not_a_scalar_is_named():
    step = fleetjax.make_train_step(lambda p, b: b["x"] @ p["w"], optax.sgd(0.1))
    with pytest.raises(
        TypeError, match=r"the loss must be a floating-point scalar, got float32\[16, 1\]"
    ):
        step(step.init(make_params()), make_batch())


def test_an_integer_parameter_is_named():
    step = step_for()
    with pytest.raises(TypeError, match=r"params\['count'\] is int32; parameters must be floating"):
        step.init({**make_params(), "count": jnp.zeros((), jnp.int32)})


# -- the batch ------------------------------------------------------------------------------------


def test_a_string_batch_leaf_is_named():
    step = step_for()
    state = step.init(make_params())
    batch = {**make_batch(), "name": np.array(["a"] * 16)}
    with pytest.raises(TypeError, match=r"batch\['name'\] has dtype <U1; batch leaves must be"):
        step(state, batch)


def test_an_empty_batch_is_refused_not_nan():
    step = step_for()
    with pytest.raises(ValueError, match=r"batch\['x'\] has 0 rows"):
        step(step.init(make_params()), make_batch(rows=0))


def test_many_batch_shapes_warn_once_that_each_compiles():
    step = step_for()
    state = step.init(make_params())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (8, 16, 24, 32, 8):
            state, _ = step(state, make_batch(rows=rows))
    messages = [str(w.message) for w in caught if w.category is fleetjax.StrategyWarning]
    assert messages == [
        "the train step compiled for 3 batch shapes and dtypes ((float32[16,4], float32[16,1]), "
        "(float32[24,4], float32[24,1]), (float32[8,4], float32[8,1])): each new shape compiles "
        "it again; pad batches to one shape (or drop the last partial batch)"
    ]


def test_batches_of_new_dtypes_warn_naming_the_dtypes():
    step = step_for()
    state = step.init(make_params())
    batch = make_batch(rows=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for dtype in ("float32", "float16", "int32"):
            typed = {"x": batch["x"].astype(dtype), "y": batch["y"]}
            state, _ = step(state, typed)
    messages = [str(w.message) for w in caught if w.category is fleetjax.StrategyWarning]
    assert messages == [
        "the train step compiled for 3 batch shapes and dtypes ((float16[8,4], float32[8,1]), "
        "(float32[8,4], float32[8,1]), (int32[8,4], float32[8,1])): each new dtype compiles it "
        "again; give each input one dtype (np.asarray(x, dtype=...))"
    ]


# -- settings -------------------------------------------------------------------------------------


def test_zero3_says_which_large_tensor_stays_whole():
    zero3 = DS(sharding=True, sharding_configs={"stage": 3, "sharding_degree": 8})
    step = step_for(zero3)
    with pytest.warns(
        fleetjax.StrategyWarning,
        match=r"ZeRO stage 3: params\['w'\] \[4099, 3\] has no dimension that splits over "
        r"sharding=8",
    ):
        step.abstract_init({"w": jax.ShapeDtypeStruct((4099, 3), jnp.float32)})


@pytest.mark.parametrize("scale", [float("inf"), 1e308])  # <= 0 the schema refuses already
def test_an_unusable_initial_loss_scale_is_refused(scale):
    with pytest.raises(ValueError, match=r"amp_configs.init_loss_scaling=.*positive float32"):
        fleetjax.read_plan(DS(amp=True, amp_configs={"init_loss_scaling": scale}))


def test_pipeline_layers_that_do_not_split_get_the_librarys_message():
    strategy = DS(
        pipeline=True,
        hybrid_configs={"pp_degree": 2, "dp_degree": 4},
        pipeline_configs={"accumulate_steps": 2, "micro_batch_size": 2},
    )
    model = PipelineLayer(
        embed=lambda _, b: b["x"],
        stage=lambda w, h: jnp.tanh(h @ w),
        head_loss=lambda w, h, b: jnp.mean((h @ w - b["y"]) ** 2),
    )
    params = PipelineParams(None, jnp.ones((3, 4, 4)), jnp.ones((4, 1)))
    step = fleetjax.make_train_step(model, optax.sgd(0.1), strategy)
    with pytest.raises(ValueError, match="params.layers has 3 layers, which do not split into "
                                         "pp_degree x vpp_degree = 2 x 1"):  # fmt: skip
        step.init(params)
