"""Logical axis names to fleetjax mesh axes: parameter PartitionSpecs and activation constraints.

Parameters and activations name their dimensions with *logical* axes (``"vocab"``, ``"embed"``,
``"mlp"``, ``"activation_batch"``, ...), as flax does (`nnx.with_partitioning`,
`nn.with_logical_partitioning`); rules map each logical name to mesh axes (``dp``, ``sharding``,
``pp``, ``mp``, ``ep``) or to None (not split). The same model then splits differently under
different rules, and runs unsplit with no mesh at all.

Rules are ``(logical name, mesh axes)`` pairs in priority order, with flax linen's semantics:
going down the rules, a dimension takes the first rule for its name whose mesh axes no other
dimension of the array holds yet; a dimension no rule can place is not split. Mesh axes that the
mesh lacks (or that are manual, inside a `shard_map`) are left out, as if of size 1. The rules in
force are, first,
those passed as ``rules=`` or else set with flax's ``nnx.logical_axis_rules(...)`` context, then
`DEFAULT_RULES`: so overriding a name is prepending a rule for it. A name no rule mentions is an
error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from flax.linen.spmd import LogicallyPartitioned
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from fleetjax.vocabulary import DATA_AXES, SEQUENCE_AXES

__all__ = [
    "DEFAULT_RULES",
    "LogicalNames",
    "LogicalRules",
    "constrain",
    "current_rules",
    "free_axes",
    "logical_to_spec",
    "out_sharding",
    "partition_specs",
]

LogicalNames: TypeAlias = tuple[str | None, ...]
MeshAxes: TypeAlias = str | tuple[str, ...] | None
LogicalRules: TypeAlias = Sequence[tuple[str, MeshAxes]]

DEFAULT_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # Parameters: Megatron splits the vocabulary, the MLP's hidden units and the attention heads
    # over mp; everything else is whole on every device.
    ("vocab", "mp"),
    ("mlp", "mp"),
    ("heads", "mp"),
    ("embed", None),
    ("kv", None),
    ("layers", None),
    # A MoE layer's experts split over the expert axis; an expert's hidden units over mp
    # (expert tensor parallelism; rule "expert_mlp" to None for whole experts).
    ("expert", "ep"),
    ("expert_mlp", "mp"),
    # A sparse table's rows are split over every device (fleetjax.layers.SparseEmbedding).
    ("table_rows", ("dp", "sharding", "pp", "mp")),
    # Activations: the batch is split over the data axes, features as their weights are, the
    # sequence over the sequence axes (segment and context parallelism).
    ("activation_batch", DATA_AXES),
    ("activation_length", SEQUENCE_AXES),
    ("activation_embed", None),
    ("activation_mlp", "mp"),
    ("activation_heads", "mp"),
    ("activation_kv", None),
    ("activation_vocab", "mp"),
    # Megatron's sequence parallelism: outside the tensor-parallel matmuls (LayerNorm, dropout,
    # the residual stream) the sequence is split over mp too.
    ("activation_norm_length", (*SEQUENCE_AXES, "mp")),
    # Inside Ulysses' all-to-all (fleetjax.layers.attention): the sequence whole within a cp
    # block, the heads over mp x sep.
    ("activation_attention_length", "cp"),
    ("activation_attention_heads", ("mp", "sep")),
)


def current_rules(rules: LogicalRules | None = None) -> tuple[tuple[str, MeshAxes], ...]:
    """The rules in force: `rules` (default: flax's ``nnx.logical_axis_rules`` context), then
    `DEFAULT_RULES`."""
    first = flax_spmd.get_logical_axis_rules() if rules is None else rules
    return (*_checked_rules(first), *DEFAULT_RULES)


def _checked_rules(rules: LogicalRules) -> tuple[tuple[str, MeshAxes], ...]:
    checked = []
    for rule in rules:
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
        axes = rule[1] if ok else None
        ok = ok and (
            axes is None
            or isinstance(axes, str)
            or (isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes))
        )
        if not ok:
            raise ValueError(
                "rules must be (logical name, mesh axes) pairs, the mesh axes a name, a tuple "
                f"of names or None, e.g. ('mlp', 'mp'); got {rule!r}"
            )
        checked.append((rule[0], tuple(axes) if isinstance(axes, list) else axes))
    return tuple(checked)


def logical_to_spec(
    names: LogicalNames,
    *,
    rules: LogicalRules | None = None,
    mesh: Mesh | AbstractMesh | None = None,
    taken: Sequence[str] = (),
) -> PartitionSpec:
    """The PartitionSpec for an array whose dimensions have the logical `names`.

    Args:
      names: one logical name per dimension; None for a dimension that is never split.
      rules: rules placed before `DEFAULT_RULES` (default: flax's rules context).
      mesh: if given, mesh axes it lacks, or has as manual axes, are left out.
      taken: mesh axes already used by other dimensions of the array.

    Raises:
      ValueError: if a name has no rule.
    """
    return _resolve(tuple(names), current_rules(rules), mesh, taken)


def _resolve(
    names: LogicalNames,
    rules: tuple[tuple[str, MeshAxes], ...],
    mesh: Mesh | AbstractMesh | None,
    taken: Sequence[str],
) -> PartitionSpec:
    """`logical_to_spec` with the rules in force already worked out."""
    known = {name for name, _ in rules}
    unknown = [n for n in names if n is not None and n not in known]
    if unknown:
        raise ValueError(
            f"no axis rule for the logical name(s) {unknown} (of {names}); add a rule, "
            "e.g. partition_specs(..., rules=[(name, 'mp')]) or flax's "
            f"nnx.logical_axis_rules([...]). Names with rules: {sorted(known)}"
        )
    usable = None if mesh is None else set(free_axes(mesh))
    assigned: list[tuple[str, ...] | None] = [None] * len(names)
    used = set(taken)
    for rule_name, rule_axes in rules:
        axes = () if rule_axes is None else _axes(rule_axes)
        if usable is not None:
            axes = tuple(a for a in axes if a in usable)
        for i, name in enumerate(names):
            if name == rule_name and assigned[i] is None and not used & set(axes):
                assigned[i] = axes
                used |= set(axes)
    return PartitionSpec(*(_entry(a) for a in assigned))


def _entry(axes: tuple[str, ...] | None) -> MeshAxes:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def free_axes(mesh: Mesh | AbstractMesh) -> tuple[str, ...]:
    """The mesh axes a spec may use: all but the manual ones (inside a `shard_map`)."""
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return tuple(a for a in mesh.axis_names if types[a] != AxisType.Manual)


# -- parameters --------------------------------------------------------------------------------


def partition_specs(
    params: Any,
    names: Any = None,
    *,
    rules: LogicalRules | None = None,
    mesh: Mesh | None = None,
) -> Any:
    """PartitionSpecs over mesh axes for every array in `params`, from logical axis names.

    `params` is either a pytree that carries its names: a flax nnx Module, or an `nnx.State`
    (from `nnx.split` / `nnx.state`) whose Variables have ``out_sharding`` metadata
    (`nnx.with_partitioning`), or flax linen variables with `nn.LogicallyPartitioned` boxes;
    or a plain pytree of arrays (or `jax.ShapeDtypeStruct`s) with `names`, a pytree of the same
    structure whose leaves are tuples of logical names (or None: not split).

    Returns:
      A pytree like `params` with a `PartitionSpec` per array: an nnx Variable keeps its wrapper
      (as `nnx.get_partition_spec` does, so the result matches the `nnx.State` it came from;
      `nnx.to_pure_dict` of it matches `nnx.to_pure_dict(state)`); a linen box becomes the bare
      spec (matching `nn.unbox(variables)`); arrays without names are replicated, ``P()``.
      Pass them as `jax.jit` ``in_shardings`` (wrapped in `NamedSharding(mesh, spec)`) or to
      `jax.device_put`.

    Args:
      params: the parameters (arrays or shapes), see above.
      names: logical names for a plain `params` pytree; None to read them from `params`.
      rules: rules placed before `DEFAULT_RULES` (default: flax's ``nnx.logical_axis_rules``).
      mesh: if given, axes it lacks are dropped and every split dimension is checked to divide
        evenly over its mesh axes.

    Raises:
      ValueError: for a name without a rule, names that do not fit an array's rank, or (with
        `mesh`) a dimension that does not split evenly; each message names the parameter.
    """
    resolved = current_rules(rules)

    def spec(path: Any, logical: Any, value: Any) -> PartitionSpec:
        where = "params" + jax.tree_util.keystr(path)
        shape = tuple(getattr(value, "shape", np.shape(value)))
        if logical is None:
            return PartitionSpec()
        logical = tuple(logical)
        if len(logical) != len(shape):
            raise ValueError(
                f"{where} has shape {shape} but {len(logical)} logical axis names {logical}"
            )
        result = _resolve(logical, resolved, mesh, ())
        if mesh is not None:
            _check_divisible(where, shape, logical, result, mesh)
        return result

    if isinstance(params, nnx.Module):
        params = nnx.state(params)
    if names is not None:
        return jax.tree_util.tree_map_with_path(spec, names, params, is_leaf=_is_names)

    def leaf(path: Any, x: Any) -> Any:
        if isinstance(x, nnx.Variable):
            return x.replace(spec(path, x.get_metadata().get("out_sharding"), x.get_value()))
        if isinstance(x, LogicallyPartitioned):
            return spec(path, x.names, x.value)
        return spec(path, None, x)

    boxed = lambda x: isinstance(x, (nnx.Variable, LogicallyPartitioned))  # noqa: E731
    return jax.tree_util.tree_map_with_path(leaf, params, is_leaf=boxed)


def _is_names(x: Any) -> bool:
    return x is None or (isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x))


def _check_divisible(
    where: str, shape: tuple[int, ...], logical: LogicalNames, spec: PartitionSpec, mesh: Mesh
) -> None:
    for dim, (size, name, axes) in enumerate(zip(shape, logical, spec, strict=True)):
        axes = () if axes is None else _axes(axes)
        ways = math.prod(mesh.shape[a] for a in axes)
        if size % ways:
            split = " x ".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise ValueError(
                f"{where} has shape {shape}: dimension {dim} ({name!r}, size {size}) does not "
                f"split evenly over {split}"
            )


# -- activations -------------------------------------------------------------------------------


def constrain(
    x: jax.Array,
    names: LogicalNames,
    *,
    rules: LogicalRules | None = None,
    axis: int | None = None,
) -> jax.Array:
    """`x` with its trailing dimensions (or those from `axis` on) split as the logical `names`
    say.

    `names` name the last ``len(names)`` dimensions, or with `axis` the ``len(names)``
    dimensions from `axis` on; the others keep their sharding. The
    mesh is the one set with `jax.set_mesh`, else the one `x`'s type carries (an array placed
    with a `NamedSharding`); with neither, `x` is returned as is (one device: nothing to split).
    On `AxisType.Auto` axes this is `jax.lax.with_sharding_constraint` (a hint GSPMD follows);
    on `AxisType.Explicit` axes, `jax.sharding.reshard` (the sharding is part of the type).
    """
    keep = x.ndim - len(names) if axis is None else axis % x.ndim
    target = _target(x, keep, names, rules, x.ndim - keep - len(names))
    if target is None:
        return x
    sharding, explicit = target
    if explicit:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def out_sharding(
    like: jax.Array, keep: int, names: LogicalNames, *, rules: LogicalRules | None = None
) -> NamedSharding | None:
    """The ``out_sharding=`` to give an operation on `AxisType.Explicit` axes (a matmul over a
    split contracting dimension, a gather from a split table): the sharding of `like`'s first
    `keep` dimensions followed by the logical `names`. None on Auto axes or with no mesh, where
    the compiler chooses (and `constrain` guides it)."""
    target = _target(like, keep, names, rules)
    return target[0] if target is not None and target[1] else None


def _target(
    x: jax.Array, keep: int, names: LogicalNames, rules: LogicalRules | None, after: int = 0
) -> tuple[NamedSharding, bool] | None:
    """(the sharding of `x`'s first `keep` dimensions, then `names`, then its last `after`
    dimensions, whether it is explicit)."""
    if keep < 0 or after < 0:
        raise ValueError(f"{len(names)} logical names {names} for an array of rank {x.ndim}")
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = getattr(jax.typeof(x).sharding, "mesh", mesh)
    free = free_axes(mesh) if not mesh.empty else ()
    if not free:
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    kinds = {types[a] for a in free}
    if len(kinds) > 1:
        raise ValueError(
            "fleetjax layers need the mesh's non-manual axes to be all Auto or all Explicit, "
            f"got {dict((a, types[a].name) for a in free)}"
        )
    explicit = kinds == {AxisType.Explicit}
    if explicit:
        current = tuple(jax.typeof(x).sharding.spec)
        kept = (*current, *(None,) * (x.ndim - len(current)))
    else:
        kept = (PartitionSpec.UNCONSTRAINED,) * x.ndim
    lead, tail = kept[:keep], kept[x.ndim - after :] if after else ()
    taken = [a for entry in (*lead, *tail) if isinstance(entry, (str, tuple)) for a in _axes(entry)]
    named = _resolve(tuple(names), current_rules(rules), mesh, taken)
    return NamedSharding(mesh, PartitionSpec(*lead, *named, *tail)), explicit


def _axes(entry: str | tuple[str, ...]) -> tuple[str, ...]:
    return (entry,) if isinstance(entry, str) else entry
