"""What a strategy does once validated: `fleetjax.applied_strategy(strategy)` and
`fleet.applied_strategy()`.

Paddle drops strategy switches it cannot apply with a log line, and users inspect
`fleet._final_strategy()` to find out what ran. fleetjax refuses what it cannot apply, so the
report here answers the remaining questions: which transforms the train step composes (its
`Plan`), how the optimizer is rebuilt, which XLA flags the knobs map to, and which settings have
no effect, each with the reason it warns with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.sharding import Mesh

from fleetjax import xla_flags
from fleetjax.distributed_optimizer import DistributedOptimizer
from fleetjax.mesh import data_axes, data_parallel_size
from fleetjax.optimizers import PaddleOptimizer, rebuild
from fleetjax.plan import NoEffect, OptimizerSwitch, Plan, read_plan
from fleetjax.strategy import DistributedStrategy, Strategy
from fleetjax.transforms import amp
from fleetjax.vocabulary import AXES, REQUIRED_AXES

__all__ = ["AppliedStrategy", "Setting", "applied_strategy"]


class Setting(NamedTuple):
    """One thing the strategy turns on, and how fleetjax applies it."""

    feature: str  # e.g. "gradient merge"
    how: str  # e.g. "k_steps=4, mean of the gradients; the optimizer steps every 4th call"


@dataclasses.dataclass(frozen=True)
class AppliedStrategy:
    """What a strategy does in fleetjax once validated; `str()` is a readable table.

    Attributes:
      strategy: the strategy's class name, "DistributedStrategy" or "Strategy".
      mesh: the mesh axis sizes; -1 for `dp` when no mesh is given (all devices left).
      applied: what the train step does, in the order it composes it.
      xla_flags: the XLA flags the knobs map to (with a fleet: those in effect).
      ignored: settings without effect, each with the reason fleetjax warns with.
      plan: the train step's `Plan` (what `make_train_step` reads from the strategy).
    """

    strategy: str
    mesh: Mapping[str, int]
    applied: tuple[Setting, ...]
    xla_flags: tuple[xla_flags.Flag, ...]
    ignored: tuple[NoEffect, ...]
    plan: Plan

    def __str__(self) -> str:
        sizes = " x ".join(f"{a}={'rest' if n == -1 else n}" for a, n in self.mesh.items())
        lines = [f"{self.strategy} on a mesh {sizes}"]
        sections = (
            ("applied", [(s.feature, s.how) for s in self.applied]),
            ("XLA flags", [(str(f), f.knob) for f in self.xla_flags]),
            ("no effect", [(i.knob, i.why) for i in self.ignored]),
        )
        for title, rows in sections:
            lines.append(f"{title}:" if rows else f"{title}: none")
            width = max((len(left) for left, _ in rows), default=0)
            lines += [f"  {left:<{width}}  {right}" for left, right in rows]
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Notebooks show the table."""
        printer.text(str(self))


