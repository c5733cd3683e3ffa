"""Paddle's switches in one table: each optimizer switch (`lars`, `lamb`, `dgc`, `localsgd`,
`adaptive_localsgd`, and Geo-SGD: `a_sync` with `a_sync_configs.k_steps`) with its facts, and the
step switches it and the others do not combine with, and why.

`read_plan` finds the switch that is on here, `rebuild` builds it, `applied_strategy` describes
it, and the plan and a step's sparse tables check every combination with `check_combination`.
A new optimizer switch is one row of `SWITCHES` (docs/architecture.md, "Add a switch").
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import optax

from fleetjax.optimizers._basic import PaddleOptimizer
from fleetjax.optimizers._dgc import dgc
from fleetjax.optimizers._geo import geo_sgd
from fleetjax.optimizers._lamb import lamb
from fleetjax.optimizers._lars import lars
from fleetjax.optimizers._localsgd import adaptive_localsgd, localsgd
from fleetjax.vocabulary import DATA_AXES

__all__ = ["GEO", "STEP_SWITCHES", "SWITCHES", "Switch", "check_combination", "rebuild"]

# (the user's optimizer, the switch's configs, the data axes) -> the optimizer that trains
Build = Callable[[Any, Mapping[str, Any], tuple[str, ...]], optax.GradientTransformation]


@dataclasses.dataclass(frozen=True)
class Switch:
    """One of Paddle's optimizer switches and its facts.

    Attributes:
      name: the strategy's bool field that turns it on (`flag`), else the plan's name for it.
      configs: the strategy's `*_configs` field its settings come from.
      what: what it does, as `applied_strategy` says.
      build: ``build(user_optimizer, configs, data_axes)``: the optimizer that trains.
      needs: the user optimizer kinds Paddle applies it to (its `_can_apply`); () any.
      hyperparams: whether it is rebuilt from the user's hyper-parameters, so it needs an
        optimizer of `fleetjax.optimizers` (a `PaddleOptimizer`).
      replicas: the data-parallel replicas it needs at least (Paddle applies DGC and LocalSGD
        only on several cards).
      per_replica: whether each replica steps its own optimizer state (it communicates itself,
        inside `jax.shard_map` over the data axes).
      replica_params: whether each replica's parameters drift apart between its syncs too.
      flag: whether `strategy.<name>` turns it on.
      label: how messages name it, formatted with its configs (default: its name).
      clashes: the step switches (`STEP_SWITCHES`) it does not combine with, and why.
    """

    name: str
    configs: str
    what: str
    build: Build
    needs: tuple[str, ...] = ()
    hyperparams: bool = False
    replicas: int = 1
    per_replica: bool = False
    replica_params: bool = False
    flag: bool = True
    label: str = ""
    clashes: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.label:
            object.__setattr__(self, "label", self.name)


# The step switches that clash with a switch or each other, with how messages name them.
STEP_SWITCHES: Mapping[str, str] = types.MappingProxyType(
    {
        "sharding": "ZeRO sharding",
        "sharding_stage_2": "ZeRO stage 2/3",
        "pipeline": "the pipeline",
        "fp16_allreduce": "fp16_allreduce",
        "use_hierarchical_allreduce": "use_hierarchical_allreduce",
        "merge_across_calls": "gradient merge across calls",
        "sparse_tables": "a model with sparse tables",
        "host_tables": "a sparse table in pinned host memory",
    }
)

_OWN_COMMUNICATION = {
    "sharding": (
        "it keeps per-replica optimizer state, ZeRO splits one copy of it over the sharding axis"
    ),
    "pipeline": (
        "it steps each data-parallel replica's optimizer inside its own shard_map, which the "
        "pipeline's program over pp cannot run in"
    ),
    "use_hierarchical_allreduce": "it does its own communication",
    "fp16_allreduce": (
        "it does its own communication, with no dense gradient all-reduce to run in half precision"
    ),
}
_LOCAL = types.MappingProxyType(
    {**_OWN_COMMUNICATION, "sparse_tables": "it steps each replica's own optimizer"}
)

# Clashes of step switches with each other.
_STEP_CLASHES = {
    ("use_hierarchical_allreduce", "sharding_stage_2"): (
        "it reduce-scatters the gradients over the sharding axis"
    ),
    ("sparse_tables", "pipeline"): "a table is looked up in the model's first stage only",
    ("sparse_tables", "merge_across_calls"): (
        "a table's touched rows change from step to step; use the in-step merge, "
        "Strategy.gradient_merge or gradient_merge_configs.mode='in_step'"
    ),
}


def _clipped(hp: Mapping[str, Any], rebuilt: PaddleOptimizer) -> PaddleOptimizer:
    """`rebuilt` after the user's global-norm or by-value clip (the classes' grad_clip), as in
    the user's optimizer."""
    grad_clip = hp.get("grad_clip")
    if grad_clip is None:
        return rebuilt
    tx = optax.chain(grad_clip.transformation(), rebuilt)
    hyperparams = {**rebuilt.hyperparams, "grad_clip": grad_clip}
    return PaddleOptimizer(tx.init, tx.update, rebuilt.kind, hyperparams)


