"""Parameter path names: how `exclude_from_weight_decay` finds a parameter in a pytree.

Paddle matches `lars_configs` / `lamb_configs["exclude_from_weight_decay"]` against a parameter's
name (`fc_0.b_0`). A JAX parameter has no name, only a path in the params pytree; its name here
is that path's keys joined with "/": dict keys and attribute names as they are, sequence
positions as numbers. `{"params": {"dense_0": {"bias": b}}}` names `b` `"params/dense_0/bias"`,
and `[w, b]` names them `"0"` and `"1"`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):  # DictKey / FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def param_names(params: Any) -> Any:
    """A pytree like `params` holding each parameter's path name, e.g. `"params/dense_0/bias"`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "/".join(_key_name(k) for k in path), params
    )


def check_names(exclude_from_weight_decay: Sequence[str], argument: str) -> tuple[str, ...]:
    """`exclude_from_weight_decay` as a tuple of strings, or a TypeError naming `argument`."""
    if isinstance(exclude_from_weight_decay, str) or not all(
        isinstance(n, str) for n in exclude_from_weight_decay
    ):
        raise TypeError(
            f"{argument} must be a list of parameter name parts (str), "
            f"got {exclude_from_weight_decay!r}"
        )
    return tuple(exclude_from_weight_decay)
