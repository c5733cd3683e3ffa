"""Paddle's names for an optimizer state's entries (`DistModel.state_dict(mode="opt")`), and
back.

Paddle names an accumulator by its parameter and its kind, `<parameter>_<kind>_0`: Adam's
`moment1`, `moment2`, `beta1_pow_acc`, `beta2_pow_acc`, Momentum's `velocity`, and the learning
rate `learning_rate_0`; gradient merge's accumulated gradients are `<parameter>@GRAD@MERGED`.
fleetjax's optax states hold the same values (a `beta1_pow_acc` is `beta1 ** count`), named so
here with the parameter's dotted path (`fc1.kernel`; Paddle uses its unique name, `linear_0.w_0`,
in the optimizer's entries). An entry Paddle has no name for (a step counter, a hyperparameter
other than the rate) keeps fleetjax's path, `fleetjax:<path>`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["ParamNames", "from_paddle_names", "load_paddle_state", "paddle_names"]

# A parameter's path in the parameters' tree -> its names: (dotted name, index of the
# layer along a stacked leading axis or None).
ParamNames = Callable[[tuple[Any, ...]], list[tuple[str, int | None]]]

_KINDS = {"mu": "moment1", "nu": "moment2", "trace": "velocity"}


def _key(k: Any) -> Any:
    return getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))


def _entry(path: tuple[Any, ...]) -> tuple[str, tuple[Any, ...]] | None:
    """(Paddle's kind, the parameter's path) of a leaf of an accumulator over the parameters,
    or None."""
    for i, k in enumerate(path):
        name = getattr(k, "name", None)
        if name in _KINDS or name == "acc_grads":
            return name, tuple(_key(p) for p in path[i + 1 :])
    return None


def _pow_betas(path: tuple[Any, ...], state: Any) -> tuple[float, float] | None:
    """Adam's (beta1, beta2) for its step `count` at `path`, or None for any other leaf."""
    if getattr(path[-1], "name", None) != "count":
        return None
    node = state
    for k in path[:-1]:
        node = node[_key(k)] if not hasattr(k, "name") else getattr(node, k.name)
    if not hasattr(node, "mu") or not hasattr(node, "nu"):
        return None
    hyper = _hyperparams(state, path)
    return float(hyper.get("b1", 0.9)), float(hyper.get("b2", 0.999))


def _hyperparams(state: Any, path: tuple[Any, ...]) -> Mapping[str, Any]:
    """The `inject_hyperparams` values of the innermost node around `path` that has them."""
    found: Mapping[str, Any] = {}
    node = state
    for k in path:
        if hasattr(node, "hyperparams"):
            found = node.hyperparams
        node = node[_key(k)] if not hasattr(k, "name") else getattr(node, k.name)
    return found


def _names_of(path: tuple[Any, ...], state: Any, names: ParamNames) -> list[tuple[str, Any]]:
    """(Paddle's name, how its value comes from the leaf) for the leaf at `path`."""
    entry = _entry(path)
    if entry is not None:
        kind, param = entry
        suffix = "@GRAD@MERGED" if kind == "acc_grads" else f"_{_KINDS[kind]}_0"
        return [(f"{name}{suffix}", index) for name, index in names(param)]
    betas = _pow_betas(path, state)
    if betas is not None:
        mu = _node(state, path[:-1]).mu
        params = [tuple(_key(k) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(mu)[0]]
        return [
            (f"{name}_beta{b}_pow_acc_0", ("pow", beta))
            for p in params
            for name, _ in names(p)
            for b, beta in ((1, betas[0]), (2, betas[1]))
        ]
    if _key(path[-1]) == "learning_rate" and getattr(path[-2], "name", None) == "hyperparams":
        return [("learning_rate_0", None)]
    return [("fleetjax:" + ".".join(str(_key(k)) for k in path), None)]


def _node(state: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        state = state[_key(k)] if not hasattr(k, "name") else getattr(state, k.name)
    return state


def paddle_names(opt_state: Any, names: ParamNames) -> dict[str, jax.Array]:
    """The optimizer state's entries by Paddle's names (see the module)."""
    out: dict[str, jax.Array] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        for name, how in _names_of(path, opt_state, names):
            if isinstance(how, tuple):  # beta ** count, as Paddle's [1] accumulator
                out[name] = jax.numpy.reshape(how[1] ** leaf.astype(jax.numpy.float32), (1,))
            elif isinstance(how, int):
                out[name] = leaf[how]
            else:
                out.setdefault(name, leaf)
    return out


def from_paddle_names(
    state_dict: Mapping[str, Any], opt_state: Any, names: ParamNames
) -> dict[tuple, Any]:
    """The values `state_dict` (Paddle's names) gives each leaf of `opt_state`, by the leaf's
    path; Adam's step count from its `beta1_pow_acc`.

    Raises:
      ValueError: naming each missing entry and each entry the state has no place for.
    """
    values: dict[tuple, Any] = {}
    wanted: set[str] = set()
    missing: list[str] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        entries = _names_of(path, opt_state, names)
        wanted |= {n for n, _ in entries}
        present = [(n, h) for n, h in entries if n in state_dict]
        if len(present) < len(entries):
            missing += [n for n, _ in entries if n not in state_dict]
            continue
        name, how = present[0]
        if isinstance(how, tuple):
            values[path] = round(math.log(float(np.ravel(state_dict[name])[0])) / math.log(how[1]))
        elif isinstance(how, int):
            values[path] = np.stack([np.asarray(state_dict[n]) for n, _ in present])
        else:
            values[path] = state_dict[name]
    extra = sorted(n for n in state_dict if n not in wanted)
    if missing or extra:
        problems = [f"{n!r} is missing" for n in missing] + [
            f"{n!r} is not in the optimizer state" for n in extra
        ]
        raise ValueError("state_dict does not fit the optimizer state: " + "; ".join(problems))
    return values


def load_paddle_state(trainer: Any, state_dict: Mapping[str, Any], names: ParamNames) -> None:
    """`state_dict` (Paddle's names) into `trainer`'s optimizer state, placed as it is."""
    opt_state = trainer.state.opt_state
    values = from_paddle_names(state_dict, opt_state, names)
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    placed = [
        jax.device_put(np.asarray(values[path], x.dtype).reshape(x.shape), x.sharding)
        for path, x in leaves
    ]
    new = jax.tree.unflatten(jax.tree.structure(opt_state), placed)
    trainer.state = trainer.state._replace(opt_state=new)
