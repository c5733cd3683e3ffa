"""Paddle's `paddle.distributed.parallelize`: a single-device model and its optimizer made
distributed by a config, on the global mesh (`set_mesh`) or the one given.

    model, opt = dist.parallelize(model, opt, config={
        "dp_config": {"sharding_level": 1},                       # ZeRO-1 over the 'dp' dim
        "mp_config": {"parallelize_plan": {                       # tensor parallel over 'mp'
            "embed_tokens": [dist.RowWiseParallel(), dist.SequenceParallelBegin()],
            "layers.*.self_attn.qkv_proj": dist.ColWiseParallel(),
            "layers.*.self_attn.o_proj": dist.RowWiseParallel(),
            "layers.*.self_attn": dist.SequenceParallelDisable(),
            "lm_head": [dist.ColWiseParallel(), dist.SequenceParallelEnd()],
        }},
        "pp_config": {"split_spec": "layers"},                    # stages over 'pp'
    })

The plans place parameters with `shard_tensor` and give layers the layouts of fleetjax's
tensor-parallel layers (`_plans`); `split_spec` cuts the blocks into fleetjax's SPMD pipeline
(`_pipeline`); `sharding_level` is `shard_optimizer`'s `ShardingStage`. The model then trains
through the auto-parallel loop (`loss.backward(); opt.step()`) or `to_static`.
"""

from __future__ import annotations

import difflib
import re
import warnings
from collections.abc import Mapping
from typing import Any

from flax import nnx

from fleetjax._warnings import warn_once
from fleetjax.auto_parallel import ProcessMesh, get_mesh, set_mesh
from fleetjax.distributed._hooks import add_hooks
from fleetjax.distributed._pipeline import set_split_spec
from fleetjax.distributed._plans import PlanBase, SequenceParallelDisable
from fleetjax.distributed._shard import (
    ShardingStage1,
    ShardingStage2,
    ShardingStage3,
    shard_optimizer,
)
from fleetjax.nn import named_sublayers

__all__ = ["parallelize"]

_CONFIGS = ("dp_config", "mp_config", "pp_config", "cp_config")
_STAGES = {1: ShardingStage1, 2: ShardingStage2, 3: ShardingStage3}


def parallelize(
    model: nnx.Module,
    optimizer: Any = None,
    mesh: ProcessMesh | None = None,
    config: Mapping[str, Any] | None = None,
) -> Any:
    """Paddle's `parallelize(model, optimizer=None, mesh=None, config=None)`; returns
    `(model, optimizer)`: the model changed in place, and the optimizer as `shard_optimizer`
    makes it, training the model (None without one).

    `config` takes Paddle's keys: `dp_config` {"sharding_level": 0-3, "sharding_mesh_dim":
    "dp"}, `mp_config` {"parallelize_plan": {layer name or regex (or "<layer>.<param>"): plan
    or [plans]}}, `pp_config` {"split_spec": a prefix naming the blocks, or {layer name:
    SplitPoint}}; the mesh dimensions are Paddle's `dp`, `mp` and `pp`.

    Raises:
      ValueError: for a config key Paddle does not have, a plan key that matches no layer
        (naming it and the closest layer names), a split_spec that names no list of identical
        blocks or cuts it unevenly, or a mesh without the dimension a config needs.
      NotImplementedError: for `cp_config` (fleetjax's context parallelism is the `cp` axis of
        `DistributedStrategy` with `fleetjax.layers.attention`).
    """
    if config is None:
        warnings.warn("The `parallelize will do nothing since the config is `None`.", stacklevel=2)
        return model, optimizer
    if not isinstance(config, Mapping):
        raise TypeError(f"parallelize's config must be a dict, got {type(config).__name__}")
    unknown = [k for k in config if k not in _CONFIGS]
    if unknown:
        raise ValueError(f"parallelize's config keys are {list(_CONFIGS)}, got {unknown}")
    if mesh is not None:
        if not isinstance(mesh, ProcessMesh):
            raise TypeError(f"parallelize's mesh must be a ProcessMesh, got {mesh!r}")
        set_mesh(mesh)
    mesh = get_mesh()
    if mesh is None:
        raise ValueError("parallelize needs a mesh: pass mesh=..., or dist.set_mesh(mesh) first")
    if "cp_config" in config:
        raise NotImplementedError(
            "parallelize's cp_config: fleetjax's context parallelism is ring attention over a "
            "cp mesh axis (fleetjax.layers.attention, DistributedStrategy hybrid_configs "
            "cp_degree); its ContextParallel plans are not built"
        )
    if "pp_config" in config:
        pp = config["pp_config"]
        if "global_spec" in pp:
            warn_once(
                "pp_config's global_spec has no effect: fleetjax's pipeline runs one program, "
                "and every stage holds the layers outside the blocks"
            )
        set_split_spec(model, mesh, pp.get("split_spec"))
    if "mp_config" in config:
        apply_plans(model, mesh, config["mp_config"].get("parallelize_plan") or {})
    if optimizer is None:
        return model, None
    level, dim = 0, "dp"
    if "dp_config" in config:
        level = config["dp_config"].get("sharding_level", 0)
        dim = config["dp_config"].get("sharding_mesh_dim", "dp")
        if level not in (0, 1, 2, 3, "0", "1", "2", "3"):
            raise ValueError(f"dp_config's sharding_level must be 0, 1, 2 or 3, got {level!r}")
    stage = _STAGES[int(level)](dim, mesh) if int(level) else None
    sharded = shard_optimizer(optimizer, stage)
    if sharded.layer is not model:
        sharded.bind(model)
    return model, sharded


