"""The model a pipeline runs: its parts, their parameters, their PRNG keys and the layers' order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


class PipelineParams(NamedTuple):
    """The parameters of a pipelined model (and, from `pipeline`, their gradients).

    Attributes:
      embed: the parameters of `embed`; replicated over ``pp``.
      layers: the parameters of every layer, each leaf stacked on a leading layer axis in
        pipeline order (`to_pipeline_order`; model order unless vpp_degree > 1), split over
        ``pp`` (`PartitionSpec("pp")`).
      head: the parameters of `head_loss`; replicated over ``pp``.
    """

    embed: Any
    layers: Any
    head: Any


@dataclasses.dataclass(frozen=True)
class PipelineLayer:
    """A model cut for pipeline parallelism (Paddle's `PipelineLayer`): ``embed`` -> ``stage``
    once per layer -> ``head_loss``, on `PipelineParams`.

    Called as a loss, ``model(params, batch)``, it runs the whole batch through the model on
    its own, so the same model trains with or without a pipeline: `make_train_step` pipelines
    it when the strategy asks for a pipeline (see `pipeline` for the functions' contracts).
    ``model(params, batch, key)`` gives each function its PRNG key as its last argument, as a
    pipeline of one replica and one micro-batch would (`part_keys`).

    Attributes:
      num_virtual_pipeline_stages: model chunks per pipeline stage, for the "VPP" schedule
        (Paddle's argument of the same name; `Strategy.pipeline.vpp_degree` sets it too).
    """

    embed: Callable[..., Any]
    stage: Callable[..., Any]
    head_loss: Callable[..., Any]
    num_virtual_pipeline_stages: int = 1

    def __call__(self, params: PipelineParams, batch: Any, *key: jax.Array) -> Any:
        def rng(part_key: jax.Array) -> tuple[jax.Array, ...]:
            return (part_key,) if key else ()

        num_layers = jax.tree.leaves(params.layers)[0].shape[0]
        keys = part_keys(key[0] if key else NO_KEY, 0, 0, jnp.arange(num_layers + 2))

        def layer(h: Any, params_and_key: tuple[Any, jax.Array]) -> tuple[Any, None]:
            return self.stage(params_and_key[0], h, *rng(params_and_key[1])), None

        x = self.embed(params.embed, batch, *rng(keys[0]))
        x = lax.scan(layer, x, (params.layers, keys[1:-1]))[0]
        return self.head_loss(params.head, x, batch, *rng(keys[-1]))


NO_KEY = np.zeros(2, np.uint32)  # stands in for the key of a model that takes none


def part_keys(key: jax.Array, replica: Any, micro_batch: Any, part: Any) -> jax.Array:
    """The PRNG keys (raw key data) that a pipelined model's parts get with ``has_rng``.

    ``fold_in(fold_in(fold_in(key, replica), micro_batch), part)``: `key` is the step's key,
    `replica` the data-parallel replica, `micro_batch` the replica's micro-batch, and `part` 0
    for ``embed``, ``1 + l`` for layer ``l`` (in model order) and ``L + 1`` for ``head_loss``.
    The arguments broadcast: an array of parts gives an array of keys.
    """
    fold = jnp.vectorize(jax.random.fold_in, signature="(k),()->(k)")
    return fold(fold(fold(raw_key(key), replica), micro_batch), part)


def raw_key(key: jax.Array) -> jax.Array:
    """A PRNG key as raw key data (uint32), which `shard_map` and `fold_in` take alike."""
    return (
        jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    )


def to_pipeline_order(layers: Any, pp_degree: int, vpp_degree: int = 1) -> Any:
    """`layers` (stacked in model order) reordered so that splitting the layer axis over ``pp``
    gives stage ``s`` the chunks ``s, s + P, s + 2P, ...`` that the VPP schedule runs on it.

    The identity when `vpp_degree` is 1. `to_model_order` undoes it.
    """
    return jax.tree.map(lambda x: x[_order(x.shape[0], pp_degree, vpp_degree)], layers)


def to_model_order(layers: Any, pp_degree: int, vpp_degree: int = 1) -> Any:
    """`layers` (or their gradients) from pipeline order back to model order."""
    return jax.tree.map(lambda x: x[np.argsort(_order(x.shape[0], pp_degree, vpp_degree))], layers)


def _order(num_layers: int, pp_degree: int, vpp_degree: int) -> np.ndarray:
    """Model-order layer index at each pipeline-order position."""
    chunk = chunk_size(num_layers, pp_degree, vpp_degree)
    # Position (stage s, chunk v, layer j) holds model layer ((v P + s) chunk + j).
    index = np.arange(num_layers).reshape(vpp_degree, pp_degree, chunk)
    return index.transpose(1, 0, 2).reshape(-1)


def chunk_size(num_layers: int, pp_degree: int, vpp_degree: int) -> int:
    """The layers in one model chunk: `num_layers` split over ``pp_degree x vpp_degree`` chunks.

    Raises:
      ValueError: if they do not split into equal chunks.
    """
    if num_layers % (pp_degree * vpp_degree):
        raise ValueError(
            f"the layers' leading axis has {num_layers} layers, which do not split into "
            f"pp_degree x vpp_degree = {pp_degree} x {vpp_degree} equal chunks"
        )
    return num_layers // (pp_degree * vpp_degree)


class ModelFunctions(NamedTuple):
    """The user's model functions as the pipeline's program calls them: each takes a key last
    and `head_loss` returns ``(loss, aux)``, whether or not the model has keys or metrics."""

    embed: Callable[[Any, Any, jax.Array], Any]
    stage: Callable[[Any, Any, jax.Array], Any]
    head_loss: Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, Any]]

    @classmethod
    def of(
        cls,
        embed: Callable[..., Any],
        stage: Callable[..., Any],
        head_loss: Callable[..., Any],
        *,
        has_aux: bool,
        has_rng: bool,
    ) -> ModelFunctions:
        """`pipeline`'s functions in this form: one program serves every model, giving each
        part a key, which a model without `has_rng` never sees, and taking metrics, which one
        without `has_aux` does not make."""
        if not has_rng:
            embed = lambda p, b, k, f=embed: f(p, b)  # noqa: E731
            stage = lambda p, h, k, f=stage: f(p, h)  # noqa: E731
            head_loss = lambda p, x, b, k, f=head_loss: f(p, x, b)  # noqa: E731
        if not has_aux:
            head_loss = lambda p, x, b, k, f=head_loss: (f(p, x, b, k), {})  # noqa: E731
        return cls(embed, stage, head_loss)

    def chunk(self, chunk_params: Any, x: Any, keys: jax.Array) -> Any:
        """A chunk's consecutive layers (parameters and keys stacked on the leading axis)."""
        layers = (chunk_params, keys)
        return lax.scan(lambda h, layer: (self.stage(layer[0], h, layer[1]), None), x, layers)[0]
