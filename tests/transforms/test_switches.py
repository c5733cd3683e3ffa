"""The table of switches (`fleetjax.optimizers.SWITCHES`, `STEP_SWITCHES`): every switch, and
every pair of switches, either reads into a plan that `applied_strategy` describes in full, or
is refused naming both, as the table says."""

import itertools
import warnings

import pytest

import fleetjax
from fleetjax import optimizers as opt
from fleetjax.plan import OPTIMIZER_SWITCHES, PLANNED_SWITCHES, read_plan

# How a strategy turns each switch on (in this order: assigning a_sync resets its k_steps), and
# the feature `applied_strategy` lists for it.
SETTINGS = {
    # An optimizer switch with a flag is turned on by it (a new one needs nothing here).
    **{name: ({name: True}, "optimizer") for name, s in opt.SWITCHES.items() if s.flag},
    "geo": ({"a_sync": True, "a_sync_configs": {"k_steps": 4}}, "optimizer"),
    "sharding": ({"sharding": True, "sharding_configs": {"sharding_degree": 2}}, "sharding"),
    "sharding_stage_2": (
        {"sharding": True, "sharding_configs": {"sharding_degree": 2, "stage": 2}},
        "sharding",
    ),
    "pipeline": ({"pipeline": True, "hybrid_configs": {"pp_degree": 2}}, "pipeline"),
    "fp16_allreduce": ({"fp16_allreduce": True}, "fp16 allreduce"),
    "use_hierarchical_allreduce": ({"use_hierarchical_allreduce": True}, "hierarchical allreduce"),
    "merge_across_calls": (
        {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}},
        "gradient merge",
    ),
    # Step switches that clash with none.
    "merge_in_step": (
        {"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2, "mode": "in_step"}},
        "gradient merge",
    ),
    "amp": ({"amp": True}, "amp"),
    "recompute": (
        {"recompute": True, "recompute_configs": {"policy": "nothing_saveable"}},
        "recompute",
    ),
    "tensor_parallel": ({"hybrid_configs": {"mp_degree": 2}}, "tensor parallel"),
    "sync_batch_norm": ({"sync_batch_norm": True}, "sync batch norm"),
}
# What else a switch turns on.
IMPLIES = {"sharding_stage_2": {"sharding"}}
MODEL_SWITCHES = {"sparse_tables", "host_tables"}  # known once a model is seen: test_sparse_tables


def _merged(*names):
    fields = {}
    for name in names:
        for key, value in SETTINGS[name][0].items():
            if isinstance(value, dict):
                fields[key] = {**fields.get(key, {}), **value}
            else:
                fields[key] = value
    strategy = fleetjax.DistributedStrategy()
    for key, value in fields.items():
        setattr(strategy, key, value)
    return strategy


def _on(names):
    return set(names).union(*(IMPLIES.get(n, set()) for n in names))


def _labels(names):
    geo_configs = SETTINGS["geo"][0]["a_sync_configs"]  # the one label with a setting in it
    switches = opt.STEP_SWITCHES | {
        n: s.label.format(**geo_configs) for n, s in opt.SWITCHES.items()
    }
    return {name: switches[name] for name in _on(names) if name in switches}


def _refusal(names):
    """The table's refusal of these switches together, or None."""
    try:
        opt.check_combination(_labels(names))
    except ValueError as e:
        return str(e)
    return None


def test_the_settings_cover_every_switch_of_the_table():
    assert set(opt.SWITCHES) | set(opt.STEP_SWITCHES) - MODEL_SWITCHES <= set(SETTINGS)
    flags = tuple(n for n, s in opt.SWITCHES.items() if s.flag)
    assert flags == OPTIMIZER_SWITCHES
    assert {"dgc", "localsgd", "adaptive_localsgd"} <= set(PLANNED_SWITCHES)


def _applied(names):
    with warnings.catch_warnings():  # settings without effect warn (fp16_allreduce under ZeRO)
        warnings.simplefilter("ignore", fleetjax.StrategyWarning)
        return fleetjax.applied_strategy(_merged(*names))


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_switch_alone_is_applied_and_described(name):
    report = _applied([name])
    features = dict(report.applied)
    assert SETTINGS[name][1] in features
    if name in opt.SWITCHES:
        row = opt.SWITCHES[name]
        assert report.plan.optimizer.name == name
        assert features["optimizer"].startswith(f"{row.what}: {row.configs} ")


def test_geo_sgd_is_described():
    """It raised KeyError: 'geo' (the switch's facts were in seven places; one forgot it)."""
    s = fleetjax.DistributedStrategy()
    s.a_sync = True
    s.a_sync_configs = {"k_steps": 4}
    how = dict(fleetjax.applied_strategy(s).applied)
    assert how["optimizer"] == (
        "each replica trains its own parameters and, every k_steps steps, exchanges their "
        "changes (Geo-SGD): a_sync_configs {'k_steps': 4}"
    )
    assert "each replica computes its own gradient" in how["data parallel"]


PAIRS = list(itertools.combinations(sorted(SETTINGS), 2))


@pytest.mark.parametrize("pair", PAIRS, ids="+".join)
def test_every_pair_is_applied_or_refused_as_the_table_says(pair):
    refusal = _refusal(pair)
    optimizers = [n for n in pair if n in opt.SWITCHES]
    if len(optimizers) == 2:  # Paddle applies one optimizer switch (its own message)
        with pytest.raises(ValueError, match="cannot be combined|applies at most one"):
            _applied(pair)
        return
    if refusal is not None:
        with pytest.raises(ValueError) as raised:
            _applied(pair)
        assert str(raised.value) == refusal
        return
    report = _applied(pair)
    features = dict(report.applied)
    for name in pair:
        feature = SETTINGS[name][1]
        turned_off = any(name in i.knob for i in report.ignored)  # fp16_allreduce under ZeRO
        assert feature in features or turned_off, (name, features)


def test_the_table_refuses_what_paddle_cannot_combine():
    expected = {
        ("sharding", "dgc"): "ZeRO sharding does not combine with dgc: it keeps per-replica",
        ("pipeline", "geo"): "the pipeline does not combine with Geo-SGD (a_sync=True, a_sync",
        ("fp16_allreduce", "localsgd"): "fp16_allreduce does not combine with localsgd",
        ("use_hierarchical_allreduce", "sharding_stage_2"): (
            "use_hierarchical_allreduce does not combine with ZeRO stage 2/3"
        ),
        ("sparse_tables", "merge_across_calls"): (
            "a model with sparse tables does not combine with gradient merge across calls"
        ),
        ("host_tables", "geo"): "a sparse table in pinned host memory does not combine with Geo",
    }
    for pair, message in expected.items():
        assert _refusal(pair).startswith(message), pair
    for allowed in [("sparse_tables", "geo"), ("sharding", "lars"), ("pipeline", "lamb")]:
        assert _refusal(allowed) is None, allowed


def test_the_plan_names_the_switches_on():
    s = _merged("sharding_stage_2", "geo", "use_hierarchical_allreduce")
    with pytest.raises(ValueError, match="use_hierarchical_allreduce does not combine with ZeRO"):
        read_plan(s)
    plan = read_plan(_merged("pipeline", "merge_across_calls", "lamb"))
    assert plan.switches == {
        "pipeline": "the pipeline",
        "merge_across_calls": "gradient merge across calls",
        "lamb": "lamb",
    }