def _lars(user: PaddleOptimizer, configs: Mapping[str, Any], axes: tuple[str, ...]) -> Any:
    hp = user.hyperparams
    if hp["use_nesterov"]:
        raise ValueError(
            "strategy.lars: Paddle's lars_momentum has no Nesterov variant (Paddle drops "
            "use_nesterov); build the Momentum with use_nesterov=False"
        )
    return _clipped(
        hp,
        lars(
            hp["learning_rate"],
            hp["momentum"],
            configs["lars_coeff"],
            configs["lars_weight_decay"],
            configs["epsilon"],
            configs["exclude_from_weight_decay"],
            weight_decay=hp["weight_decay"],
            clip_norm=hp["clip_norm"],
        ),
    )


def _lamb(user: PaddleOptimizer, configs: Mapping[str, Any], axes: tuple[str, ...]) -> Any:
    hp = user.hyperparams
    if hp["weight_decay"]:
        raise ValueError(
            f"strategy.lamb: the Adam's weight_decay={hp['weight_decay']} would be lost "
            "(Paddle's Lamb decays by lamb_configs['lamb_weight_decay'] instead); build the "
            "Adam without weight_decay"
        )
    return _clipped(
        hp,
        lamb(
            hp["learning_rate"],
            configs["lamb_weight_decay"],
            hp["beta1"],
            hp["beta2"],
            hp["epsilon"],
            configs["exclude_from_weight_decay"],
            clip_norm=hp["clip_norm"],
        ),
    )


def _dgc(user: PaddleOptimizer, configs: Mapping[str, Any], axes: tuple[str, ...]) -> Any:
    hp = user.hyperparams
    if hp.get("grad_clip") is not None:
        raise TypeError(
            "strategy.dgc: the Momentum's grad_clip must be a ClipGradByNorm, because Paddle's "
            f"DGCMomentumOptimizer only supports ClipGradByNorm; got {hp['grad_clip']!r}"
        )
    return dgc(
        hp["learning_rate"],
        hp["momentum"],
        use_nesterov=hp["use_nesterov"],
        weight_decay=hp["weight_decay"],
        clip_norm=hp["clip_norm"],
        rampup_begin_step=configs["rampup_begin_step"],
        rampup_step=configs["rampup_step"],
        sparsity=configs["sparsity"],
        axis_names=axes,
    )


LARS = Switch(
    "lars",
    "lars_configs",
    "a Momentum is rebuilt as LARS momentum",
    _lars,
    needs=("Momentum",),
    hyperparams=True,
)
LAMB = Switch(
    "lamb", "lamb_configs", "an Adam is rebuilt as LAMB", _lamb, needs=("Adam",), hyperparams=True
)
DGC = Switch(
    "dgc",
    "dgc_configs",
    "a Momentum is rebuilt as DGC momentum (top-k sparse exchange)",
    _dgc,
    needs=("Momentum",),
    hyperparams=True,
    replicas=2,
    per_replica=True,
    clashes=_LOCAL,
)
LOCALSGD = Switch(
    "localsgd",
    "localsgd_configs",
    "each replica trains its own parameters, averaged periodically",
    lambda user, c, axes: localsgd(user, c["k_steps"], c["begin_step"], axes),
    needs=("SGD", "Momentum"),
    replicas=2,
    per_replica=True,
    replica_params=True,
    clashes=_LOCAL,
)
ADAPTIVE_LOCALSGD = Switch(
    "adaptive_localsgd",
    "adaptive_localsgd_configs",
    "each replica trains its own parameters, averaged at an interval that follows the loss",
    lambda user, c, axes: adaptive_localsgd(user, c["init_k_steps"], c["begin_step"], axes),
    needs=("SGD", "Momentum"),
    replicas=2,
    per_replica=True,
    replica_params=True,
    clashes=_LOCAL,
)
# Paddle's parameter-server mode with a_sync=True and a_sync_configs.k_steps > 0: it wraps any
# optimizer, on any number of replicas, and a step's sparse tables exchange their rows too.
GEO = Switch(
    "geo",
    "a_sync_configs",
    "each replica trains its own parameters and, every k_steps steps, exchanges their changes "
    "(Geo-SGD)",
    lambda user, c, axes: geo_sgd(user, c["k_steps"], axes),
    per_replica=True,
    replica_params=True,
    flag=False,
    label="Geo-SGD (a_sync=True, a_sync_configs.k_steps={k_steps})",
    clashes=types.MappingProxyType(
        {
            **_OWN_COMMUNICATION,
            "host_tables": (
                "each replica keeps and exchanges a whole copy of the table; use "
                "memory_kind='device', or the synchronous step (a_sync=False)"
            ),
        }
    ),
)