def applied_strategy(
    strategy: DistributedStrategy | Strategy,
    mesh: Mesh | None = None,
    *,
    flags_in_effect: tuple[xla_flags.Flag, ...] | None = None,
    optimizer: DistributedOptimizer | None = None,
) -> AppliedStrategy:
    """What `strategy` does in fleetjax: the train step's plan, the optimizer rebuild, the XLA
    flags and the settings without effect. Nothing runs on a device, and no backend starts.

    Validates as `make_train_step` does: raises for settings fleetjax cannot apply, and warns
    once (`StrategyWarning`) for each setting without effect.

    Args:
      strategy: a `DistributedStrategy` or `Strategy`.
      mesh: the mesh it runs on (default: the degrees the strategy asks for).
      flags_in_effect: the XLA flags in effect (what `fleet.init` applied); the flags the
        strategy asks for that are not are listed as without effect. Default: all it asks for.
      optimizer: the optimizer bound to the strategy, to show what it was rebuilt as.
    """
    plan = read_plan(strategy)
    sizes = dict(mesh.shape) if mesh is not None else plan.degrees._asdict()
    flags, missing = plan.xla_flags, ()
    if flags_in_effect is not None:
        missing = tuple(_not_in_effect(f) for f in flags if f not in flags_in_effect)
        flags = tuple(flags_in_effect)
    if mesh is not None and mesh.devices.flat[0].platform == "cpu":  # XLA:CPU ignores them
        idle = [f for f in plan.xla_flags if xla_flags.tunes_gpu_only(f)]
        flags = tuple(f for f in flags if f not in idle)
        missing = tuple(m for m in missing if m.knob not in {f.knob for f in idle})
        missing += tuple(NoEffect(f.knob, _ON_CPU.format(f)) for f in idle)
    return AppliedStrategy(
        strategy=plan.strategy,
        mesh={a: sizes.get(a, 1) for a in AXES if a in REQUIRED_AXES or sizes.get(a, 1) > 1},
        applied=_settings(plan, sizes, optimizer),
        xla_flags=flags,
        ignored=plan.no_effect + missing,
        plan=plan,
    )


# -- what the step applies ---------------------------------------------------------------------


def _settings(
    plan: Plan, sizes: Mapping[str, int], optimizer: DistributedOptimizer | None
) -> tuple[Setting, ...]:
    """What the step does, in the order it composes it: the layout, then the transforms."""
    found = {**_layout(plan, sizes), **_transforms(plan)}
    if plan.optimizer is not None:
        found["optimizer"] = _optimizer(plan.optimizer, optimizer)
    if plan.iterations_per_run is not None:
        found["steps per run"] = (
            f"TrainStep.run scans {plan.iterations_per_run} steps in one compiled call "
            "(execution_strategy.num_iteration_per_run)"
        )
    if plan.sync_batch_norm:
        found["sync batch norm"] = (
            "fleet.distributed_model makes BatchNorm layers compute statistics over all replicas"
        )
    return tuple(Setting(feature, how) for feature, how in found.items())


def _layout(plan: Plan, sizes: Mapping[str, int]) -> dict[str, str]:
    dp = "dp" if sizes["dp"] == -1 else f"dp={sizes['dp']}"
    gradients = (
        f"each replica computes its own gradient and steps its own optimizer state "
        f"({plan.optimizer.name} does its own communication)"
        if plan.per_replica
        else "gradients are averaged over the replicas"
    )
    found = {
        "data parallel": f"the batch is split over {dp} x sharding={sizes['sharding']}; {gradients}"
    }
    if sizes["mp"] > 1:
        found["tensor parallel"] = (
            f"parameters split over mp={sizes['mp']} by their logical axis names "
            "(fleetjax.layers) or param_specs"
        )
    if sizes.get("sep", 1) > 1:
        found["segment parallel"] = (
            f"the sequence split over sep={sizes['sep']}; attention exchanges sequence for heads "
            "by all-to-all over sep (fleetjax.layers.attention)"
        )
    if sizes.get("cp", 1) > 1:
        found["context parallel"] = (
            f"the sequence split over cp={sizes['cp']}; ring attention over cp, causal and "
            "load-balanced (fleetjax.layers.attention)"
        )
    if (p := plan.pipeline) is not None:
        vpp = f", vpp_degree={p.vpp_degree}" if p.vpp_degree else ""
        found["pipeline"] = (
            f"{p.schedule_mode} over pp={sizes['pp']}, micro_batch_size={p.micro_batch_size}, "
            f"accumulate_steps={p.accumulate_steps}{vpp}"
        )
    if plan.sharding_stage:
        held = ["optimizer state", "gradients", "parameters"][: plan.sharding_stage]
        offload = "; the optimizer state lives in pinned host memory" * plan.optimizer_offload
        found["sharding"] = (
            f"ZeRO stage {plan.sharding_stage} over sharding={sizes['sharding']}: "
            f"{', '.join(held)} split{offload}"
        )
    return found


