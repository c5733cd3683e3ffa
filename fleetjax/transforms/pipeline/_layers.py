"""Paddle's `LayerDesc` list form of a `PipelineLayer`, mapped onto embed / stage / head_loss.

Paddle describes a pipelined model as a list of layers, ``[LayerDesc(EmbeddingPipe, ...),
*[LayerDesc(Block, ...)] * n, LayerDesc(HeadPipe, ...)]``, each built on the stage that runs it.
fleetjax runs one program on every stage (SPMD), so the stages must run the same layers: the
longest run of identical consecutive `LayerDesc`s is built once per layer and stacked on the
layer axis (`stage`), what comes before it runs in `embed` on the first stage and what comes
after it, then `loss_fn`, in `head_loss` on the last. Layers are flax nnx modules; their
`nnx.Param`s are the parameters and their other variables (batch-norm statistics) the model
state.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax._warnings import warn_once

__all__ = ["LayerDesc", "SharedLayerDesc"]


class LayerDesc:
    """A layer of a `PipelineLayer`, built later: ``layer_func(*inputs, **kwargs)`` (Paddle's
    `paddle.distributed.fleet.meta_parallel.LayerDesc`), a flax nnx module class."""

    def __init__(self, layer_func: type[nnx.Module], *inputs: Any, **kwargs: Any) -> None:
        if not (isinstance(layer_func, type) and issubclass(layer_func, nnx.Module)):
            raise TypeError("The input(layer_func) should be a derived class of flax nnx.Module.")
        self.layer_func, self.inputs, self.kwargs = layer_func, inputs, kwargs

    def build_layer(self) -> nnx.Module:
        """A new layer (with its own parameters, drawn from the `nnx.Rngs` in its arguments)."""
        return self.layer_func(*self.inputs, **self.kwargs)

    def same_layer(self, other: Any) -> bool:
        """Whether `other` describes the same layer: the same class and equal arguments."""
        if other is self:
            return True
        if type(other) is not LayerDesc or other.layer_func is not self.layer_func:
            return False
        try:
            return bool(other.inputs == self.inputs and other.kwargs == self.kwargs)
        except (TypeError, ValueError):  # arguments without a truth value (arrays)
            return False

    def __repr__(self) -> str:
        args = [*map(repr, self.inputs), *(f"{k}={v!r}" for k, v in self.kwargs.items())]
        return f"{self.layer_func.__name__}({', '.join(args)})"


class SharedLayerDesc(LayerDesc):
    """Paddle's `SharedLayerDesc`: a layer whose weights the places that name the same `key`
    share, run as ``forward_func(layer, x)`` (default ``layer(x)``). In fleetjax a key may
    appear once (the stages' parts keep separate parameters)."""

    def __init__(
        self,
        key: str,
        layer_func: type[nnx.Module],
        forward_func: Callable[..., Any] | None = None,
        shared_weight_attr: str = "weight",
        *inputs: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(layer_func, *inputs, **kwargs)
        self.layer_name, self.forward_func = key, forward_func
        self.shared_weight_attr = shared_weight_attr


class _Part(nnx.Module):
    """Consecutive layers, each called on the last one's output (Paddle's run functions)."""

    def __init__(self, layers: Sequence[Any]) -> None:
        self.layers = nnx.List(layers)

    def __call__(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x


class _Shared(nnx.Module):
    """A `SharedLayerDesc`'s layer, run by its `forward_func`."""

    def __init__(self, layer: nnx.Module, forward_func: Callable[..., Any]) -> None:
        self.layer, self.forward_func = layer, forward_func

    def __call__(self, x: Any) -> Any:
        return self.forward_func(self.layer, x)


def from_layer_descs(
    layers: Sequence[Any],
    num_stages: int | None = None,
    topology: Any = None,
    loss_fn: Callable[[Any, Any], jax.Array] | None = None,
    seg_method: str = "uniform",
    recompute_interval: int = 0,
    recompute_ctx: dict[str, Any] | None = None,
    num_virtual_pipeline_stages: int | None = None,
) -> dict[str, Any]:
    """The fields of a `PipelineLayer` for Paddle's arguments (see `PipelineLayer`); its
    `params` and `model_state` as (embed, layers, head) triples.

    Raises:
      ValueError: for arguments Paddle refuses, or a model that does not map (no repeated
        layer, a `seg_method` that splits elsewhere, weights shared between parts).
      TypeError: for an entry that is neither a `LayerDesc`, an nnx module nor a function.
    """
    if num_stages is None and topology is None:
        raise ValueError("should provide num_stages or topology")
    if topology is not None:
        raise ValueError(
            "PipelineLayer(topology=...): fleetjax takes the pipeline degree from the mesh's pp "
            "axis (the strategy's pp_degree); pass num_stages instead"
        )
    vpp = 1 if num_virtual_pipeline_stages is None else num_virtual_pipeline_stages
    _check_arguments(num_stages, vpp, seg_method, recompute_interval, recompute_ctx)
    if loss_fn is None:
        raise ValueError("PipelineLayer(layers=...) needs loss_fn(output, labels) for training")
    _check_shared(layers)
    entries = [_entry(layer, i) for i, layer in enumerate(layers)]
    start, end = _repeated(entries)
    _check_segments(seg_method, entries, start, end)
    # Built in the list's order, as Paddle builds them (each draws from its nnx.Rngs in turn).
    built = [e.build_layer() if isinstance(e, LayerDesc) else e for e in entries]
    embed, head = (nnx.split(_Part(part), nnx.Param, ...) for part in (built[:start], built[end:]))
    stacked = _stacked(built[start:end], entries[start])
    has_state = any(jax.tree.leaves(state) for state in (embed[2], stacked[2], head[2]))
    _check_no_rng_streams(built)
    functions = _functions(embed[0], stacked[0], head[0], loss_fn, has_state, recompute_interval)
    return {
        **functions,
        "num_virtual_pipeline_stages": vpp,
        "num_stages": num_stages,
        "params": (embed[1], stacked[1], head[1]),
        "model_state": (embed[2], stacked[2], head[2]) if has_state else None,
    }


def _check_arguments(
    num_stages: int | None,
    vpp: int,
    seg_method: Any,
    recompute_interval: int,
    recompute_ctx: dict[str, Any] | None,
) -> None:
    """Paddle's checks of `PipelineLayer`'s arguments (its messages where it has them)."""
    for name, value in (("num_stages", num_stages), ("num_virtual_pipeline_stages", vpp)):
        positive = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if value is not None and not positive:
            raise ValueError(f"PipelineLayer: {name} must be a positive int, got {value!r}")
    if vpp > 1 and not (isinstance(seg_method, str) and seg_method.startswith("layer:")):
        raise ValueError("seg_method should be start with layer: for interleave scheduler")
    if recompute_interval > 0 and recompute_ctx is None:
        raise ValueError("recompute_ctx must be not None for recompute.")
    for key in ("offload", "partition"):
        if (recompute_ctx or {}).get(key):
            warn_once(
                f"PipelineLayer recompute_ctx['{key}']=True has no effect in fleetjax: the "
                "repeated layers are recomputed with jax.checkpoint; offload kept activations "
                "with DistributedStrategy.recompute_configs['enable_offload']"
            )


def _check_shared(layers: Sequence[Any]) -> None:
    """Each `SharedLayerDesc` key names one place: fleetjax keeps every part's parameters apart
    (embed's on the first stage, the head's on the last), so it cannot tie weights across them.
    """
    keys = [layer.layer_name for layer in layers if isinstance(layer, SharedLayerDesc)]
    for key in dict.fromkeys(keys):
        if keys.count(key) > 1:
            raise ValueError(
                f"SharedLayerDesc key {key!r} appears {keys.count(key)} times: fleetjax does not "
                "tie weights between the parts of a PipelineLayer (each part keeps its own "
                "parameters); give each place its own layer"
            )


def _check_no_rng_streams(built: list[Any]) -> None:
    """No layer keeps `nnx.Rngs` streams: they would be model state, which every micro-batch
    sees alike, so every micro-batch would draw the same numbers (the same dropout mask)."""
    modules = [layer for layer in built if isinstance(layer, nnx.Module)]
    if any(jax.tree.leaves(nnx.state(module, nnx.RngState)) for module in modules):
        raise ValueError(
            "PipelineLayer(layers=...): a layer keeps nnx.Rngs streams (e.g. nnx.Dropout(..., "
            "rngs=...)); under a pipeline every micro-batch would draw the same numbers from "
            "them. Write the model as PipelineLayer(embed, stage, head_loss) with "
            "make_train_step(..., has_rng=True), where each part of each micro-batch gets its "
            "own key"
        )


def _entry(layer: Any, index: int) -> Any:
    """An entry of the list as the parts hold it: a `LayerDesc` (built later, or now if shared),
    an nnx module, or a function without parameters."""
    if isinstance(layer, SharedLayerDesc):
        forward = layer.forward_func or (lambda module, x: module(x))
        return _Shared(layer.build_layer(), forward)
    if isinstance(layer, (LayerDesc, nnx.Module)) or callable(layer):
        return layer
    raise TypeError(
        f"PipelineLayer layers[{index}] is a {type(layer).__name__}: expected a LayerDesc, a "
        "SharedLayerDesc, a flax nnx module or a function"
    )


def _repeated(entries: list[Any]) -> tuple[int, int]:
    """[start, end) of the longest run of identical consecutive `LayerDesc`s (the first of the
    longest), which become the stacked layers.

    Raises:
      ValueError: if no `LayerDesc` repeats.
    """
    best, start = (0, 0), 0
    for i in range(1, len(entries) + 1):
        if i == len(entries) or not (
            isinstance(entries[start], LayerDesc) and entries[start].same_layer(entries[i])
        ):
            if isinstance(entries[start], LayerDesc) and i - start > best[1] - best[0]:
                best = (start, i)
            start = i
    if best[1] - best[0] < 2:
        raise ValueError(
            "PipelineLayer(layers=...) needs the layers the stages share as a run of identical "
            "LayerDescs (e.g. *[LayerDesc(Block, ...)] * n): fleetjax runs one program on every "
            "stage, so the stages run the same layers, stacked on a layer axis; layers before "
            "the run go to the first stage, layers after it to the last. Found no repeated "
            f"LayerDesc in {entries!r}"
        )
    return best


def _check_segments(seg_method: Any, entries: list[Any], start: int, end: int) -> None:
    """`seg_method` splits the model where fleetjax does: 'uniform', or 'layer:<name>' naming
    the repeated layer only (its layers are split evenly over the stages)."""
    if seg_method == "uniform":
        return
    if not (isinstance(seg_method, str) and seg_method.startswith("layer:")):
        raise ValueError(
            f"PipelineLayer seg_method={seg_method!r}: fleetjax splits the repeated layers "
            "evenly over the stages (embed's layers on the first, the head's on the last); use "
            "'uniform' or 'layer:<the repeated layer's class name>'"
        )
    pattern = re.compile(seg_method.split(":", 1)[1], re.IGNORECASE)
    named = [i for i, e in enumerate(entries) if pattern.search(_name(e))]
    if named != list(range(start, end)):
        raise ValueError(
            f"PipelineLayer seg_method={seg_method!r} matches layers {named}, but fleetjax "
            f"splits the repeated layers {start}..{end - 1} ({_name(entries[start])}) over the "
            "stages: name that layer only"
        )


def _name(entry: Any) -> str:
    if isinstance(entry, LayerDesc):
        return entry.layer_func.__name__
    if isinstance(entry, _Shared):
        return type(entry.layer).__name__
    return getattr(entry, "__name__", type(entry).__name__)


def _stacked(built: list[nnx.Module], desc: LayerDesc) -> tuple[nnx.GraphDef, Any, Any]:
    """The repeated layers' graph, and their parameters and other variables stacked on a
    leading layer axis (logical name "layers")."""
    splits = [nnx.split(layer, nnx.Param, ...) for layer in built]
    shapes = [(split[0], jax.tree.map(jnp.shape, split[1:])) for split in splits]
    if any(shape != shapes[0] for shape in shapes):
        raise ValueError(
            f"PipelineLayer: the repeated layers {desc!r} are not all alike (their structure or "
            "shapes differ), so they cannot be stacked on a layer axis"
        )
    params, state = (
        nnx.spmd.add_axis(
            jax.tree.map(lambda *xs: jnp.stack(xs), *[s[i] for s in splits]),
            0,
            {nnx.PARTITION_NAME: "layers"},
        )
        for i in (1, 2)
    )
    return splits[0][0], params, state


def _functions(
    embed: nnx.GraphDef,
    block: nnx.GraphDef,
    head: nnx.GraphDef,
    loss_fn: Callable[[Any, Any], jax.Array],
    has_state: bool,
    recompute_interval: int,
) -> dict[str, Callable[..., Any]]:
    """embed, stage and head_loss for the parts' graphs, on a batch ``(inputs, labels)``; with
    `has_state`, each takes its part's state after its parameters and returns its new one."""

    def run(graph: nnx.GraphDef, params: Any, state: Any, x: Any) -> tuple[Any, Any]:
        module = nnx.merge(graph, params, state)
        return module(x), nnx.split(module, nnx.Param, ...)[2]

    def embed_fn(params: Any, state: Any, batch: Any) -> tuple[Any, Any]:
        return run(embed, params, state, batch[0])

    def stage_fn(params: Any, state: Any, x: Any) -> tuple[Any, Any]:
        return run(block, params, state, x)

    def head_fn(params: Any, state: Any, x: Any, batch: Any) -> tuple[jax.Array, Any]:
        out, state = run(head, params, state, x)
        return loss_fn(out, batch[1]), state

    if recompute_interval > 0:
        stage_fn = jax.checkpoint(stage_fn)
    if has_state:
        return {"embed": embed_fn, "stage": stage_fn, "head_loss": head_fn}
    empty = nnx.State({})
    return {
        "embed": lambda params, batch: embed_fn(params, empty, batch)[0],
        "stage": lambda params, x: stage_fn(params, empty, x)[0],
        "head_loss": lambda params, x, batch: head_fn(params, empty, x, batch)[0],
    }
