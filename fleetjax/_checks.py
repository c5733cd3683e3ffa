"""Checks a train step makes before anything runs, each naming the leaf, field or number."""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from fleetjax.train_state import TrainState
from fleetjax.transforms.pipeline import PipelineParams


def _name(root: str, path: Any) -> str:
    return root + jax.tree_util.keystr(path)


def check_model_state(has_state: bool, model_state: Any) -> None:
    """A model state is given exactly when the step was made with `has_state=True`."""
    if has_state and model_state is None:
        raise ValueError(
            "make_train_step(..., has_state=True) needs the model state: "
            "step.init(params, model_state=...)"
        )
    if not has_state and model_state is not None:
        raise ValueError(
            "a model_state was given, but the step was made without has_state=True, so the "
            "loss would never see it"
        )


def check_params(params: Any) -> None:
    """Every parameter leaf is a floating-point array (gradients flow through floats only).

    Raises:
      TypeError: naming the first leaf that is not, and its dtype.
    """
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            got = dtype if dtype is not None else type(x).__name__
            raise TypeError(
                f"{_name('params', path)} is {got}; parameters must be floating-point arrays "
                "(gradients flow through floats only): keep counters and other integers in the "
                "model state (make_train_step(..., has_state=True)) or outside the parameters"
            )