SWITCHES: Mapping[str, Switch] = types.MappingProxyType(
    {s.name: s for s in (LARS, LAMB, DGC, LOCALSGD, ADAPTIVE_LOCALSGD, GEO)}
)


def _clashes() -> dict[tuple[str, str], str]:
    """Every pair that does not combine, step switch first, and why."""
    found = dict(_STEP_CLASHES)
    for switch in SWITCHES.values():
        found.update({(step, switch.name): why for step, why in switch.clashes.items()})
    return found


def check_combination(on: Mapping[str, str]) -> None:
    """Raise for the first pair of switches in `on` (switch or step-switch name -> how to name
    it) that do not combine.

    Raises:
      ValueError: naming both and why.
    """
    for (a, b), why in _clashes().items():
        if a in on and b in on:
            raise ValueError(f"{on[a]} does not combine with {on[b]}: {why}")


def _kind_check(switch: Switch, optimizer: Any) -> None:
    needs = " or ".join(switch.needs)
    if not isinstance(optimizer, PaddleOptimizer):
        if switch.hyperparams:
            constructor = f"fleetjax.optimizers.{switch.needs[0].lower()}(...)"
            raise TypeError(
                f"strategy.{switch.name} rebuilds the optimizer from the user's {needs}, as "
                "Paddle does, so it needs to know its hyper-parameters: pass "
                f"{constructor} instead of {type(optimizer).__name__}"
            )
        return  # a wrapper takes any optax transformation as it is
    if switch.needs and optimizer.kind not in switch.needs:
        raise ValueError(
            f"strategy.{switch.name} needs the optimizer to be {needs} (Paddle does not apply "
            f"it to {optimizer.kind} and trains without it), got {optimizer!r}"
        )


def rebuild(
    optimizer: optax.GradientTransformation,
    switch: str,
    configs: Mapping[str, Any],
    data_parallel_size: int,
    axis_names: Sequence[str] = DATA_AXES,
) -> optax.GradientTransformation:
    """The optimizer Paddle's `switch` (a name in `SWITCHES`) trains with, from the user's
    `optimizer` and the switch's `configs` (its `*_configs`, e.g. a plan's `OptimizerSwitch`).

    `lars` turns a Momentum into `lars(...)`, `lamb` an Adam into `lamb(...)`, `dgc` a
    Momentum into `dgc(...)`; `localsgd`, `adaptive_localsgd` and `geo` (Geo-SGD) wrap the
    optimizer. The per-replica results (DGC, LocalSGD, Geo-SGD) run inside `jax.shard_map`
    over `axis_names`, on each replica's local gradients and state.

    Raises:
      TypeError: if a switch must rebuild a plain optax transformation (it needs one from
        `fleetjax.optimizers`).
      ValueError: if a switch cannot apply where Paddle would silently drop it: the wrong kind
        of optimizer (LARS on Adam, ...), DGC or LocalSGD with one data-parallel replica, or a
        setting the rebuild would lose.
    """
    if switch not in SWITCHES:
        raise ValueError(f"switch must be one of {', '.join(SWITCHES)}, got {switch!r}")
    row = SWITCHES[switch]
    _kind_check(row, optimizer)
    if data_parallel_size < row.replicas:
        raise ValueError(
            f"strategy.{switch} needs more than one data-parallel replica (Paddle applies it "
            f"only on several cards); data_parallel_size is {data_parallel_size}"
        )
    return row.build(optimizer, configs, tuple(axis_names))
