"""Paddle's `get_lr` / `set_lr`: the learning rate that `inject_hyperparams` keeps in a state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from optax import InjectStatefulHyperparamsState

_HINT = (
    "build the optimizer with fleetjax.optimizers.sgd/momentum/adam/adamw (or wrap an optax "
    "one in optax.inject_hyperparams) so its learning rate lives in the state"
)


def _is_injected(node: Any) -> bool:
    return isinstance(node, InjectStatefulHyperparamsState) and "learning_rate" in node.hyperparams


def _the_injected(opt_state: Any) -> InjectStatefulHyperparamsState:
    found = [
        node for node in jax.tree.leaves(opt_state, is_leaf=_is_injected) if _is_injected(node)
    ]
    if not found:
        raise ValueError(f"opt_state holds no injected learning rate; {_HINT}")
    if len(found) > 1:
        raise ValueError(
            f"opt_state holds {len(found)} injected learning rates, so which one to read or set "
            "is ambiguous; inject the learning rate into one transformation only"
        )
    return found[0]


def get_lr(opt_state: Any) -> jax.Array:
    """The learning rate in `opt_state` (Paddle's `get_lr`): the value of the latest step, or
    of the first step before any. Found inside chained or wrapped states.

    Raises:
      ValueError: if the state holds no injected learning rate, or several.
    """
    return _the_injected(opt_state).hyperparams["learning_rate"]


def set_lr(opt_state: Any, value: float | jax.Array) -> Any:
    """`opt_state` with its learning rate set to `value` (Paddle's `set_lr`), used from the next
    step on.

    Raises:
      ValueError: if the state holds no injected learning rate or several, or if the learning
        rate follows a schedule (Paddle: "optimizer's learning rate can't be LRScheduler").
    """
    injected = _the_injected(opt_state)
    if "learning_rate" in injected.hyperparams_states:
        raise ValueError(
            "set_lr cannot change a learning rate that follows a schedule (it is recomputed "
            "from the schedule every step); build the optimizer with a constant learning rate"
        )
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number, jax.Array)):
        raise TypeError(f"set_lr needs a number, got {value!r}")
    if jnp.ndim(value) != 0:
        raise TypeError(f"set_lr needs a scalar, got shape {jnp.shape(value)}")
    new = jnp.asarray(value, injected.hyperparams["learning_rate"].dtype)

    def replace(node: Any) -> Any:
        if _is_injected(node):
            return node._replace(hyperparams={**node.hyperparams, "learning_rate": new})
        return node

    return jax.tree.map(replace, opt_state, is_leaf=_is_injected)
