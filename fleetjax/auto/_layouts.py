"""The candidate layouts: mesh degrees, ZeRO stage and memory savers, and which to consider.

First the layouts: every factorisation of the device count into ``dp x sharding x mp x pp``
that splits the batch, with ZeRO stages 1, 2 and 3 when ``sharding > 1``; ``mp > 1`` only when
some parameter is split over ``mp`` (its `PartitionSpec`); ``pp > 1`` only when the loss is a
`PipelineLayer` whose layers divide into ``pp`` stages, with ``pp`` micro-batches
(``accumulate_steps``) and with one row each (less bubble), and where the layers divide into
``2 pp`` chunks also interleaved over 2 virtual stages (VPP). Then memory savers: on a ZeRO
layout whose train state does not fit, the optimizer state offloaded to pinned host memory
(``optimize_offload``); on a layout whose state fits but whose step does not, recompute
(`recompute_configs`, by default the policy ``nothing_saveable`` on the layers marked with
`fleetjax.recompute`) and in-step gradient merge into 2, 4 or 8 micro-batches. Under a pipeline
ZeRO stage 2 is stage 1 (the pipeline reduce-scatters its gradients under either). Last, where
nothing else fits, context parallelism (`sequence_layouts`): the sequence split over ``cp``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec

from fleetjax.mesh import spec_axes
from fleetjax.step import TrainStep
from fleetjax.strategy import DistributedStrategy
from fleetjax.transforms.pipeline import pipeline_schedule


@dataclasses.dataclass(frozen=True)
class Layout:
    """One point of the search: mesh degrees, ZeRO stage and memory savers.

    Attributes:
      dp, sharding, mp, pp: the mesh degrees (Paddle's `*_degree`).
      stage: the ZeRO stage over `sharding` (0 when sharding is 1).
      recompute: whether the layers marked with `fleetjax.recompute` are recomputed.
      micro_batches: in-step gradient merge's `k_steps`, or with `pp > 1` the pipeline's
        `accumulate_steps`.
      vpp: virtual pipeline stages per device (2 or more: the interleaved VPP schedule).
      offload: whether ZeRO keeps the optimizer state in pinned host memory
        (`sharding_configs["optimize_offload"]`).
      cp: context parallelism (`cp_degree`): the sequence split over a ``cp`` axis of its
        own, carved out of the sharding group as in Paddle (ZeRO is off on these layouts).
      sequence_parallel: the model's Megatron sequence-parallel form trains it (with mp > 1;
        `search`'s ``sequence_parallel``): a model form, not in the strategy.
    """

    dp: int
    sharding: int = 1
    stage: int = 0
    mp: int = 1
    pp: int = 1
    recompute: bool = False
    micro_batches: int = 1
    vpp: int = 1
    offload: bool = False
    cp: int = 1
    sequence_parallel: bool = False

    KEYS = (
        "dp",
        "sharding",
        "stage",
        "mp",
        "pp",
        "recompute",
        "micro_batches",
        "vpp",
        "offload",
        "cp",
        "sequence_parallel",
    )

    @property
    def degrees(self) -> dict[str, int]:
        """The mesh degrees; ``cp`` only where the sequence is split over it."""
        degrees = {"dp": self.dp, "sharding": self.sharding, "pp": self.pp, "mp": self.mp}
        return degrees if self.cp == 1 else {**degrees, "cp": self.cp}

    @property
    def replicas(self) -> int:
        """Devices the batch is split over (`dp x sharding`)."""
        return self.dp * self.sharding

    @property
    def base(self) -> Layout:
        """The same layout without memory savers (a pipeline keeps its micro-batches)."""
        micro = self.micro_batches if self.pp > 1 else 1
        return dataclasses.replace(self, recompute=False, micro_batches=micro)

    @property
    def placement(self) -> tuple[int, ...]:
        """What decides where the train state lives (and so its bytes per device)."""
        return self.dp, self.sharding, self.stage, self.mp, self.pp, self.offload, self.cp

    def order(self) -> tuple[int, ...]:
        """Simplicity: pure data parallelism first, then ZeRO, tensor, pipeline parallel; a
        pipeline's one-row micro-batches before fewer, bigger ones (less bubble and less in
        flight: what most often fits and wins, so that it bounds the others early)."""
        zero = (self.sharding > 1, self.stage, self.sharding, self.offload)
        micro = -self.micro_batches if self.pp > 1 else self.micro_batches
        return (self.cp, self.pp, self.mp, *zero, self.vpp, self.recompute, micro)

    def dominates(self, other: Layout) -> bool:
        """Whether `other` takes at least as long, so that once `self` fits `other` is skipped:
        ZeRO takes as long as pure data parallelism over the same devices or longer, ZeRO-3
        (which gathers the parameters where they are used) as long as ZeRO-2 over the same
        `sharding` or longer (under a pipeline, as ZeRO-1, which is its ZeRO-2), and more
        memory savers (offload among them) as long as fewer or longer."""
        split_alike = (self.pp, self.mp, self.replicas, self.vpp, self.cp)
        if self == other or split_alike != (
            other.pp,
            other.mp,
            other.replicas,
            other.vpp,
            other.cp,
        ):
            return False
        gathers = other.stage == 3 and self.stage in ((1, 2) if self.pp > 1 else (2,))
        same_zero = (self.sharding, self.stage) == (other.sharding, other.stage)
        zero = self.sharding == 1 or same_zero or (self.sharding == other.sharding and gathers)
        if self.pp > 1:  # a pipeline's micro-batches trade bubble for latency: not ordered
            micro = self.micro_batches == other.micro_batches
        else:
            micro = self.micro_batches <= other.micro_batches
        savers = self.recompute <= other.recompute and self.offload <= other.offload
        return zero and micro and savers

    def strategy(self, base: DistributedStrategy, rows: int) -> DistributedStrategy:
        """`base` (a copy, with `auto` off) set to this layout, for a global batch of `rows`."""
        s = copy.deepcopy(base)
        s.auto = False
        s.hybrid_configs = {
            "dp_degree": self.dp,
            "sharding_degree": self.sharding * self.cp,  # Paddle carves cp out of sharding
            "mp_degree": self.mp,
            "pp_degree": self.pp,
            "cp_degree": self.cp,
        }
        if self.sharding > 1:
            s.sharding = True
            s.sharding_configs = {
                "sharding_degree": self.sharding,
                "stage": self.stage,
                "optimize_offload": self.offload,
            }
        if self.recompute:
            s.recompute = True
            if not (s.recompute_configs["checkpoints"] or s.recompute_configs["policy"]):
                s.recompute_configs = {"policy": "nothing_saveable"}
        if self.pp > 1:
            s.pipeline = True
            per_replica = rows // self.replicas
            s.pipeline_configs = {
                "accumulate_steps": self.micro_batches,
                "micro_batch_size": per_replica // self.micro_batches,
                **({"schedule_mode": "VPP"} if self.vpp > 1 else {}),
            }
        elif self.micro_batches > 1:
            s.gradient_merge = True
            s.gradient_merge_configs = {
                "k_steps": self.micro_batches,
                "avg": True,
                "mode": "in_step",
            }
        return s

    def loss(self, loss_fn: Any, sequence_parallel: Any = None) -> Any:
        """The model as this layout trains it: `loss_fn`, or its `sequence_parallel` form where
        the layout says so; a `PipelineLayer` cut into `vpp` virtual stages per device under
        VPP.

        Raises:
          ValueError: for a sequence-parallel layout without a sequence-parallel form.
        """
        if self.sequence_parallel:
            if sequence_parallel is None:
                raise ValueError(
                    f"layout {self} is sequence parallel: pass the model's sequence-parallel "
                    "form as auto.search(..., sequence_parallel=...)"
                )
            loss_fn = sequence_parallel
        if self.vpp == 1:
            return loss_fn
        return dataclasses.replace(loss_fn, num_virtual_pipeline_stages=self.vpp)

    @classmethod
    def of(cls, step: TrainStep) -> Layout:
        """The layout a train step runs, after its `abstract_init` (its model's form is not
        in the step: `sequence_parallel` False)."""
        shape, p, order = step.mesh.shape, step.plan, step.placement.stage_order
        merge = p.gradient_merge
        micro = p.pipeline.accumulate_steps if p.pipeline else merge.k_steps if merge else 1
        return cls(
            dp=shape["dp"],
            sharding=shape["sharding"],
            stage=p.sharding_stage,
            mp=shape["mp"],
            pp=shape["pp"],
            recompute=p.recompute is not None,
            micro_batches=micro,
            vpp=1 if order is None else order.vpp,
            offload=p.optimizer_offload,
            cp=shape.get("cp", 1),
        )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], devices: int) -> Layout:
        """A layout from degree keys (`KEYS`); `dp` defaults to the devices the others leave,
        `stage` to 1 when `sharding > 1`.

        Raises:
          ValueError: naming an unknown key, or degrees that do not multiply to `devices`.
        """
        unknown = sorted(set(values) - set(cls.KEYS))
        if unknown:
            raise ValueError(
                f"candidates: unknown key {unknown[0]!r} in {dict(values)}; keys are "
                f"{', '.join(cls.KEYS)}"
            )
        v = {"sharding": 1, "mp": 1, "pp": 1, "cp": 1, **values}
        v.setdefault("stage", 1 if v["sharding"] > 1 else 0)
        others = v["sharding"] * v["mp"] * v["pp"] * v["cp"]
        v.setdefault("dp", devices // others if devices % others == 0 else 0)
        if v["dp"] * others != devices:
            raise ValueError(
                f"candidates: {dict(values)} does not multiply to the {devices} devices "
                f"(dp x sharding x mp x pp x cp = {v['dp']} x {v['sharding']} x {v['mp']} x "
                f"{v['pp']} x {v['cp']})"
            )
        if (v["stage"] > 0) != (v["sharding"] > 1) or v["stage"] not in (0, 1, 2, 3):
            raise ValueError(
                f"candidates: {dict(values)} has stage={v['stage']}; ZeRO stages 1, 2 and 3 "
                "need sharding > 1, and sharding > 1 needs one of them"
            )
        return cls(**v)

    def __str__(self) -> str:
        parts = [f"dp={self.dp}"]
        if self.sharding > 1:
            parts.append(f"sharding={self.sharding} (stage {self.stage})")
        parts += [f"{a}={getattr(self, a)}" for a in ("cp", "mp", "pp") if getattr(self, a) > 1]
        if self.sequence_parallel:
            parts.append("sequence-parallel")
        if self.vpp > 1:
            parts.append(f"vpp={self.vpp}")
        if self.offload:
            parts.append("offload")
        if self.recompute:
            parts.append("recompute")
        if self.micro_batches > 1:
            parts.append(f"{self.micro_batches} micro-batches")
        return " ".join(parts)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def all_layouts(
    devices: int,
    rows: int,
    fixed: Mapping[str, int],
    mp_ok: bool,
    pipeline_layers: int | None,
    per_host: int | None = None,
) -> list[Layout]:
    """Every layout without memory savers that splits `rows`, simplest first. A pipeline
    gets as many micro-batches as stages, and (less bubble) one per row of its replica, each
    also under VPP where the layers split into 2 chunks per stage. `mp` stays within a host of
    `per_host` devices (its all-reduces, two per layer, would otherwise cross the network)."""
    found = []
    pps = [1] + [p for p in _divisors(devices)[1:] if pipeline_layers and pipeline_layers % p == 0]
    for pp in pps:
        mps = [m for m in _divisors(devices // pp) if m <= (per_host or devices)]
        for mp in mps if mp_ok else [1]:
            for sharding in _divisors(devices // (pp * mp)):
                dp = devices // (pp * mp * sharding)
                degrees = {"dp": dp, "sharding": sharding, "mp": mp, "pp": pp}
                per_replica = rows // (dp * sharding)
                if (
                    any(degrees[a] != d for a, d in fixed.items())
                    or per_replica * dp * sharding != rows
                    or per_replica % pp
                ):
                    continue
                found += _variants(Layout(dp, sharding, 0, mp, pp), per_replica, pipeline_layers)
    return sorted(found, key=Layout.order)


def _variants(layout: Layout, per_replica: int, pipeline_layers: int | None) -> list[Layout]:
    """`layout` with each ZeRO stage over `sharding`, and a pipeline's micro-batches and
    virtual stages. A pipeline reduce-scatters the gradients it accumulates under any ZeRO
    stage, so its stage 2 is its stage 1 and is not listed twice."""
    stages = (1, 2, 3) if layout.sharding > 1 else (0,)
    if layout.pp > 1 and layout.sharding > 1:
        stages = (1, 3)
    pipe = [(1, 1)]
    if layout.pp > 1:
        vpps = [1, 2] if pipeline_layers % (2 * layout.pp) == 0 else [1]
        pipe = [(m, v) for m in sorted({layout.pp, per_replica}) for v in vpps]
    return [
        dataclasses.replace(layout, stage=stage, micro_batches=m, vpp=v)
        for stage in stages
        for m, v in pipe
    ]


def split(layout: Layout) -> tuple[int, ...]:
    """What decides a layout's activations: rows per device, mp, pp (and its virtual stages),
    and the savers."""
    return (
        layout.replicas,
        layout.cp,
        layout.mp,
        layout.pp,
        layout.vpp,
        layout.recompute,
        layout.micro_batches,
    )


def activations_scale(seen: Layout, other: Layout, rows: int) -> float | None:
    """How `other`'s activations compare with those of `seen` (a compiled layout), or None if
    they are not comparable: layouts that split the rows, mp and pp alike, with the same
    recompute, hold the same activations per micro-batch, so in-step micro-batching into k
    divides them by k. A pipeline keeps its micro-batches in flight: pipelines that split mp
    and pp alike (with the same virtual stages and recompute) keep as many rows as their
    micro-batches in flight (at most 2 pp - 1 under 1F1B) times the rows in each."""
    model = (seen.mp, seen.pp, seen.vpp, seen.recompute, seen.cp)
    if model != (other.mp, other.pp, other.vpp, other.recompute, other.cp):
        return None
    if seen.pp > 1:
        return _rows_in_flight(other, rows) / _rows_in_flight(seen, rows)
    if seen.replicas != other.replicas:
        return None
    return seen.micro_batches / other.micro_batches


def _rows_in_flight(layout: Layout, rows: int) -> float:
    """The rows a pipeline layout's first stage keeps in flight: its schedule's micro-batches
    in flight there, times the rows in each."""
    mode = "VPP" if layout.vpp > 1 else "1F1B"
    schedule = pipeline_schedule(mode, layout.pp, layout.micro_batches, layout.vpp)
    per_micro_batch = rows / (layout.replicas * layout.micro_batches)
    return float(schedule.in_flight.max()) / layout.vpp * per_micro_batch


def savers(layout: Layout, rows: int) -> list[Layout]:
    """`layout` with recompute and (without a pipeline) in 2, 4 or 8 micro-batches: each
    doubling halves the activations left, so beyond 8 little is left to save."""
    per_replica = rows // layout.replicas
    micro = [layout.micro_batches]
    if layout.pp == 1:
        micro = [k for k in (1, 2, 4, 8) if per_replica % k == 0]
    variants = [
        dataclasses.replace(layout, recompute=r, micro_batches=m)
        for r in (False, True)
        for m in micro
    ]
    return sorted((v for v in variants if v != layout), key=Layout.order)


def uses_mp(specs: Any) -> bool:
    leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    return any("mp" in spec_axes(s) for s in leaves if isinstance(s, PartitionSpec))


def sequence_layouts(devices: int, rows: int, fixed: Mapping[str, int]) -> list[Layout]:
    """Context parallelism for sequences that do not fit: the devices split into ``cp``
    (the sequence) x ``dp`` (the rows), without and with recompute, smallest ``cp`` first."""
    if set(fixed) - {"dp", "cp"}:
        return []
    found = [
        Layout(devices // cp, cp=cp, recompute=recompute)
        for cp in _divisors(devices)[1:]
        for recompute in (False, True)
        if rows % (devices // cp) == 0
        and all(getattr(Layout(devices // cp, cp=cp), a) == d for a, d in fixed.items())
    ]
    return sorted(found, key=Layout.order)
