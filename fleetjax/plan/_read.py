"""`read_plan`: the one reader of a strategy object.

Both `DistributedStrategy` and `Strategy` map onto the same `Plan`. Reading validates: it raises
for what fleetjax cannot apply (a switch not built yet, contradictory settings) and warns once
for each setting without effect, naming why.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import numpy as np

from fleetjax._warnings import warn_once
from fleetjax.optimizers import GEO, SWITCHES, check_combination
from fleetjax.plan import _knobs
from fleetjax.plan._degrees import set_degrees, strategy_degrees, strategy_order
from fleetjax.plan._values import (
    DEFAULT_SPARSE_RULE,
    Amp,
    GradientMerge,
    Hierarchical,
    LossScaling,
    NoEffect,
    OptimizerSwitch,
    ParameterServer,
    Pipeline,
    Plan,
    Recompute,
    SparseRuleConfig,
    SparseTableConfig,
)
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.transforms import amp

_FLOAT32_MAX = float(np.finfo(np.float32).max)

# Paddle's optimizer switches that a bool field turns on, each rebuilding or wrapping the user's
# optimizer (`fleetjax.optimizers.SWITCHES`; Geo-SGD is a_sync's).
OPTIMIZER_SWITCHES = tuple(name for name, switch in SWITCHES.items() if switch.flag)

# Switches that change the computation and are not built yet.
_NOT_YET_DISTRIBUTED = {
    "asp": "2:4 structured sparsity (ASP)",
    "qat": "quantization-aware training",
    "semi_auto": "semi-automatic parallelism",
}

# Switches the `auto` planner decides (or that replace data parallelism's gradient all-reduce),
# which Paddle's `auto` requires to be off. `hybrid_configs` degrees may be set: they fix degrees.
PLANNED_SWITCHES = (
    "sharding",
    "pipeline",
    "tensor_parallel",
    "recompute",
    "gradient_merge",
    *(name for name in OPTIMIZER_SWITCHES if SWITCHES[name].per_replica),
    "fp16_allreduce",
    "semi_auto",
    "auto_search",
)


def read_plan(strategy: DistributedStrategy | Strategy) -> Plan:
    """The `Plan` for `strategy`.

    Raises:
      TypeError: if `strategy` is not a `DistributedStrategy` or `Strategy`.
      NotImplementedError: for a switch fleetjax cannot apply yet.
      ValueError: for settings that contradict each other.

    Warns once (`StrategyWarning`) for each setting without effect, naming why.
    """
    if isinstance(strategy, Strategy):
        plan = _auto_parallel_plan(strategy)
    elif isinstance(strategy, DistributedStrategy):
        plan = _fleet_plan(strategy)
    else:
        raise TypeError(
            "strategy must be a fleetjax.DistributedStrategy or fleetjax.Strategy, "
            f"got {type(strategy).__name__}"
        )
    plan = _checked_combinations(plan)
    for knob, why in plan.no_effect:
        warn_once(f"{plan.strategy}.{knob} has no effect in fleetjax: {why}")
    return plan


# -- DistributedStrategy -----------------------------------------------------------------------


def _fleet_plan(s: DistributedStrategy) -> Plan:
    _check_supported(s)
    switch = _optimizer_switch(s)
    stage, offload = _sharding(s)
    pipe = s.pipeline_configs
    pipelined = s.pipeline or s.hybrid_configs["pp_degree"] > 1
    recompute = s.recompute_configs
    return Plan(
        strategy="DistributedStrategy",
        degrees=strategy_degrees(s),
        set_degrees=set_degrees(s),
        order=strategy_order(s),
        recompute=_recompute(
            "DistributedStrategy.recompute",
            recompute,
            "recompute_configs",
            tuple(recompute["checkpoint_shape"]),
        )
        if s.recompute
        else None,
        amp=_fleet_amp(s),
        gradient_merge=_fleet_merge(s, pipelined),
        allreduce_dtype=s.fp16_allreduce_dtype if s.fp16_allreduce else None,
        hierarchical=Hierarchical(
            # Paddle's default: the devices of one machine.
            s.hierarchical_allreduce_inter_nranks
            if s.is_set("hierarchical_allreduce_inter_nranks")
            else None
        )
        if s.use_hierarchical_allreduce
        else None,
        sharding_stage=stage,
        optimizer_offload=offload,
        pipeline=_pipeline(
            pipe["schedule_mode"], pipe["micro_batch_size"], pipe["accumulate_steps"], 0
        )
        if pipelined
        else None,
        iterations_per_run=s.execution_strategy.num_iteration_per_run,
        optimizer=switch,
        parameter_server=_parameter_server(s),
        sync_batch_norm=s.sync_batch_norm,
        recompute_allgather=s.hybrid_configs["mp_configs"]["recompute_allgather"],
        auto=s.auto,
        xla_flags=_knobs.flags_for(s),
        no_effect=(
            *_knobs.no_effect(s),
            *_a_sync_no_effect(s),
            *_sharding_merge_replaced(s, pipelined),
        ),
    )


def _check_supported(s: DistributedStrategy) -> None:
    for name, what in _NOT_YET_DISTRIBUTED.items():
        if getattr(s, name):
            raise _unsupported(what, f"DistributedStrategy.{name}=True")
    if s.auto_search:
        raise NotImplementedError(
            "DistributedStrategy.auto_search=True: fleetjax's automatic parallel search is a "
            "call, which needs the parameters and an example batch: "
            "found = fleetjax.auto.search(loss_fn, optimizer, params, batch, strategy=strategy) "
            "compiles candidate layouts under a memory budget and chooses one "
            "(docs/auto.md); turn auto_search off and train with found.make_train_step() "
            "or found.strategy"
        )
    on = [name for name in PLANNED_SWITCHES if s.auto and getattr(s, name)]
    if on:
        raise ValueError(
            f"DistributedStrategy.auto=True and {on[0]}=True: Paddle applies auto only when no "
            f"other parallel switch is set ({', '.join(PLANNED_SWITCHES)}); turn {on[0]} off "
            "and let the planner choose, or turn auto off and set the strategy yourself"
        )
    scale = s.gradient_scale_configs["scale_strategy"]
    if scale != "avg":
        raise _unsupported(
            "gradient scaling other than the mean over replicas",
            f"gradient_scale_configs.scale_strategy={scale!r}",
        )


def _unsupported(what: str, setting: str) -> NotImplementedError:
    return NotImplementedError(
        f"{setting}: {what} is not available in this version of fleetjax; "
        "turn it off to train without it"
    )


def _optimizer_switch(s: DistributedStrategy) -> OptimizerSwitch | None:
    on = [name for name in OPTIMIZER_SWITCHES if getattr(s, name)]
    if len(on) > 1:
        raise ValueError(
            f"strategy turns on {' and '.join(on)}; Paddle applies at most one of "
            f"{', '.join(OPTIMIZER_SWITCHES)} (it drops the others); turn all but one off"
        )
    geo = _geo_k_steps(s)
    if geo and on:
        raise ValueError(
            f"a_sync with a_sync_configs.k_steps={geo} (Geo-SGD) and {on[0]} cannot be "
            "combined: both make each replica step its own optimizer; turn one off"
        )
    if geo:
        return OptimizerSwitch(GEO.name, types.MappingProxyType({"k_steps": geo}))
    if not on:
        return None
    configs = getattr(s, SWITCHES[on[0]].configs)
    return OptimizerSwitch(on[0], types.MappingProxyType(dict(configs.to_dict())))


# -- parameter server ----------------------------------------------------------------------------

# The section of `SGDParameter` each rule reads.
_RULE_SECTIONS = {
    "SparseNaiveSGDRule": "naive",
    "SparseAdaGradSGDRule": "adagrad",
    "StdAdaGradSGDRule": "adagrad",
    "SparseAdamSGDRule": "adam",
    "SparseSharedAdamSGDRule": "adam",
}


def _geo_k_steps(s: DistributedStrategy) -> int:
    """Geo-SGD's interval: `a_sync_configs.k_steps` when `a_sync` is set True, else 0.

    Paddle's parameter-server modes are a_sync False sync, True with k_steps 0 async and > 0
    Geo; a strategy that leaves `a_sync` at its default (True) is a collective one, where
    Paddle ignores both."""
    k_steps = s.a_sync_configs["k_steps"]
    return k_steps if s.is_set("a_sync") and s.a_sync and k_steps > 0 else 0


def _a_sync_no_effect(s: DistributedStrategy) -> tuple[NoEffect, ...]:
    k_steps = s.a_sync_configs["k_steps"]
    if s.is_set("a_sync") and s.a_sync and k_steps <= 0:
        why = (
            "asynchronous parameter-server training (each trainer pushing stale gradients "
            "without waiting) has no SPMD counterpart: every step runs synchronously, as with "
            "a_sync=False (a_sync_configs.k_steps > 0 is Geo-SGD)"
        )
        return (NoEffect("a_sync=True", why),)
    if k_steps > 0 and not _geo_k_steps(s):
        why = "k_steps is Geo-SGD's interval, which needs a_sync set to True"
        return (NoEffect(f"a_sync_configs.k_steps={k_steps}", why),)
    return ()


def _parameter_server(s: DistributedStrategy) -> ParameterServer:
    tables = tuple(_table_config(t) for t in s.sparse_table_configs)
    names = [t.table_name for t in tables]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated or "" in names:
        raise ValueError(
            "sparse_table_configs: each table needs its own table_name, got "
            f"{'repeated ' + str(repeated) if repeated else 'an empty one'}"
        )
    return ParameterServer(_geo_k_steps(s), tables)


def _table_config(table: Any) -> SparseTableConfig:
    accessor, where = table.accessor, f"sparse_table_configs[{table.table_name!r}].accessor"
    if accessor.accessor_class not in ("", "SparseAccessor"):
        raise NotImplementedError(
            f"{where}.accessor_class={accessor.accessor_class!r}: Paddle's CTR accessors add "
            "show/click columns to a table's rows, which fleetjax does not model; use "
            "'SparseAccessor' (or leave it unset)"
        )
    return SparseTableConfig(
        table_name=table.table_name,
        accessor_class=accessor.accessor_class,
        fea_dim=accessor.fea_dim if accessor.is_set("fea_dim") else None,
        embedx_dim=accessor.embedx_dim if accessor.is_set("embedx_dim") else None,
        embed=_rule_config(accessor.embed_sgd_param, f"{where}.embed_sgd_param"),
        embedx=_rule_config(accessor.embedx_sgd_param, f"{where}.embedx_sgd_param"),
    )


def _rule_config(sgd: Any, where: str) -> SparseRuleConfig:
    # Unset: Paddle's default accessor rule, with the bounds Paddle's runtime adds.
    name = sgd.name or DEFAULT_SPARSE_RULE.name
    if name not in _RULE_SECTIONS:
        raise NotImplementedError(
            f"{where}.name={name!r} is not available in fleetjax; use one of "
            f"{', '.join(_RULE_SECTIONS)}"
        )
    section = _RULE_SECTIONS[name]
    params = sgd[section].to_dict()
    params.pop("initial_range")  # the table starts as its layer initialised it
    bounds = params.pop("weight_bounds") or DEFAULT_SPARSE_RULE.params["weight_bounds"]
    if len(bounds) < 2:
        raise ValueError(f"{where}.{section}.weight_bounds needs [low, high], got {bounds}")
    params["weight_bounds"] = (float(bounds[0]), float(bounds[1]))
    return SparseRuleConfig(name, types.MappingProxyType(params))


def _fleet_amp(s: DistributedStrategy) -> Amp | None:
    if not s.amp:
        return None
    c = s.amp_configs
    if c["use_pure_fp16"] and c["use_pure_bf16"]:
        raise ValueError("amp_configs: use_pure_fp16 and use_pure_bf16 cannot both be True")
    if c["use_pure_bf16"]:
        dtype, level = "bfloat16", "O2"
    elif c["use_pure_fp16"]:
        dtype, level = "float16", "O2"
    else:
        dtype, level = c["dtype"], "O1"
    policy = amp.policy(
        dtype,
        level,
        c["custom_white_list"],
        c["custom_black_list"],
        c["custom_black_varnames"],
        # Paddle applies use_fp16_guard to pure float16 only.
        use_guard=c["use_fp16_guard"] and c["use_pure_fp16"],
    )
    return Amp(policy, _loss_scaling(c, dtype, "amp_configs"))


def _fleet_merge(s: DistributedStrategy, pipelined: bool) -> GradientMerge | None:
    """From `gradient_merge_configs`, or `sharding_configs.gradient_merge_acc_step` under
    sharding (Paddle's sharding gradient merge, which runs across calls) without a pipeline."""
    config = s.gradient_merge_configs
    merge = (config["k_steps"], config["avg"], config["mode"] == "in_step")
    acc_step = s.sharding_configs["gradient_merge_acc_step"] if s.sharding else 1
    acc_step = 1 if pipelined else acc_step  # see _sharding_merge_replaced
    if s.gradient_merge and config["k_steps"] > 1:
        if acc_step > 1 and acc_step != config["k_steps"]:
            raise ValueError(
                f"gradient merge is set twice: gradient_merge_configs.k_steps="
                f"{config['k_steps']} but sharding_configs.gradient_merge_acc_step={acc_step}"
            )
        return GradientMerge(*merge)
    return GradientMerge(acc_step, True, False) if acc_step > 1 else None


def _sharding_merge_replaced(s: DistributedStrategy, pipelined: bool) -> tuple[NoEffect, ...]:
    """Under a pipeline Paddle's sharding optimizer merges the pipeline's micro-batches
    (`accumulate_steps`) in place of `gradient_merge_acc_step`."""
    acc_step = s.sharding_configs["gradient_merge_acc_step"]
    if not (pipelined and s.sharding and acc_step > 1):
        return ()
    why = (
        "under the pipeline, Paddle's sharding merges the pipeline's micro-batches instead "
        "(pipeline_configs.accumulate_steps)"
    )
    return (NoEffect(f"sharding_configs.gradient_merge_acc_step={acc_step}", why),)


def _sharding(s: DistributedStrategy) -> tuple[int, bool]:
    """(ZeRO stage, optimizer offload): from `sharding_configs` when `sharding` is on, or
    Paddle's dygraph rule: `hybrid_configs.sharding_degree > 1` shards the optimizer state
    (stage 1; stage 2 with the flattened buffers of `sharding_configs.split_param`)."""
    if s.sharding:
        return s.sharding_configs["stage"], s.sharding_configs["optimize_offload"]
    if s.hybrid_configs["sharding_degree"] > 1:
        return 2 if s.hybrid_configs["sharding_configs"]["split_param"] else 1, False
    return 0, False


# -- Strategy (auto-parallel) ------------------------------------------------------------------


def _auto_parallel_plan(s: Strategy) -> Plan:
    if s.qat.enable:
        raise NotImplementedError(
            "Strategy.qat.enable=True: quantization-aware training is not in fleetjax; turn "
            "it off to train without it"
        )
    merge, recompute, pipe = s.gradient_merge, s.recompute, s.pipeline
    return Plan(
        strategy="Strategy",
        degrees=strategy_degrees(s),
        order=strategy_order(s),
        recompute=_recompute("Strategy.recompute.enable", recompute, "Strategy.recompute")
        if recompute.enable
        else None,
        amp=_auto_parallel_amp(s),
        gradient_merge=GradientMerge(merge.k_steps, merge.avg, merge.mode == "in_step")
        if merge.enable and merge.k_steps > 1
        else None,
        sharding_stage=s.sharding.stage if s.sharding.enable else 0,
        pipeline=_pipeline(
            pipe.schedule_mode, pipe.micro_batch_size, pipe.accumulate_steps, pipe.vpp_degree
        )
        if pipe.enable
        else None,
        xla_flags=_knobs.flags_for(s),
        no_effect=_knobs.no_effect(s),
    )


def _auto_parallel_amp(s: Strategy) -> Amp | None:
    c = s.amp
    if not c.enable:
        return None
    level = c.level.upper()
    guard = c.use_fp16_guard if c.dtype == "float16" else c.use_bf16_guard
    policy = amp.policy(
        c.dtype,
        level,
        c.custom_white_list,
        c.custom_black_list,
        c.custom_black_varnames,
        use_guard=guard and level == "O2",
        promote=c.use_promote,
    )
    return Amp(policy, _loss_scaling(c, c.dtype, "Strategy.amp"))


# -- shared by both ----------------------------------------------------------------------------


def _recompute(switch: str, config: Any, where: str, shape: tuple[int, ...] = ()) -> Recompute:
    checkpoints, policy = tuple(config["checkpoints"]), config["policy"] or None
    if not checkpoints and policy is None:
        raise ValueError(
            f"{switch} is on but keeps nothing: set {where}['checkpoints'] to the activation "
            f"names given with fleetjax.checkpoint_name, or {where}['policy'] to a "
            "jax.checkpoint_policies name (e.g. 'dots_saveable', or 'nothing_saveable' to "
            "recompute everything)"
        )
    return Recompute(checkpoints, policy, bool(config.get("enable_offload", False)), shape)


def _loss_scaling(config: Any, dtype: str, where: str) -> LossScaling | None:
    # bfloat16 has float32's range, so it needs no loss scaling unless asked for explicitly.
    if dtype == "bfloat16" and not config.is_set("use_dynamic_loss_scaling"):
        return None
    init = config["init_loss_scaling"]
    if not 0 < init <= _FLOAT32_MAX:
        raise ValueError(
            f"{where}.init_loss_scaling={init!r}: the loss scale must be a positive float32 "
            f"number (at most {_FLOAT32_MAX:.4g}); with an infinite scale every gradient is "
            "non-finite and every step would be skipped"
        )
    return LossScaling(
        init_loss_scaling=config["init_loss_scaling"],
        dynamic=config["use_dynamic_loss_scaling"],
        incr_every_n_steps=config["incr_every_n_steps"],
        decr_every_n_nan_or_inf=config["decr_every_n_nan_or_inf"],
        incr_ratio=config["incr_ratio"],
        decr_ratio=config["decr_ratio"],
    )


def _pipeline(mode: str, micro_batch_size: int, accumulate_steps: int, vpp: int) -> Pipeline:
    # The schema allows Paddle's schedule_mode values, and the pipeline builds each of them.
    return Pipeline(mode, micro_batch_size, accumulate_steps, vpp)


def _checked_combinations(plan: Plan) -> Plan:
    check_combination(plan.switches)
    if plan.pipeline is not None:
        plan = _merged_into_pipeline(plan)
    if plan.sharding_stage and plan.allreduce_dtype is not None:
        # Paddle turns fp16_allreduce off under sharding.
        return dataclasses.replace(
            plan,
            allreduce_dtype=None,
            no_effect=(
                *plan.no_effect,
                NoEffect(
                    "fp16_allreduce=True",
                    "turned off under ZeRO sharding, as Paddle does (its gradients are "
                    "reduce-scattered over the sharding axis by the compiler)",
                ),
            ),
        )
    return plan


def _merged_into_pipeline(plan: Plan) -> Plan:
    """Under a pipeline, gradient merge in one call is the pipeline's accumulation, as in
    Paddle's auto-parallel engine: the batch is cut into `k_steps` micro-batches
    (`accumulate_steps`), and their gradients are averaged (Paddle sets `avg=True`)."""
    merge, pipe = plan.in_step_merge, plan.pipeline
    if merge is None:
        return plan
    if pipe.accumulate_steps not in (1, merge.k_steps):
        raise ValueError(
            f"under the pipeline, gradient merge in one call is the pipeline's accumulation: "
            f"gradient_merge k_steps={merge.k_steps} and pipeline accumulate_steps="
            f"{pipe.accumulate_steps} ask for different numbers of micro-batches; set one of "
            "them, or both to the same number"
        )
    field = "gradient_merge" if plan.strategy == "Strategy" else "gradient_merge_configs"
    avg = () if merge.avg else (NoEffect(f"{field}.avg=False", _AVERAGED_UNDER_PIPELINE),)
    return dataclasses.replace(
        plan,
        pipeline=dataclasses.replace(pipe, accumulate_steps=merge.k_steps),
        gradient_merge=dataclasses.replace(merge, avg=True),
        no_effect=(*plan.no_effect, *avg),
    )


_AVERAGED_UNDER_PIPELINE = (
    "under the pipeline, gradient merge is the pipeline's accumulation, whose gradient is the "
    "mean over its micro-batches (Paddle sets avg=True there too)"
)
