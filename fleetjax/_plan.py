"""Reading a strategy once: what the train step must do, as plain values the transforms take.

`read_plan` is the only place that interprets strategy fields for the step; transforms never see
a strategy. Both `DistributedStrategy` and `Strategy` map onto the same `Plan`.
"""

from __future__ import annotations

import dataclasses

from fleetjax import _support, xla_flags
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.transforms import amp


@dataclasses.dataclass(frozen=True)
class Recompute:
    checkpoints: tuple[str, ...]
    policy: str | None
    offload: bool
    checkpoint_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LossScaling:
    init_loss_scaling: float
    dynamic: bool
    incr_every_n_steps: int
    decr_every_n_nan_or_inf: int
    incr_ratio: float
    decr_ratio: float


@dataclasses.dataclass(frozen=True)
class Amp:
    policy: amp.Policy
    loss_scaling: LossScaling | None  # None: no scaling and no skipping (bfloat16's default)


@dataclasses.dataclass(frozen=True)
class GradientMerge:
    k_steps: int
    avg: bool
    in_step: bool  # True: micro-batches within one call; False: the optimizer runs every k calls


@dataclasses.dataclass(frozen=True)
class Pipeline:
    schedule_mode: str
    micro_batch_size: int
    accumulate_steps: int
    vpp_degree: int  # 0: the model's own num_virtual_pipeline_stages


@dataclasses.dataclass(frozen=True)
class Hierarchical:
    """`use_hierarchical_allreduce`: the gradient all-reduce in two levels, within and across
    nodes of `ranks_per_node` devices (None: each process's devices are a node)."""

    ranks_per_node: int | None


@dataclasses.dataclass(frozen=True)
class Plan:
    """The transforms a train step applies; None means off."""

    recompute: Recompute | None = None
    amp: Amp | None = None
    gradient_merge: GradientMerge | None = None
    allreduce_dtype: str | None = None  # fp16_allreduce: the dtype gradients are summed in
    hierarchical: Hierarchical | None = None
    # DGC and LocalSGD: the optimizer runs on each data-parallel replica's own gradient and
    # state, inside shard_map, and does its own communication.
    per_replica: bool = False
    replica_params: bool = False  # LocalSGD: each replica's parameters drift apart too
    # ZeRO over the `sharding` axis: 0 off; 1 optimizer state, 2 + gradients, 3 + parameters.
    sharding_stage: int = 0
    optimizer_offload: bool = False  # the optimizer state lives in pinned host memory
    pipeline: Pipeline | None = None
    # execution_strategy.num_iteration_per_run: optimizer steps per `TrainStep.run` call (None:
    # any number; `Strategy` has no such knob).
    iterations_per_run: int | None = None


def _recompute(switch: str, config, where: str, shape: tuple[int, ...] = ()) -> Recompute:
    checkpoints, policy = tuple(config["checkpoints"]), config["policy"] or None
    if not checkpoints and policy is None:
        raise ValueError(
            f"{switch} is on but keeps nothing: set {where}['checkpoints'] to the activation "
            f"names given with fleetjax.checkpoint_name, or {where}['policy'] to a "
            "jax.checkpoint_policies name (e.g. 'dots_saveable', or 'nothing_saveable' to "
            "recompute everything)"
        )
    return Recompute(checkpoints, policy, bool(config.get("enable_offload", False)), shape)


def _loss_scaling(config, dtype: str) -> LossScaling | None:
    # bfloat16 has float32's range, so it needs no loss scaling unless asked for explicitly.
    if dtype == "bfloat16" and not config.is_set("use_dynamic_loss_scaling"):
        return None
    return LossScaling(
        init_loss_scaling=config["init_loss_scaling"],
        dynamic=config["use_dynamic_loss_scaling"],
        incr_every_n_steps=config["incr_every_n_steps"],
        decr_every_n_nan_or_inf=config["decr_every_n_nan_or_inf"],
        incr_ratio=config["incr_ratio"],
        decr_ratio=config["decr_ratio"],
    )


def _distributed_amp(s: DistributedStrategy) -> Amp | None:
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
    return Amp(policy, _loss_scaling(c, dtype))


def _auto_amp(s: Strategy) -> Amp | None:
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
    return Amp(policy, _loss_scaling(c, c.dtype))


def _distributed_merge(s: DistributedStrategy) -> GradientMerge | None:
    """From `gradient_merge_configs`, or `sharding_configs.gradient_merge_acc_step` under
    sharding (Paddle's sharding gradient merge, which runs across calls)."""
    config = s.gradient_merge_configs
    merge = (config["k_steps"], config["avg"], config["mode"] == "in_step")
    acc_step = s.sharding_configs["gradient_merge_acc_step"] if s.sharding else 1
    if s.gradient_merge and config["k_steps"] > 1:
        if acc_step > 1 and acc_step != config["k_steps"]:
            raise ValueError(
                f"gradient merge is set twice: gradient_merge_configs.k_steps="
                f"{config['k_steps']} but sharding_configs.gradient_merge_acc_step={acc_step}"
            )
        return GradientMerge(*merge)
    return GradientMerge(acc_step, True, False) if acc_step > 1 else None


