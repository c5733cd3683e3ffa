"""`place()` alone: a plan, a mesh and a state's shapes give the placement (nothing runs, no
train step is made)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fleetjax
from fleetjax import Plan
from fleetjax.mesh import build_mesh
from fleetjax.placement import place
from fleetjax.plan import Degrees

PARAMS = {
    "w": jax.ShapeDtypeStruct((128, 64), jnp.float32),
    "b": jax.ShapeDtypeStruct((64,), jnp.float32),
}


def abstract_state(optimizer, params=PARAMS, stacked=0):
    """The state's shapes, as a train step makes them (stacked per replica if `stacked`)."""

    def make():
        per = lambda tree: jax.tree.map(lambda x: jnp.broadcast_to(x, (stacked, *x.shape)), tree)  # noqa: E731
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
        opt_state = optimizer.init(zeros)
        return fleetjax.TrainState(
            jnp.zeros((), jnp.int32),
            per(zeros) if stacked else zeros,
            per(opt_state) if stacked else opt_state,
            jax.random.PRNGKey(0),
        )

    return jax.eval_shape(make)


def specs(tree):
    return jax.tree.map(lambda s: s.spec, tree)


def test_data_parallel_replicates_the_state_and_splits_the_batch():
    mesh, tx = build_mesh(dp=8), optax.adam(1e-3)
    placement = place(Plan(), mesh, abstract_state(tx), tx)
    assert specs(placement.params) == {"w": P(), "b": P()}
    assert specs(placement.grads) == {"w": P(), "b": P()}
    assert placement.batch.spec == P(("dp", "sharding"))
    assert all(s == P() for s in jax.tree.leaves(specs(placement.opt_state)))


@pytest.mark.parametrize(
    ("stage", "params", "grads", "moments"),
    [
        (1, P(), P(), P("sharding", None)),
        (2, P(), P("sharding", None), P("sharding", None)),
        (3, P("sharding", None), P("sharding", None), P("sharding", None)),
    ],
)
def test_each_zero_stage_splits_one_more_part(stage, params, grads, moments):
    mesh, tx = build_mesh(sharding=8), optax.adam(1e-3)
    plan = Plan(degrees=Degrees(dp=1, sharding=8), sharding_stage=stage)
    placement = place(plan, mesh, abstract_state(tx), tx)
    assert placement.params["w"].spec == params
    assert placement.grads["w"].spec == grads
    assert placement.opt_state[0].mu["w"].spec == moments
    assert placement.opt_state[0].mu["b"].spec == P()  # under ZERO_MIN_ELEMENTS: whole
    assert placement.opt_state[0].count.spec == P()
    assert placement.scattered == (stage >= 2) and not placement.per_replica


def test_gradients_are_scattered_only_over_a_sharding_axis_with_devices():
    mesh, tx = build_mesh(dp=8), optax.adam(1e-3)
    placement = place(Plan(sharding_stage=2), mesh, abstract_state(tx), tx)
    assert not placement.scattered and placement.grads["w"].spec == P()


def test_an_offloaded_optimizer_state_is_fetched_to_the_device_for_the_update():
    mesh, tx = build_mesh(sharding=8), optax.adam(1e-3)
    plan = Plan(degrees=Degrees(dp=1, sharding=8), sharding_stage=1, optimizer_offload=True)
    placement = place(plan, mesh, abstract_state(tx), tx)
    assert placement.opt_state[0].mu["w"].memory_kind == "pinned_host"
    assert placement.opt_state_in_update[0].mu["w"].memory_kind == "device"
    assert placement.params["w"].memory_kind == "device"


def test_a_per_replica_optimizer_stacks_its_state_on_the_replicas():
    s = fleetjax.DistributedStrategy(localsgd=True)
    plan, mesh, tx = fleetjax.read_plan(s), build_mesh(dp=8), optax.sgd(0.1)
    placement = place(plan, mesh, abstract_state(tx, stacked=8), tx)
    assert placement.grads is None  # each replica keeps its own
    assert placement.params["w"].spec == P(("dp", "sharding"))
    assert all(s.spec == P(("dp", "sharding")) for s in jax.tree.leaves(placement.opt_state))
    assert placement.stacked == fleetjax.TrainState(False, True, True, False, False, False)
    assert placement.replicas == 8 and not placement.scattered
    # One replica's state places the same: the placement does not read the stacked axis.
    assert place(plan, mesh, abstract_state(tx), tx) == placement


def test_dgc_stacks_its_state_but_not_the_parameters():
    s = fleetjax.DistributedStrategy(dgc=True)
    plan, mesh, tx = fleetjax.read_plan(s), build_mesh(dp=8), fleetjax.optimizers.momentum(0.1)
    placement = place(plan, mesh, abstract_state(tx, stacked=8), tx)
    assert placement.stacked == fleetjax.TrainState(False, False, True, False, False, False)
    assert placement.params["w"].spec == P()


def pipeline_state(tx, layers):
    params = fleetjax.PipelineParams(
        embed={"w": jax.ShapeDtypeStruct((16, 16), jnp.float32)},
        layers={"w": jax.ShapeDtypeStruct((layers, 16, 16), jnp.float32)},
        head={"w": jax.ShapeDtypeStruct((16, 4), jnp.float32)},
    )
    return abstract_state(tx, params)


def test_a_pipeline_keeps_its_stage_order_and_scatters_under_any_zero_stage():
    mesh, tx = build_mesh(dp=1, sharding=2, pp=4), optax.adam(1e-3)
    pipeline = fleetjax.plan.Pipeline("VPP", 1, 8, 2)
    plan = Plan(degrees=Degrees(dp=1, sharding=2, pp=4), pipeline=pipeline, sharding_stage=1)
    placement = place(plan, mesh, pipeline_state(tx, 8), tx)
    assert placement.stage_order == fleetjax.placement.StageOrder(stages=4, vpp=2)
    assert placement.params.layers["w"].spec == P("pp")
    assert placement.scattered
    with pytest.raises(ValueError, match=r"6 layers, which do not split into .* 4 x 2"):
        place(plan, mesh, pipeline_state(tx, 6), tx)


def test_tensor_parallel_follows_param_specs_and_needs_an_mp_split():
    mesh, tx = build_mesh(dp=4, mp=2), optax.sgd(0.1)
    plan = Plan(degrees=Degrees(dp=4, mp=2))
    split = {"w": P(None, "mp"), "b": P("mp")}
    placement = place(plan, mesh, abstract_state(tx), tx, param_specs=split)
    assert specs(placement.params) == split
    with pytest.raises(ValueError, match="no parameter is split over it"):
        place(plan, mesh, abstract_state(tx), tx)


def test_placing_runs_nothing():
    """Shapes alone: placing a 16 GiB parameter allocates nothing."""
    big = {"w": jax.ShapeDtypeStruct((1 << 20, 1 << 12), jnp.float32)}
    mesh, tx = build_mesh(sharding=8), optax.adam(1e-3)
    plan = Plan(degrees=Degrees(dp=1, sharding=8), sharding_stage=3)
    placement = place(plan, mesh, abstract_state(tx, big), tx)
    assert placement.params["w"].shard_shape((1 << 20, 1 << 12)) == (1 << 17, 1 << 12)
