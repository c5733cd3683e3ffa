"""`read_plan` alone: each strategy reads into plain values (no mesh, no step, nothing runs), the
same `Plan` from both of Paddle's strategy classes where they ask for the same."""

import warnings

import jax.numpy as jnp
import pytest

import fleetjax
from fleetjax import Plan, read_plan
from fleetjax.plan import Degrees, GradientMerge, NoEffect, OptimizerSwitch, Pipeline, Recompute
from fleetjax.transforms import amp

DS = fleetjax.DistributedStrategy


def test_the_default_strategies_are_the_default_plan():
    runs = DS().execution_strategy.num_iteration_per_run  # Paddle's ExecutionStrategy's
    assert read_plan(DS()) == Plan(sync_batch_norm=False, iterations_per_run=runs)
    assert read_plan(fleetjax.Strategy()) == Plan(strategy="Strategy")


def test_a_hybrid_strategy_reads_into_values():
    plan = read_plan(
        DS(
            hybrid_configs={"dp_degree": 2, "mp_degree": 2, "pp_degree": 2},
            pipeline_configs={"accumulate_steps": 4, "micro_batch_size": 2},
            recompute=True,
            recompute_configs={"checkpoints": ["hidden"]},
            amp=True,
            amp_configs={"use_pure_bf16": True},
        )
    )
    assert plan.degrees == Degrees(dp=2, sharding=1, pp=2, mp=2)
    assert set(plan.set_degrees) == {"dp", "mp", "pp"}
    assert plan.pipeline == Pipeline("1F1B", 2, 4, 0)
    assert plan.recompute == Recompute(("hidden",), None, False, ())
    assert plan.amp.policy == amp.policy("bfloat16", "O2")
    assert plan.amp.loss_scaling is None  # bfloat16 needs none unless asked for
    assert plan.gradient_merge is None and plan.optimizer is None


def test_both_strategy_classes_read_into_the_same_transforms():
    fleet = read_plan(
        DS(
            gradient_merge=True,
            gradient_merge_configs={"k_steps": 4, "mode": "in_step"},
            sharding=True,
            sharding_configs={"stage": 2, "sharding_degree": 8},
        )
    )
    auto = read_plan(
        fleetjax.Strategy(
            {
                "gradient_merge": {"enable": True, "k_steps": 4, "mode": "in_step"},
                "sharding": {"enable": True, "stage": 2, "degree": 8},
            }
        )
    )
    assert fleet.gradient_merge == auto.gradient_merge == GradientMerge(4, True, True)
    assert fleet.in_step_merge == fleet.gradient_merge
    assert fleet.sharding_stage == auto.sharding_stage == 2
    assert fleet.degrees.sharding == auto.degrees.sharding == 8


def test_an_optimizer_switch_is_a_row_of_the_table():
    plan = read_plan(DS(dgc=True, dgc_configs={"rampup_begin_step": 5}))
    assert (
        plan.optimizer.name == "dgc" and plan.optimizer.row is fleetjax.optimizers.SWITCHES["dgc"]
    )
    assert plan.optimizer.configs["rampup_begin_step"] == 5
    assert plan.per_replica and not plan.replica_params
    assert plan.switches == {"dgc": "dgc"}
    s = DS()
    s.a_sync = True
    s.a_sync_configs = {"k_steps": 4}
    geo = read_plan(s)
    assert geo.optimizer == OptimizerSwitch("geo", {"k_steps": 4})
    assert geo.parameter_server.geo_k_steps == 4
    assert geo.per_replica and geo.replica_params


def test_what_the_plan_replaces_is_listed_without_effect():
    s = DS(
        fp16_allreduce=True,
        sharding=True,
        sharding_configs={"sharding_degree": 8},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = read_plan(s)
    assert plan.allreduce_dtype is None  # Paddle turns it off under sharding
    assert [n.knob for n in plan.no_effect] == ["fp16_allreduce=True"]
    assert isinstance(plan.no_effect[0], NoEffect)
    assert any("fp16_allreduce=True has no effect" in str(w.message) for w in caught)


def test_in_step_merge_under_a_pipeline_is_its_accumulation():
    plan = read_plan(
        fleetjax.Strategy(
            {
                "pipeline": {"enable": True, "pp_degree": 2},
                "gradient_merge": {"enable": True, "k_steps": 4, "mode": "in_step"},
            }
        )
    )
    assert plan.pipeline.accumulate_steps == 4
    assert plan.gradient_merge.avg


def test_reading_refuses_what_it_cannot_apply():
    with pytest.raises(TypeError, match="strategy must be a fleetjax.DistributedStrategy"):
        read_plan({"amp": True})
    with pytest.raises(NotImplementedError, match="2:4 structured sparsity"):
        read_plan(DS(asp=True))
    with pytest.raises(ValueError, match="init_loss_scaling"):
        read_plan(DS(amp=True, amp_configs={"init_loss_scaling": float(jnp.inf)}))
