"""What fleetjax says when a setting does less than it seems: a one-stage pipeline, a removed
name, and where its warnings point (the user's line)."""

import warnings

import jax.numpy as jnp
import optax
import pytest

import fleetjax
from fleetjax import StrategyWarning, optimizers


def one_stage_pipeline():
    """Seed 002's Strategy example: a pipeline, no pp_degree."""
    s = fleetjax.Strategy()
    s.pipeline.enable = True
    s.pipeline.micro_batch_size = 2
    return s


@pytest.mark.parametrize(
    ("strategy", "field"),
    [
        (one_stage_pipeline, "Strategy.pipeline.pp_degree"),
        (
            lambda: fleetjax.DistributedStrategy(pipeline=True),
            r'DistributedStrategy.hybrid_configs\["pp_degree"\]',
        ),
    ],
)
def test_a_pipeline_without_pp_degree_warns_once_naming_it(strategy, field):
    message = rf"{field} is 1 \(not set\): the pipeline has one stage"
    with pytest.warns(StrategyWarning, match=message) as w:
        fleetjax.distributed_optimizer(optax.sgd(0.1), strategy())
        fleetjax.distributed_optimizer(optax.sgd(0.1), strategy())
    assert len(w) == 1 and w[0].filename == __file__


def test_a_pipeline_on_a_mesh_with_a_pp_axis_says_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mesh = fleetjax.build_mesh(dp=2, sharding=2, pp=2)  # as seed 002's script passes it
        fleetjax.distributed_optimizer(optax.sgd(0.1), one_stage_pipeline(), mesh)
        s = one_stage_pipeline()
        s.pipeline.pp_degree = 2
        fleetjax.distributed_optimizer(optax.sgd(0.1), s)


def test_warnings_point_at_the_users_line():
    with pytest.warns(StrategyWarning) as w:
        strategy = fleetjax.DistributedStrategy(nccl_comm_num=2)
        fleetjax.make_train_step(lambda p, b: jnp.mean(b @ p), optax.sgd(0.1), strategy)
        optimizers.Adam(learning_rate=0.1, parameters=[])
    assert len(w) == 2 and [record.filename for record in w] == [__file__] * 2
    assert [record.lineno for record in w] == [
        test_warnings_point_at_the_users_line.__code__.co_firstlineno + n for n in (3, 4)
    ]


@pytest.mark.parametrize("strategy", [fleetjax.DistributedStrategy, fleetjax.Strategy])
def test_a_removed_name_points_to_its_replacement(strategy):
    with pytest.raises(AttributeError, match=r"'explain' is not a field of .*Strategy: strategy"):
        strategy().explain()
    with pytest.raises(AttributeError, match=r"print\(fleetjax.applied_strategy\(strategy\)\)"):
        strategy().explain()


@pytest.mark.parametrize(
    ("assign", "message"),
    [
        (
            lambda s: setattr(s, "mp_configs", {"sync_param": True}),
            "'mp_configs' is not a field of DistributedStrategy: it is a key of hybrid_configs "
            "(strategy.hybrid_configs['mp_configs'] = ...). Valid names: mode, ",
        ),
        (
            lambda s: setattr(s, "sep_degree", 2),
            "'sep_degree' is not a field of DistributedStrategy: it is a key of hybrid_configs "
            "(strategy.hybrid_configs['sep_degree'] = ...). Valid names: ",
        ),
        (
            lambda s: s.hybrid_configs.update(sync_param=True),
            "'sync_param' is not a field of hybrid_configs: it is a key of mp_configs and "
            "pp_configs (hybrid_configs['mp_configs']['sync_param'] = ...). Valid names: ",
        ),
    ],
)
def test_a_key_set_one_level_too_high_says_where_it_lives(assign, message):
    s = fleetjax.DistributedStrategy()
    with pytest.raises(fleetjax.UnknownFieldError) as error:
        assign(s)
    assert str(error.value).startswith(message)
    s.hybrid_configs["mp_configs"] = {"sync_param": True}  # where the message says
    s.hybrid_configs["sep_degree"] = 2
    assert s.hybrid_configs["mp_configs"]["sync_param"] and s.hybrid_configs["sep_degree"] == 2


def test_a_typo_still_gets_did_you_mean():
    with pytest.raises(fleetjax.UnknownFieldError, match=r"\(did you mean 'amp_configs'\?\)"):
        fleetjax.DistributedStrategy().amp_config = {}
