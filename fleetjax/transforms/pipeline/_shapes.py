"""The shapes a pipeline's program is built for: one replica's activations, a chunk's, embed's
and the head's parameters, the metrics, and the parameters' dtypes in the ticks; with the
checks that the model's parts keep their shapes."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fleetjax.transforms.pipeline._casts import narrowing_casts
from fleetjax.transforms.pipeline._model import NO_KEY, ModelFunctions, PipelineParams, chunk_size
from fleetjax.transforms.pipeline.schedules import PipelineSchedule

F32 = jax.ShapeDtypeStruct((), jnp.float32)


class Shapes(NamedTuple):
    """Shapes (whole over the data axes) of one replica's activations, of one chunk's, embed's
    and the head's parameters and of the metrics, and the parameters' dtypes in the ticks."""

    activations: Any  # ShapeDtypeStructs of embed's output (and every stage's)
    chunk: Any  # ShapeDtypeStructs of one chunk's parameters
    embed: Any
    head: Any
    aux: Any  # ShapeDtypeStructs of head_loss's metrics, in float32
    casts: PipelineParams  # per parameter (of embed, of one layer, of the head): see _casts


def shapes_of(
    model: ModelFunctions,
    schedule: PipelineSchedule,
    params: PipelineParams,
    model_state: PipelineParams,
    micro: Any,
) -> Shapes:
    """The activations' and a chunk's shapes and the parameters' dtypes in the ticks; checks
    that the layers split into chunks and that `stage` keeps the activations' shapes, and every
    part its model state's (run on the parameters as the ticks run them)."""
    lengths = {x.shape[0] for x in jax.tree.leaves((params.layers, model_state.layers))}
    if len(lengths) != 1:
        raise ValueError(
            f"every layers leaf (of the parameters and model state) needs the same leading "
            f"(layer) axis, got {lengths}"
        )
    size = chunk_size(lengths.pop(), schedule.stages, schedule.virtual_stages)
    shape = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)  # noqa: E731
    chunk = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((size, *a.shape[1:]), a.dtype), params.layers
    )
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), micro)
    key = jax.ShapeDtypeStruct(NO_KEY.shape, NO_KEY.dtype)
    embed, head = shape(params.embed), shape(params.head)
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), chunk)
    layer_state = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), model_state.layers
    )

    embed_casts = narrowing_casts(model.embed, embed, model_state.embed, one, key)
    embed_in = (cast_shapes(embed, embed_casts), model_state.embed, one, key)
    activations, state = jax.eval_shape(model.embed, *embed_in)
    check_like("embed must return a model state", state, model_state.embed)
    layer_casts = narrowing_casts(model.stage, layer, layer_state, activations, key)
    layer_in = (cast_shapes(layer, layer_casts), layer_state, activations, key)
    out, state = jax.eval_shape(model.stage, *layer_in)
    check_like("stage must return activations", out, activations)
    check_like("stage must return a model state", state, layer_state)
    head_casts = narrowing_casts(model.head_loss, head, model_state.head, activations, one, key)
    head_in = (cast_shapes(head, head_casts), model_state.head, activations, one, key)
    _, aux, state = jax.eval_shape(model.head_loss, *head_in)
    check_like("head_loss must return a model state", state, model_state.head)
    aux = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), aux)
    casts = PipelineParams(embed_casts, layer_casts, head_casts)
    return Shapes(activations, chunk, embed, head, aux, casts)


def check_like(what: str, got: Any, want: Any) -> None:
    """`got` has the structure, shapes and dtypes of `want` (`what` says whose)."""
    if jax.tree.structure(got) != jax.tree.structure(want) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ):
        raise ValueError(f"{what} like its input {want}, got {got}")


def cast_shapes(shapes: Any, dtypes: Any) -> Any:
    """`shapes` with the dtypes `dtypes` gives (None: as they are)."""
    return jax.tree.map(
        lambda a, d: a if d is None else jax.ShapeDtypeStruct(a.shape, d), shapes, dtypes
    )