def _transforms(plan: Plan) -> dict[str, str]:
    found = {}
    if plan.amp is not None:
        found["amp"] = _amp(plan.amp)
    if (r := plan.recompute) is not None:
        kept = [f"keeps {list(r.checkpoints)}"] if r.checkpoints else []
        kept += [f"policy {r.policy}"] if r.policy else []
        kept += [f"checkpoint_shape {list(r.checkpoint_shape)}"] if r.checkpoint_shape else []
        kept += ["kept activations offloaded to pinned host memory"] if r.offload else []
        found["recompute"] = "layers marked with fleetjax.recompute; " + ", ".join(kept)
    if (g := plan.gradient_merge) is not None:
        when = (
            f"{g.k_steps} micro-batches in one call"
            if g.in_step
            else f"the optimizer steps once every {g.k_steps} calls"
        )
        mean = "mean" if g.avg else "sum"
        found["gradient merge"] = f"k_steps={g.k_steps}, {mean} of the gradients; {when}"
    if plan.allreduce_dtype is not None:
        found["fp16 allreduce"] = f"gradients all-reduced in {plan.allreduce_dtype}"
    if plan.hierarchical is not None:
        nodes = plan.hierarchical.ranks_per_node
        node = f"nodes of {nodes} replicas" if nodes else "nodes (one process's replicas each)"
        found["hierarchical allreduce"] = (
            f"gradients reduced in two levels: within {node}, then across nodes"
        )
    return found


def _amp(config: Any) -> str:
    policy = config.policy
    parts = [f"{jnp.dtype(policy.dtype).name} {policy.level}"]
    white, black = policy.white - amp.DEFAULT_WHITE, policy.black - amp.DEFAULT_BLACK
    parts += [f"also in half precision: {sorted(white)}"] if white else []
    parts += [f"also in float32: {sorted(black)}"] if black else []
    parts += [f"float32 values {sorted(policy.black_names)}"] if policy.black_names else []
    parts += ["only inside fp16_guard()"] if policy.guard else []
    s = config.loss_scaling
    if s is None:
        parts.append("no loss scaling")
    elif s.dynamic:
        parts.append(
            f"dynamic loss scaling from {s.init_loss_scaling:g} (x{s.incr_ratio:g} after "
            f"{s.incr_every_n_steps} finite steps, x{s.decr_ratio:g} after "
            f"{s.decr_every_n_nan_or_inf} non-finite), a non-finite step skipped"
        )
    else:
        parts.append(f"a fixed loss scale of {s.init_loss_scaling:g}, a non-finite step skipped")
    return ", ".join(parts)


def _optimizer(switch: OptimizerSwitch, optimizer: DistributedOptimizer | None) -> str:
    text = f"{switch.row.what}: {switch.row.configs} {dict(switch.configs)}"
    if optimizer is not None:
        rebuilt = rebuild(
            optimizer.user,
            switch.name,
            switch.configs,
            data_parallel_size(optimizer.mesh),
            data_axes(optimizer.mesh),
        )
        if isinstance(rebuilt, PaddleOptimizer):  # a wrapper (LocalSGD) has nothing to show
            text += f"; {optimizer.user!r} became {rebuilt!r}"
    return text


# -- what has no effect ------------------------------------------------------------------------


_ON_CPU = "no effect on this backend: {} tunes XLA:GPU, and XLA:CPU has no counterpart"


def _not_in_effect(flag: xla_flags.Flag) -> NoEffect:
    present = xla_flags.in_env().get(flag.name)
    if xla_flags.users(flag.name):
        why = f"XLA_FLAGS sets --{flag.name}={present}, which wins over {flag}"
    elif present is not None:
        why = f"{flag} came after JAX's backend started with an earlier strategy's {present}"
    else:
        why = (
            f"{flag} is not in effect: the installed jaxlib refuses it, or JAX's backend had "
            "started before fleet.init (the StrategyWarning fleet.init gave says which)"
        )
    return NoEffect(flag.knob, why)
