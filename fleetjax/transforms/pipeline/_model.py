"""The model a pipeline runs: its parts, their parameters, their PRNG keys and the layers' order."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fleetjax.transforms.pipeline._layers import from_layer_descs


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


@dataclasses.dataclass(frozen=True, init=False)
class PipelineLayer:
    """A model cut for pipeline parallelism (Paddle's `PipelineLayer`): ``embed`` -> ``stage``
    once per layer -> ``head_loss``, on `PipelineParams`.

    Made from the three functions, ``PipelineLayer(embed, stage, head_loss,
    num_virtual_pipeline_stages=1)``, or as in Paddle from a list of layers,
    ``PipelineLayer(layers=[LayerDesc(Embed, ...), *[LayerDesc(Block, ...)] * n,
    LayerDesc(Head, ...)], num_stages=..., loss_fn=...)`` (also ``seg_method``,
    ``recompute_interval``, ``recompute_ctx``, ``num_virtual_pipeline_stages``): the layers are
    flax nnx modules, the run of identical `LayerDesc`s becomes the stacked layers, what comes
    before it `embed` and what comes after it, then ``loss_fn(output, labels)``, `head_loss`;
    the batch is ``(inputs, labels)``. That form builds the layers: train
    ``step.init(model.params, model_state=model.model_state)`` (with ``has_state=True`` when the
    layers keep statistics, i.e. `model_state` is not None).

    Called as a loss, ``model(params, batch)``, it runs the whole batch through the model on
    its own, so the same model trains with or without a pipeline: `make_train_step` pipelines
    it when the strategy asks for a pipeline (see `pipeline` for the functions' contracts).
    ``model(params, batch, key)`` gives each function its PRNG key as its last argument, as a
    pipeline of one replica and one micro-batch would (`part_keys`). With a model state (a
    `PipelineParams` of the parts' states, `make_train_step(..., has_state=True)`),
    ``model(params, model_state, batch[, key])`` gives each function its part's state and
    returns ``(loss, new_model_state)`` (or ``(loss, aux, new_model_state)``).

    Attributes:
      num_virtual_pipeline_stages: model chunks per pipeline stage, for the "VPP" schedule
        (Paddle's argument of the same name; `Strategy.pipeline.vpp_degree` sets it too).
      num_stages: the pipeline degree the model was cut for (Paddle's argument; it must be the
        mesh's pp), or None.
      params, model_state: the parameters (nnx.Param variables, as `nnx.State`s) and the other
        variables of the layers a `LayerDesc` list built, in `PipelineParams`; None otherwise
        (`model_state` also when the layers keep none).
    """

    embed: Callable[..., Any]
    stage: Callable[..., Any]
    head_loss: Callable[..., Any]
    num_virtual_pipeline_stages: int = 1
    num_stages: int | None = None
    params: PipelineParams | None = dataclasses.field(default=None, repr=False, compare=False)
    model_state: PipelineParams | None = dataclasses.field(default=None, repr=False, compare=False)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``PipelineLayer(embed, stage, head_loss, num_virtual_pipeline_stages=1)``, or
        Paddle's ``PipelineLayer(layers, num_stages=None, topology=None, loss_fn=None,
        seg_method="uniform", recompute_interval=0, recompute_ctx=None,
        num_virtual_pipeline_stages=None)`` (see the class).

        Raises:
          ValueError, TypeError: for Paddle's form, what Paddle refuses and what does not map
            onto embed, stage and head_loss (see `LayerDesc`).
        """
        if "layers" in kwargs or (args and not callable(args[0])):
            fields = from_layer_descs(*args, **kwargs)
            for name in ("params", "model_state"):
                if fields[name] is not None:
                    fields[name] = PipelineParams(*fields[name])
        else:
            fields = _function_form(*args, **kwargs)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def check_flags(self, has_rng: bool, has_state: bool) -> None:
        """For a model built from `LayerDesc`s: the step's flags fit its functions.

        Raises:
          TypeError: with `has_rng` (its layers keep their own `nnx.Rngs`), or `has_state`
            other than whether its layers keep model state.
        """
        if self.params is None:
            return
        keeps = self.model_state is not None
        if has_rng or has_state != keeps:
            raise TypeError(
                f"this PipelineLayer's layers keep {'model state' if keeps else 'no model state'}"
                f" and take no PRNG key: make the step with has_state={keeps}, has_rng=False"
                + (", and step.init(model.params, model_state=model.model_state)" if keeps else "")
            )

    def __call__(self, params: PipelineParams, *args: Any) -> Any:
        stateful = bool(args) and isinstance(args[0], PipelineParams)
        state = args[0] if stateful else PipelineParams((), (), ())
        batch, *key = args[1:] if stateful else args
        self.check_flags(bool(key), stateful)
        model = ModelFunctions.of(
            self.embed,
            self.stage,
            self.head_loss,
            has_aux=False,
            has_rng=bool(key),
            has_state=stateful,
        )
        num_layers = jax.tree.leaves(params.layers)[0].shape[0]
        keys = part_keys(key[0] if key else NO_KEY, 0, 0, jnp.arange(num_layers + 2))
        x, embed_state = model.embed(params.embed, state.embed, batch, keys[0])
        x, layers_state = model.chunk(params.layers, state.layers, x, keys[1:-1])
        # The head as written, so that its output keeps its form (with or without metrics).
        head_state = (state.head,) if stateful else ()
        out = self.head_loss(params.head, *head_state, x, batch, *keys[-1:][: len(key)])
        if not stateful:
            return out
        *value, head_state = out
        return (*value, PipelineParams(embed_state, layers_state, head_state))


def _function_form(
    embed: Callable[..., Any],
    stage: Callable[..., Any],
    head_loss: Callable[..., Any],
    num_virtual_pipeline_stages: int = 1,
    *,
    num_stages: int | None = None,
    params: PipelineParams | None = None,
    model_state: PipelineParams | None = None,
) -> dict[str, Any]:
    """`PipelineLayer`'s fields from its functions (and, for `dataclasses.replace`, the rest)."""
    return dict(locals())


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
    """The user's model functions as the pipeline's program calls them: each takes its part's
    model state and a key, and returns its new state; `head_loss` returns ``(loss, aux,
    new_state)``, whether or not the model has state, keys or metrics."""

    embed: Callable[[Any, Any, Any, jax.Array], tuple[Any, Any]]
    stage: Callable[[Any, Any, Any, jax.Array], tuple[Any, Any]]
    head_loss: Callable[[Any, Any, Any, Any, jax.Array], tuple[jax.Array, Any, Any]]

    @classmethod
    def of(
        cls,
        embed: Callable[..., Any],
        stage: Callable[..., Any],
        head_loss: Callable[..., Any],
        *,
        has_aux: bool,
        has_rng: bool,
        has_state: bool = False,
    ) -> ModelFunctions:
        """`pipeline`'s functions in this form: one program serves every model, giving each
        part a key, which a model without `has_rng` never sees, and a state, which one without
        `has_state` never sees (its state is ``()``), and taking metrics, which one without
        `has_aux` does not make."""
        if not has_rng:
            embed, stage, head_loss = (
                lambda *a, f=f: f(*a[:-1]) for f in (embed, stage, head_loss)
            )
        if not has_state:  # the state () passes through
            embed, stage = (lambda p, s, *a, f=f: (f(p, *a), s) for f in (embed, stage))
            head_loss = lambda p, s, *a, f=head_loss: (*_parts(f(p, *a), has_aux), s)  # noqa: E731
        if not has_aux:  # (loss, new_state) -> (loss, {}, new_state)
            head_loss = lambda *a, f=head_loss: _with_metrics(*f(*a))  # noqa: E731
        return cls(embed, stage, head_loss)

    def chunk(self, chunk_params: Any, chunk_state: Any, x: Any, keys: jax.Array) -> Any:
        """A chunk's consecutive layers (parameters, states and keys stacked on the leading
        axis): the output and the layers' new states, stacked."""

        def layer(h: Any, one: tuple[Any, Any, jax.Array]) -> tuple[Any, Any]:
            return self.stage(one[0], one[1], h, one[2])

        return lax.scan(layer, x, (chunk_params, chunk_state, keys))


def _parts(out: Any, has_aux: bool) -> tuple[Any, ...]:
    """A head's ``loss`` or ``(loss, aux)`` as a tuple."""
    return tuple(out) if has_aux else (out,)


def _with_metrics(loss: jax.Array, state: Any) -> tuple[jax.Array, dict, Any]:
    return loss, {}, state