def _distributed_sharding(s: DistributedStrategy) -> tuple[int, bool]:
    """(ZeRO stage, optimizer offload): from `sharding_configs` when `sharding` is on, or
    Paddle's dygraph rule: `hybrid_configs.sharding_degree > 1` shards the optimizer state
    (stage 1; stage 2 with the flattened buffers of `sharding_configs.split_param`)."""
    if s.sharding:
        return s.sharding_configs["stage"], s.sharding_configs["optimize_offload"]
    if s.hybrid_configs["sharding_degree"] > 1:
        return 2 if s.hybrid_configs["sharding_configs"]["split_param"] else 1, False
    return 0, False


_PIPELINE_SCHEDULES = ("1F1B", "FThenB", "F-then-B", "VPP")


def _pipeline(mode: str, micro_batch_size: int, accumulate_steps: int, vpp: int) -> Pipeline:
    if mode not in _PIPELINE_SCHEDULES:
        raise NotImplementedError(
            f"pipeline schedule_mode {mode!r} is not available in this version of fleetjax; "
            f"use one of {', '.join(_PIPELINE_SCHEDULES)}"
        )
    return Pipeline(mode, micro_batch_size, accumulate_steps, vpp)


def _check_combinations(plan: Plan) -> Plan:
    if plan.sharding_stage and plan.per_replica:
        raise ValueError(
            "ZeRO sharding and dgc/localsgd cannot be combined: they keep per-replica "
            "optimizer state, ZeRO splits one copy of it over the sharding axis"
        )
    if plan.pipeline is not None:
        merge = plan.gradient_merge
        clash = (
            "gradient merge in one call (the pipeline's accumulate_steps is that)"
            if merge is not None and merge.in_step
            else "dgc/localsgd"
            if plan.per_replica
            else "fp16_allreduce"
            if plan.allreduce_dtype is not None
            else None
        )
        if clash:
            raise ValueError(f"the pipeline does not combine with {clash}")
    if plan.hierarchical is not None:
        clash = (
            "ZeRO stage 2/3 (it reduce-scatters over the sharding axis)"
            if plan.sharding_stage >= 2
            else "dgc/localsgd (they do their own communication)"
            if plan.per_replica
            else "the pipeline (it reduces over the data axes itself)"
            if plan.pipeline is not None
            else None
        )
        if clash:
            raise ValueError(f"use_hierarchical_allreduce does not combine with {clash}")
    if plan.sharding_stage and plan.allreduce_dtype is not None:
        _support.warn_once(
            "fp16_allreduce is turned off under ZeRO sharding, as Paddle does (its gradients "
            "are reduce-scattered over the sharding axis by the compiler)"
        )
        return dataclasses.replace(plan, allreduce_dtype=None)
    return plan


def read_plan(strategy: DistributedStrategy | Strategy) -> Plan:
    """The `Plan` for `strategy`; raises for settings fleetjax cannot apply, warns once for
    settings without effect."""
    _support.check_supported(strategy)
    xla_flags.warn_ignored(strategy)
    if isinstance(strategy, Strategy):
        merge = strategy.gradient_merge
        recompute = strategy.recompute
        pipe = strategy.pipeline
        return _check_combinations(
            Plan(
                recompute=_recompute("Strategy.recompute.enable", recompute, "Strategy.recompute")
                if recompute.enable
                else None,
                amp=_auto_amp(strategy),
                gradient_merge=GradientMerge(merge.k_steps, merge.avg, merge.mode == "in_step")
                if merge.enable and merge.k_steps > 1
                else None,
                sharding_stage=strategy.sharding.stage if strategy.sharding.enable else 0,
                pipeline=_pipeline(
                    pipe.schedule_mode,
                    pipe.micro_batch_size,
                    pipe.accumulate_steps,
                    pipe.vpp_degree,
                )
                if pipe.enable
                else None,
            )
        )
    recompute = strategy.recompute_configs
    per_replica = [
        name for name in ("dgc", "localsgd", "adaptive_localsgd") if getattr(strategy, name)
    ]
    if per_replica and strategy.fp16_allreduce:
        raise ValueError(
            f"fp16_allreduce and {per_replica[0]} cannot be combined: {per_replica[0]} does "
            "its own communication, with no dense gradient all-reduce to run in half precision"
        )
    stage, offload = _distributed_sharding(strategy)
    pipe = strategy.pipeline_configs
    plan = Plan(
        recompute=_recompute(
            "DistributedStrategy.recompute",
            recompute,
            "recompute_configs",
            tuple(recompute["checkpoint_shape"]),
        )
        if strategy.recompute
        else None,
        amp=_distributed_amp(strategy),
        gradient_merge=_distributed_merge(strategy),
        allreduce_dtype=strategy.fp16_allreduce_dtype if strategy.fp16_allreduce else None,
        per_replica=bool(per_replica),
        replica_params=bool(per_replica) and per_replica[0] != "dgc",
        sharding_stage=stage,
        optimizer_offload=offload,
        pipeline=_pipeline(
            pipe["schedule_mode"], pipe["micro_batch_size"], pipe["accumulate_steps"], 0
        )
        if strategy.pipeline or strategy.hybrid_configs["pp_degree"] > 1
        else None,
        iterations_per_run=strategy.execution_strategy.num_iteration_per_run,
        hierarchical=Hierarchical(
            # Paddle's default: the devices of one machine.
            strategy.hierarchical_allreduce_inter_nranks
            if strategy.is_set("hierarchical_allreduce_inter_nranks")
            else None
        )
        if strategy.use_hierarchical_allreduce
        else None,
    )
    return _check_combinations(plan)