def apply_plans(model: nnx.Module, mesh: ProcessMesh, plan: Mapping[str, Any]) -> None:
    """Apply `parallelize_plan` to the model's layers, as Paddle matches them: a key is a layer
    name or a regular expression matching a whole name, or `<layer>.<parameter>` for one
    parameter; layers in a `SequenceParallelDisable` layer are told so.

    Raises:
      TypeError: for a value that is not a plan or a list of plans.
      ValueError: for a key that matches no layer (or parameter).
    """
    layers = named_sublayers(model)
    matched = {key: False for key in plan}
    disabled = [
        name
        for name, _ in layers
        for key, plans in plan.items()
        if _matches(key, name) and any(isinstance(p, SequenceParallelDisable) for p in _list(plans))
    ]
    for name, layer in layers:
        before, after = (), ()
        for key, plans in plan.items():
            target = _target(key, name, layer)
            if target is None:
                continue
            matched[key] = True
            resplit = any(name.startswith(d + ".") for d in disabled)
            for p in _list(plans):
                hooks = p.apply(layer, mesh, target, resplit)
                before, after = before + hooks[0], after + hooks[1]
        if before or after:
            add_hooks(layer, before, after)
    for key, found in matched.items():
        if not found:
            names = [n for n, _ in layers]
            close = difflib.get_close_matches(key, names, n=3)
            raise ValueError(
                f"parallelize_plan key {key!r} matches no layer of {type(model).__name__}"
                + (f" (close: {close})" if close else "")
                + f"; its layers are named like {names[:6]}"
            )


def _list(plans: Any) -> list[PlanBase]:
    found = list(plans) if isinstance(plans, list | tuple) else [plans]
    for p in found:
        if not isinstance(p, PlanBase):
            raise TypeError(
                "The value the the parallelize plan should be a instance of PlanBase or a "
                f"list of PlanBase, got {p!r}"
            )
    return found


def _matches(key: str, name: str) -> bool:
    return key == name or re.fullmatch(key, name) is not None


def _target(key: str, name: str, layer: nnx.Module) -> tuple[str, ...] | None:
    """The parameters `key` names in layer `name` (() for all of them), or None if it does
    not name the layer."""
    head, _, attr = key.rpartition(".")
    if head and isinstance(getattr(layer, attr, None), nnx.Param) and _matches(head, name):
        return (attr,)
    return () if _matches(key, name) else None
