"""Paddle's optimizer switches: rebuilds for LARS, LAMB and DGC, wrappers for LocalSGD,
Adaptive LocalSGD and Geo-SGD (`a_sync` with `a_sync_configs.k_steps`), refusing with a clear
error what Paddle would silently drop."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optax

from fleetjax.mesh import DATA_AXES
from fleetjax.optimizers._basic import PaddleOptimizer
from fleetjax.optimizers._dgc import dgc
from fleetjax.optimizers._geo import geo_sgd
from fleetjax.optimizers._lamb import lamb
from fleetjax.optimizers._lars import lars
from fleetjax.optimizers._localsgd import adaptive_localsgd, localsgd

# Paddle's `_can_apply`: the user optimizer each switch accepts.
_NEEDS = {
    "lars": ("Momentum",),
    "lamb": ("Adam",),
    "dgc": ("Momentum",),
    "localsgd": ("SGD", "Momentum"),
    "adaptive_localsgd": ("SGD", "Momentum"),
}
_REBUILT = ("lars", "lamb", "dgc")  # these need the user's hyper-parameters


def _kind_check(switch: str, optimizer: Any) -> None:
    needs = " or ".join(_NEEDS[switch])
    if not isinstance(optimizer, PaddleOptimizer):
        if switch in _REBUILT:
            constructor = f"fleetjax.optimizers.{_NEEDS[switch][0].lower()}(...)"
            raise TypeError(
                f"strategy.{switch} rebuilds the optimizer from the user's {needs}, as Paddle "
                f"does, so it needs to know its hyper-parameters: pass {constructor} "
                f"instead of {type(optimizer).__name__}"
            )
        return  # LocalSGD wraps any optax transformation as it is
    if optimizer.kind not in _NEEDS[switch]:
        raise ValueError(
            f"strategy.{switch} needs the optimizer to be {needs} (Paddle does not apply it "
            f"to {optimizer.kind} and trains without it), got {optimizer!r}"
        )


def rebuild(
    optimizer: optax.GradientTransformation,
    switch: str,
    configs: Mapping[str, Any],
    data_parallel_size: int,
    axis_names: Sequence[str] = DATA_AXES,
) -> optax.GradientTransformation:
    """The optimizer Paddle's `switch` trains with, from the user's `optimizer` and the
    switch's `configs` (its `*_configs`, e.g. a plan's `OptimizerSwitch`).

    `lars` turns a Momentum into `lars(...)`, `lamb` an Adam into `lamb(...)`, `dgc` a
    Momentum into `dgc(...)`; `localsgd`, `adaptive_localsgd` and `geo` (Geo-SGD) wrap the
    optimizer. The DGC, LocalSGD and Geo-SGD results run inside `jax.shard_map` over
    `axis_names`, on each replica's local gradients and state.

    Raises:
      TypeError: if a switch must rebuild a plain optax transformation (it needs one from
        `fleetjax.optimizers`).
      ValueError: if a switch cannot apply where Paddle would silently drop it: the wrong kind
        of optimizer (LARS on Adam, ...), DGC or LocalSGD with one data-parallel replica, or a
        setting the rebuild would lose.
    """
    if switch == "geo":  # wraps any optimizer, on any number of replicas
        return geo_sgd(optimizer, configs["k_steps"], axis_names)
    if switch not in _NEEDS:
        raise ValueError(f"switch must be one of {', '.join(_NEEDS)}, geo, got {switch!r}")
    _kind_check(switch, optimizer)
    if switch in ("dgc", "localsgd", "adaptive_localsgd") and data_parallel_size < 2:
        raise ValueError(
            f"strategy.{switch} needs more than one data-parallel replica (Paddle applies it "
            f"only on several cards); data_parallel_size is {data_parallel_size}"
        )
    if switch == "localsgd":
        return localsgd(optimizer, configs["k_steps"], configs["begin_step"], axis_names)
    if switch == "adaptive_localsgd":
        return adaptive_localsgd(
            optimizer, configs["init_k_steps"], configs["begin_step"], axis_names
        )
    hp = dict(optimizer.hyperparams)
    # A global-norm or by-value clip (the classes' grad_clip) goes first, as in the user's.
    grad_clip = hp.get("grad_clip")
    if switch == "dgc" and grad_clip is not None:
        raise TypeError(
            "strategy.dgc: the Momentum's grad_clip must be a ClipGradByNorm, because Paddle's "
            f"DGCMomentumOptimizer only supports ClipGradByNorm; got {grad_clip!r}"
        )
    rebuilt = _rebuilt(switch, hp, configs, axis_names)
    if grad_clip is None:
        return rebuilt
    tx = optax.chain(grad_clip.transformation(), rebuilt)
    hyperparams = {**rebuilt.hyperparams, "grad_clip": grad_clip}
    return PaddleOptimizer(tx.init, tx.update, rebuilt.kind, hyperparams)


def _rebuilt(
    switch: str, hp: dict[str, Any], configs: Mapping[str, Any], axis_names: Sequence[str]
) -> PaddleOptimizer:
    """LARS, LAMB or DGC from the user's hyper-parameters `hp` and the switch's configs."""
    if switch == "lars":
        if hp["use_nesterov"]:
            raise ValueError(
                "strategy.lars: Paddle's lars_momentum has no Nesterov variant (Paddle drops "
                "use_nesterov); build the Momentum with use_nesterov=False"
            )
        return lars(
            hp["learning_rate"],
            hp["momentum"],
            configs["lars_coeff"],
            configs["lars_weight_decay"],
            configs["epsilon"],
            configs["exclude_from_weight_decay"],
            weight_decay=hp["weight_decay"],
            clip_norm=hp["clip_norm"],
        )
    if switch == "lamb":
        if hp["weight_decay"]:
            raise ValueError(
                f"strategy.lamb: the Adam's weight_decay={hp['weight_decay']} would be lost "
                "(Paddle's Lamb decays by lamb_configs['lamb_weight_decay'] instead); build the "
                "Adam without weight_decay"
            )
        return lamb(
            hp["learning_rate"],
            configs["lamb_weight_decay"],
            hp["beta1"],
            hp["beta2"],
            hp["epsilon"],
            configs["exclude_from_weight_decay"],
            clip_norm=hp["clip_norm"],
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
        axis_names=axis_names,
    )