def check_state(state: Any, expected: TrainState, placement: Any) -> None:
    """`state` is a live train state of this step: a `TrainState` with the shapes and dtypes of
    `expected` (the step's abstract state), no array of it donated to an earlier call, and JAX
    arrays placed as `placement` (a `TrainState` of shardings) says.

    Raises:
      ValueError: naming the first leaf that differs and how.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"the state must be the TrainState step.init returned, got {type(state)}")
    leaves, tree = jax.tree_util.tree_flatten_with_path(state)
    want, want_tree = jax.tree_util.tree_flatten_with_path(expected)
    if tree != want_tree:
        raise ValueError(
            "this state does not fit the step (another optimizer, model or strategy made it): "
            f"its structure is {_summary(tree)}, the step's {_summary(want_tree)}"
        )
    shardings = jax.tree.leaves(_broadcast(placement, expected))
    for (path, x), (_, w), sharding in zip(leaves, want, shardings, strict=True):
        name = _name("state", path)
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ValueError(
                f"{name} was donated to an earlier call of the step, which consumed it: pass "
                "the state that call returned (state, metrics = step(state, batch))"
            )
        if (x.shape, x.dtype) != (w.shape, w.dtype):
            raise ValueError(
                f"{name} is {x.dtype}{list(x.shape)}, but the step's is {w.dtype}{list(w.shape)} "
                "(a state from another model, optimizer or strategy)"
            )
        if isinstance(x, jax.Array) and not x.sharding.is_equivalent_to(sharding, x.ndim):
            raise ValueError(
                f"{name} is placed as {_placed(x.sharding)}, but this step places it as "
                f"{_placed(sharding)} (a state from another mesh or ZeRO stage): restore it "
                "with this step's placement (CheckpointManager.restore(step.abstract_state))"
            )


def _broadcast(prefix: Any, tree: Any) -> Any:
    """`prefix` (one sharding per subtree) repeated for every leaf of `tree`."""
    return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), prefix, tree)


def _placed(sharding: jax.sharding.Sharding) -> str:
    spec = getattr(sharding, "spec", sharding)
    memory = getattr(sharding, "memory_kind", None)
    return f"{spec}" + (f" in {memory} memory" if memory not in (None, "device") else "")


def _summary(tree: jax.tree_util.PyTreeDef) -> str:
    text = str(tree)
    return text if len(text) < 200 else text[:200] + "..."


def check_pipeline_layers(tree: Any, pp: int, vpp: int, name: str = "params") -> None:
    """The stacked layers of `tree` (the parameters, or the model state, `name`) split into
    `pp` x `vpp` equal chunks (checked before placement, so the error is this one and not the
    sharding's). A model state may have no layers' state.

    Raises:
      TypeError: if `tree` is not a `PipelineParams`.
      ValueError: for layers of different lengths, or a length that does not split.
    """
    if not isinstance(tree, PipelineParams):
        raise TypeError(
            f"under a pipeline, {name} must be a fleetjax PipelineParams(embed, layers, head), "
            f"got {type(tree).__name__}"
        )
    lengths = {x.shape[0] if x.shape else None for x in jax.tree.leaves(tree.layers)}
    if name != "params" and not lengths:
        return
    if len(lengths) != 1 or None in lengths:
        raise ValueError(
            f"every leaf of {name}.layers needs the same leading (layer) axis, got {lengths}"
        )
    (layers,) = lengths
    if layers % (pp * vpp):
        raise ValueError(
            f"{name}.layers has {layers} layers, which do not split into pp_degree x "
            f"vpp_degree = {pp} x {vpp} equal chunks; use a layer count divisible by {pp * vpp}"
        )


def _paths(tree: Any, is_leaf: Any = None) -> list[str]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return [jax.tree_util.keystr(path) for path, _ in leaves]


def _spec_or_table(x: Any) -> bool:
    """A leaf of a spec tree: a `PartitionSpec`, or a sparse table's (flax Variable)."""
    return isinstance(x, PartitionSpec) or hasattr(x, "get_metadata")


def check_param_specs(param_specs: Any, params: Any) -> None:
    """`param_specs` gives a `PartitionSpec` for every parameter (one for a subtree covers
    it), and none for anything else.

    Raises:
      ValueError: naming the parameters it lacks and the entries that name none.
    """
    have = _paths(param_specs, _spec_or_table)
    want = _paths(params, _spec_or_table)
    lacks = [p for p in want if not any(p.startswith(h) for h in have)]
    extra = [h for h in have if not any(p.startswith(h) for p in want)]
    if lacks or extra:
        problems = [f"no spec for params{p}" for p in lacks]
        problems += [f"param_specs{h} names no parameter" for h in extra]
        raise ValueError(
            "param_specs must give a PartitionSpec for each parameter (params"
            f"{', params'.join(want)}): " + "; ".join(problems)
        )


def init_optimizer(optimizer: Any, params: Any) -> Any:
    """`optimizer.init(params)`, with an error naming the parameters when an option given as a
    tree (an optax `multi_transform`'s labels, a weight-decay `mask`) does not fit them.

    Raises:
      ValueError: for a tree that differs from the parameters' (JAX's pytree error follows).
    """
    try:
        return optimizer.init(params)
    except ValueError as e:
        if "pytree structure" not in str(e) and "tree structure" not in str(e):
            raise
        keys = ", params".join(_paths(params, None))
        raise ValueError(
            "the optimizer does not fit the parameters: a tree it was given (an optax "
            "multi_transform's param_labels, a weight-decay mask) must have the parameters' "
            f"tree (params{keys}). JAX: {' '.join(str(e).split())}"
        ) from e


def check_opt_state(optimizer: Any, opt_state: Any, params: Any) -> None:
    """`opt_state` is what `optimizer.init(params)` makes (the same tree and kinds of state).

    Raises:
      ValueError: for a state from another optimizer, naming both trees' kinds.
    """
    made = jax.tree.structure(jax.eval_shape(optimizer.init, params))
    if made != jax.tree.structure(opt_state):
        raise ValueError(
            "the state's optimizer state was made by another optimizer (its "
            f"{_kinds(opt_state)}, this step's optimizer makes {_kinds(made)}): pass a state "
            "that this step's init made, or restore a checkpoint into step.abstract_state"
        )


def _kinds(tree: Any) -> str:
    """The optax state types in `tree` (a pytree or a treedef)."""
    text = str(tree if isinstance(tree, jax.tree_util.PyTreeDef) else jax.tree.structure(tree))
    kinds = re.findall(r"namedtuple\[(\w+)\]", text)
    return ", ".join(dict.fromkeys(kinds)) or text[:80]
