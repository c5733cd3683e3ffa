"""The pipeline's SPMD program: one `shard_map` over ``pp`` and the data axes that runs a
timetable tick by tick.

`program` splits the batch into micro-batches and runs `_Stage`, the per-stage program, as the
body of the `shard_map`: per segment of the timetable (warm-up, steady state, cool-down) a
`lax.scan` over its rows, each tick the forward half (`_Stage.forward`: embed on the first
virtual stage, the chunk's layers with their residuals kept, the head on the last) and then the
backward half (`_Stage.backward`: the chunk's `jax.vjp` from the kept residuals, embed's on the
first virtual stage), then the sends to the neighbours.

Each device runs its own data-parallel replica's micro-batches (the data axes are manual, so
the compiler never moves a replica's gradients or activations), accumulates whole float32
gradients of its stage, and reduces them over the data axes once, after the loop, with the
reducer: a reduce-scatter where the gradients are split over ``sharding`` (ZeRO), an
all-reduce otherwise. ``mp`` stays with the compiler. Parameters that the model converts to
half precision before every use are converted once per step, before the loop
(`narrowing_casts`); under ZeRO-3 each tick gathers the (converted) shards it runs on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleetjax.mesh import constrain, data_axes, data_parallel_size, restrict, spec_axes
from fleetjax.transforms.grad_allreduce import Reducer, mean_in
from fleetjax.transforms.pipeline._casts import cast, narrowing_casts
from fleetjax.transforms.pipeline._chunk import Chunk
from fleetjax.transforms.pipeline._model import (
    NO_KEY,
    ModelFunctions,
    PipelineParams,
    chunk_size,
    part_keys,
)
from fleetjax.transforms.pipeline._timetable import (
    B_CHUNK,
    B_COT,
    B_MICRO,
    B_RES,
    F_ACT,
    F_CHUNK,
    F_DY,
    F_MICRO,
    F_RES,
    RECV_ACT,
    RECV_COT,
    Segment,
    Timetable,
    timetable,
)
from fleetjax.transforms.pipeline.schedules import PipelineSchedule

AXIS = "pp"
_WHOLE = PartitionSpec()
_BY_STAGE = PipelineParams(_WHOLE, PartitionSpec(AXIS), _WHOLE)  # the layers split over pp


def program(
    model: ModelFunctions,
    schedule: PipelineSchedule,
    mesh: Mesh,
    micro_batch_size: int,
    reducer: Reducer | None = None,
    param_specs: PipelineParams | None = None,
    grad_specs: PipelineParams | None = None,
) -> Callable[..., tuple[tuple[jax.Array, Any], PipelineParams, PipelineParams]]:
    """The pipeline of `model` on `mesh`: ``run(params, model_state, batch, key, loss_scale) ->
    ((loss, aux), new_model_state, grads)``, `key` raw key data, `loss_scale` a float32 scalar
    or None, `model_state` a `PipelineParams` of the parts' states (``()`` for none).

    The loss and metrics are the means over every replica's micro-batches; the gradients are
    the loss's, times `loss_scale` when there is one (the loss and metrics are not scaled),
    reduced over the data axes by `reducer` (default: their mean, an all-reduce) and split as
    `grad_specs` says (`PartitionSpec`s like the parameters, or a prefix of them; default whole
    over the data axes, which a reducer that scatters must not leave them). `param_specs` says
    where the parameters are (default whole over the data axes): a parameter split over a data
    axis (ZeRO-3) is gathered in each tick that uses it. Every micro-batch sees `model_state`;
    of the new states, the floating ones are averaged over every replica's micro-batches and
    the others are the last micro-batch's (of the last replica), as
    `gradient_merge.microbatched` does.
    """
    table = timetable(schedule)
    reducer = reducer if reducer is not None else mean_in(jnp.float32)

    def run(
        params: PipelineParams,
        model_state: PipelineParams,
        batch: Any,
        key: jax.Array,
        loss_scale: jax.Array | None,
    ) -> tuple[tuple[jax.Array, Any], PipelineParams, PipelineParams]:
        micro = _micro_batches(batch, mesh, micro_batch_size, schedule.micro_batches)
        shapes = _shapes(model, schedule, params, model_state, micro)
        layout = _Layout.of(mesh, params, param_specs, grad_specs)
        scales = () if loss_scale is None else (loss_scale,)

        def per_stage(params: PipelineParams, model_state: PipelineParams, micro: Any, *rest: Any):
            stage = _Stage(model, schedule, layout, shapes, params, model_state, micro, *rest)
            carry = stage.start(table)
            for segment in table.segments:
                rows = jnp.asarray(table.table[segment.start : segment.stop])
                carry, _ = lax.scan(functools.partial(stage.tick, segment), carry, rows)
            return stage.results(carry, reducer)

        context = jax.sharding.get_abstract_mesh()  # under auto_axes: this mesh, Auto typed
        by_replica = PartitionSpec(None, layout.data or None)  # [m, replicas, ...]
        (loss, aux), new_state, grads = jax.shard_map(
            per_stage,
            mesh=mesh if context.empty else context,
            axis_names=layout.manual,
            in_specs=(layout.params, _BY_STAGE, by_replica, _WHOLE, *[_WHOLE] * len(scales)),
            out_specs=((_WHOLE, _WHOLE), _BY_STAGE, layout.grads),
            # Values equal on every replica (a hierarchical reducer's ring results) that JAX
            # cannot prove equal; inside, each device's gradients are its own.
            check_vma=False,
        )(params, model_state, micro, key, *scales)
        return (loss, aux), new_state, grads

    return run


class _Layout(NamedTuple):
    """The pipeline's `shard_map` axes and where its parameters and gradients are on them."""

    manual: frozenset[str]  # pp, the data axes, and axes of size 1 (nothing to partition)
    data: tuple[str, ...]  # the data axes, in the batch's order
    params: PipelineParams  # the parameters' specs over the manual axes
    grads: PipelineParams  # the reduced gradients' specs over the manual axes
    gathers: PipelineParams  # per parameter, the (dimension, data axes) it is split on
    compiler: PipelineParams  # per parameter, its split over the compiler's axes (mp)
    split: tuple[str, ...]  # the compiler's axes of size > 1, which kept layer inputs split on
    split_ways: int

    @classmethod
    def of(
        cls,
        mesh: Mesh,
        params: PipelineParams,
        param_specs: PipelineParams | None,
        grad_specs: PipelineParams | None,
    ) -> _Layout:
        """The layout for `params` on `mesh`, split as the specs say (see `program`).

        Raises:
          ValueError: for a layers parameter whose leading (layer) axis is split over a data
            axis (its stage's chunks would not be whole).
        """
        data = data_axes(mesh)
        # Axes of size 1 are manual too: that keeps XLA:CPU compiling bfloat16 all-reduces
        # (see grad_allreduce.data_parallel).
        manual = frozenset({AXIS, *data} | {a for a in mesh.axis_names if mesh.shape[a] == 1})
        specs = _leaf_specs(param_specs or _BY_STAGE, params)
        param_in = _on(manual, specs)
        others = tuple(a for a in mesh.axis_names if a not in manual)
        compiler = jax.tree.map(lambda s: restrict(s, others), specs, is_leaf=_is_spec)
        grads = _on(manual, _leaf_specs(grad_specs or _BY_STAGE, params))

        def gathered(spec: PartitionSpec) -> tuple[tuple[int, tuple[str, ...]], ...]:
            return tuple(
                (d, axes)
                for d, entry in enumerate(spec)
                if (axes := tuple(a for a in spec_axes(PartitionSpec(entry)) if a in data))
            )

        gathers = jax.tree.map(gathered, param_in, is_leaf=_is_spec)
        if any(
            d == 0 for split in jax.tree.leaves(gathers.layers, is_leaf=_is_split) for d, _ in split
        ):
            raise ValueError(
                "a pipeline's layers parameter is split over a data axis on its leading (layer) "
                f"axis ({param_specs.layers}); split another dimension over it"
            )
        split = tuple(a for a in others if mesh.shape[a] > 1)
        ways = math.prod(mesh.shape[a] for a in split)
        return cls(manual, data, param_in, grads, gathers, compiler, split, ways)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _is_split(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(e, tuple) for e in x)


def _leaf_specs(specs: PipelineParams, params: PipelineParams) -> PipelineParams:
    """`specs` (a prefix of `params` with `PartitionSpec` leaves) as one spec per parameter."""
    return jax.tree.map(
        lambda spec, part: jax.tree.map(lambda _: spec, part), specs, params, is_leaf=_is_spec
    )


def _on(manual: frozenset[str], specs: PipelineParams) -> PipelineParams:
    """`specs` over the `manual` axes only; the layers' leading axis split over pp."""
    restricted = jax.tree.map(lambda s: restrict(s, tuple(manual)), specs, is_leaf=_is_spec)
    by_stage = lambda s: PartitionSpec(AXIS, *tuple(s)[1:])  # noqa: E731
    layers = jax.tree.map(by_stage, restricted.layers, is_leaf=_is_spec)
    return restricted._replace(layers=layers)


def _micro_batches(batch: Any, mesh: Mesh, micro_batch_size: int, accumulate_steps: int) -> Any:
    """[replicas * m * b, ...] -> [m, replicas, b, ...]. As in Paddle, micro-batch i of a
    replica is rows [i b, (i + 1) b) of that replica's rows.

    Raises:
      ValueError: for leaves of different batch sizes, or a size other than replicas x m x b.
    """
    sizes = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(batch)}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every batch leaf needs the same leading (batch) size, got {sizes}")
    (size,) = sizes
    replicas = data_parallel_size(mesh)
    if size != replicas * micro_batch_size * accumulate_steps:
        per_replica = size // replicas if size % replicas == 0 else size / replicas
        raise ValueError(
            "batch_size needs to be divisible by micro_batch_size. Currently, "
            f"batch_size = {per_replica}, micro_batch_size = {micro_batch_size}, "
            f"accumulate_steps = {accumulate_steps}. (batch_size is per data-parallel "
            f"replica: {size} rows over {replicas} replicas)"
        )

    def cut(x: jax.Array) -> jax.Array:
        x = x.reshape(replicas, accumulate_steps, micro_batch_size, *x.shape[1:])
        return x.swapaxes(0, 1)

    by_replica = NamedSharding(mesh, PartitionSpec(None, data_axes(mesh) or None))
    return constrain(jax.tree.map(cut, batch), by_replica)


class _Shapes(NamedTuple):
    """Shapes (whole over the data axes) of one replica's activations, of one chunk's, embed's
    and the head's parameters and of the metrics, and the parameters' dtypes in the ticks."""

    activations: Any  # ShapeDtypeStructs of embed's output (and every stage's)
    chunk: Any  # ShapeDtypeStructs of one chunk's parameters
    embed: Any
    head: Any
    aux: Any  # ShapeDtypeStructs of head_loss's metrics, in float32
    casts: PipelineParams  # per parameter (of embed, of one layer, of the head): see _casts


def _shapes(
    model: ModelFunctions,
    schedule: PipelineSchedule,
    params: PipelineParams,
    model_state: PipelineParams,
    micro: Any,
) -> _Shapes:
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
    embed_in = (_cast_shapes(embed, embed_casts), model_state.embed, one, key)
    activations, state = jax.eval_shape(model.embed, *embed_in)
    _check_like("embed must return a model state", state, model_state.embed)
    layer_casts = narrowing_casts(model.stage, layer, layer_state, activations, key)
    layer_in = (_cast_shapes(layer, layer_casts), layer_state, activations, key)
    out, state = jax.eval_shape(model.stage, *layer_in)
    _check_like("stage must return activations", out, activations)
    _check_like("stage must return a model state", state, layer_state)
    head_casts = narrowing_casts(model.head_loss, head, model_state.head, activations, one, key)
    head_in = (_cast_shapes(head, head_casts), model_state.head, activations, one, key)
    _, aux, state = jax.eval_shape(model.head_loss, *head_in)
    _check_like("head_loss must return a model state", state, model_state.head)
    aux = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), aux)
    casts = PipelineParams(embed_casts, layer_casts, head_casts)
    return _Shapes(activations, chunk, embed, head, aux, casts)


def _check_like(what: str, got: Any, want: Any) -> None:
    """`got` has the structure, shapes and dtypes of `want` (`what` says whose)."""
    if jax.tree.structure(got) != jax.tree.structure(want) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ):
        raise ValueError(f"{what} like its input {want}, got {got}")


class _Carry(NamedTuple):
    """What a stage carries from tick to tick: its buffers and its sums so far."""

    residuals: Any  # [residual slots, layers per chunk, ...]: of forwards not yet run back
    activations: Any  # [activation slots, ...]: received and not yet consumed
    cotangents: Any  # [cotangent slots, ...]: received (or made by the head)
    g_layers: Any  # [chunks, layers per chunk, ...], in the parameters' dtypes
    g_embed: Any
    g_head: Any
    loss: jax.Array  # []
    metrics: Any
    # The sums of the new floating model states and the last of the others: a PipelineParams,
    # the layers' [chunks, layers per chunk, ...].
    states: PipelineParams


class _Stage:
    """One stage's program, the body of the `shard_map` over ``pp`` and the data axes:
    `start`, then `tick` for each row of the timetable, then `results`.

    Each device runs its own replica's micro-batches ([m, micro_batch_size, ...]) and keeps its
    own gradients until `results` reduces them.
    """

    def __init__(
        self,
        model: ModelFunctions,
        schedule: PipelineSchedule,
        layout: _Layout,
        shapes: _Shapes,
        params: PipelineParams,
        model_state: PipelineParams,
        micro: Any,
        key: jax.Array,
        loss_scale: jax.Array | None = None,
    ) -> None:
        """The stage's program for its `params` and `model_state` (embed's, this stage's
        layers', the head's), its replica's micro-batches `micro` ([m, 1, b, ...]), the step's
        `key` and the `loss_scale` (if any), as the `shard_map` gives them."""
        stages, chunks = schedule.stages, schedule.virtual_stages
        self.model, self.shapes, self.key, self.layout = model, shapes, key, layout
        self.micro = jax.tree.map(lambda x: x[:, 0], micro)
        self.micro_batches, self.loss_scale = schedule.micro_batches, loss_scale
        self.stages, self.chunks = stages, chunks
        self.last = stages * chunks - 1  # the last virtual stage
        self.size = jax.tree.leaves(shapes.chunk)[0].shape[0]  # layers per chunk
        self.head_part = self.size * stages * chunks + 1  # the head's part in `part_keys`
        data = layout.data
        self.replicas = lax.psum(1, data) if data else 1
        self.replica = lax.axis_index(data) if data else 0
        # Of each micro-batch loss, and of its gradients: small cotangents, which a float16
        # backward needs (the reducer averages over the replicas: see `results`).
        self.scale = 1.0 / (schedule.micro_batches * self.replicas)
        # Without virtual stages nothing goes from the last stage round to the first.
        self.to_next = [
            (s, (s + 1) % stages) for s in range(stages) if chunks > 1 or s < stages - 1
        ]
        self.to_prev = [(s, (s - 1) % stages) for s in range(stages) if chunks > 1 or s > 0]
        self.index = lax.axis_index(AXIS)

        casts = shapes.casts
        self.embed_params = cast(params.embed, casts.embed)
        self.head_params = cast(params.head, casts.head)
        self.embed_state, self.head_state = model_state.embed, model_state.head
        by_chunk = lambda x: x.reshape(chunks, -1, *x.shape[1:])  # noqa: E731
        layers = cast(params.layers, casts.layers)
        self.layers = jax.tree.map(by_chunk, (layers, model_state.layers))
        # The parameters as the ticks use them: whole, in their dtypes there.
        self.ran = PipelineParams(
            *(
                _cast_shapes(s, c)
                for s, c in zip((shapes.embed, shapes.chunk, shapes.head), casts, strict=True)
            )
        )
        first_layer = jax.tree.map(lambda x: x[0], self._chunk(0))
        self.chunk = Chunk(model.stage, *first_layer, _zeros(shapes.activations), key)

    def _whole(self, part: str, tree: Any) -> Any:
        """`tree`, parameters of `part` ("embed", "layers" or "head") as this device holds
        them, gathered over the data axes where ZeRO-3 splits them."""

        def one(x: jax.Array, split: tuple) -> jax.Array:
            for dim, axes in split:
                x = lax.all_gather(x, axes, axis=dim, tiled=True)
            return x

        return jax.tree.map(one, tree, getattr(self.layout.gathers, part), is_leaf=_is_split)

    def _chunk(self, chunk: jax.Array | int) -> tuple[Any, Any]:
        """The parameters (whole) and model state of this stage's model chunk `chunk` (its
        layers stacked)."""
        if self.chunks > 1:
            w, s = _take(self.layers, chunk)
        else:
            w, s = jax.tree.map(lambda x: x[0], self.layers)
        return self._whole("layers", w), s

    def start(self, table: Timetable) -> _Carry:
        """The carry before the first tick: buffers of the timetable's sizes, and zero sums."""
        activations, shapes, compiler = self.shapes.activations, self.shapes, self.layout.compiler
        states = (self.embed_state, self.layers[1], self.head_state)
        # The gradients split over mp as their parameters are (else XLA may keep them whole and
        # gather every tick's gradients to add them).
        by_chunk = lambda s: PartitionSpec(None, *s)  # noqa: E731
        chunk_specs = jax.tree.map(by_chunk, compiler.layers, is_leaf=_is_spec)
        residuals = _zeros(self.chunk.shapes, table.residual_slots, self.size)
        return _Carry(
            constrain(residuals, self._residual_specs()),
            _zeros(activations, table.activation_slots),
            _zeros(activations, table.cotangent_slots),
            constrain(_zeros(shapes.chunk, self.chunks), chunk_specs),
            constrain(_zeros(shapes.embed), compiler.embed),
            constrain(_zeros(shapes.head), compiler.head),
            jnp.zeros((), jnp.float32),
            _zeros(shapes.aux),
            PipelineParams(*_zeros(states)),
        )

    def _residual_specs(self) -> list[PartitionSpec]:
        """Where the residual buffers [slots, layers per chunk, ...] are: a residual shaped
        like the activations (a layer's input, all a recomputed layer keeps) is split over
        the compiler's axes along its largest dimension that divides, as sequence
        parallelism keeps it, and gathered when its backward runs: a 1/mp of the memory of
        the micro-batches in flight for an all-gather per layer; the others as XLA likes."""
        split = self.layout.split
        if not split:
            return [PartitionSpec()] * len(self.chunk.shapes)
        ways = self.layout.split_ways
        activations = jax.tree.leaves(self.shapes.activations)
        like = [(a.shape, a.dtype) for a in activations]

        def spec(r: jax.ShapeDtypeStruct) -> PartitionSpec:
            dims = sorted(range(len(r.shape)), key=lambda d: -r.shape[d])
            fits = [d for d in dims if r.shape[d] % ways == 0]
            if (r.shape, r.dtype) not in like or not fits:
                return PartitionSpec()
            entries = [None] * (2 + len(r.shape))
            entries[2 + fits[0]] = split
            return PartitionSpec(*entries)

        return [spec(r) for r in self.chunk.shapes]

    def tick(self, segment: Segment, carry: _Carry, rows: jax.Array) -> tuple[_Carry, None]:
        """One tick of `segment`: this stage's row of `rows` [stages, COLUMNS], its forward,
        then its backward, then the sends: activations to the next stage, cotangents to the
        previous (each only in segments that have them)."""
        row = rows[self.index]
        if segment.forward:
            carry, (y, loss, metrics, dh) = self.forward(carry, row)
            carry = carry._replace(
                g_head=_added(carry.g_head, dh),
                loss=carry.loss + loss,
                metrics=jax.tree.map(jnp.add, carry.metrics, metrics),
            )
        if segment.backward:
            g_layers, dx, de = self.backward(carry, row)
            carry = carry._replace(g_layers=g_layers, g_embed=_added(carry.g_embed, de))
        if segment.send_forward and self.to_next:
            sent = lax.ppermute(y, AXIS, self.to_next)
            carry = carry._replace(activations=_put(carry.activations, row[RECV_ACT], sent))
        if segment.send_backward and self.to_prev:
            sent = lax.ppermute(dx, AXIS, self.to_prev)
            carry = carry._replace(cotangents=_put(carry.cotangents, row[RECV_COT], sent))
        return carry, None

    def forward(self, carry: _Carry, row: jax.Array) -> tuple[_Carry, tuple]:
        """The forward half of a tick, if the row has one: micro-batch ``row[F_MICRO]`` through
        chunk ``row[F_CHUNK]``, after embed on the first virtual stage and before the head on
        the last. Keeps the residuals (and the head's cotangent) and the new model states;
        returns the carry and the output to send, the loss, the metrics and the head's
        gradients."""
        chunk = row[F_CHUNK]
        virtual = chunk * self.stages + self.index
        is_first, is_last = virtual == 0, virtual == self.last
        shapes = self.shapes
        heads = (_F32, shapes.aux, self.ran.head, shapes.activations, self.head_state)

        def run(x_in: Any, batch: Any) -> tuple:
            w, s = self._chunk(chunk)
            # Parts: embed, head_loss, then this chunk's layers (in model order).
            layers = 1 + virtual * self.size + jnp.arange(self.size)
            parts = jnp.concatenate([jnp.array([0, self.head_part]), layers])
            keys = part_keys(self.key, self.replica, row[F_MICRO], parts)
            embed_params = functools.partial(self._whole, "embed", self.embed_params)
            embed = lambda: self.model.embed(embed_params(), self.embed_state, batch, keys[0])  # noqa: E731
            x, embed_state = lax.cond(is_first, embed, lambda: (x_in, _zeros(self.embed_state)))
            (y, layers_state), made = self.chunk.forward(w, s, x, keys[2:])
            head = functools.partial(self._head, y, batch, keys[1])
            *out, head_state = lax.cond(is_last, head, lambda: _zeros(heads))
            states = PipelineParams(embed_state, layers_state, head_state)
            return made, y, states, *out

        def idle(x_in: Any, batch: Any) -> tuple:
            states = PipelineParams(self.embed_state, self._chunk(0)[1], self.head_state)
            made = _zeros(self.chunk.shapes, self.size)
            return made, *_zeros((shapes.activations, states, *heads[:-1]))

        running = row[F_MICRO] >= 0
        batch = _take(self.micro, jnp.maximum(row[F_MICRO], 0))
        x_in = _take(carry.activations, row[F_ACT])
        made, y, states, loss, metrics, dh, dy = lax.cond(running, run, idle, x_in, batch)
        # Written outside the cond: a buffer that a cond's branch updates is copied whole.
        # Kept split (see `_residual_specs`), made and used whole: the split stays in the
        # buffer instead of spreading to the layers.
        made = constrain(made, [_WHOLE] * len(made))
        residuals = _put_where(carry.residuals, row[F_RES], running, made)
        cotangents = _put(carry.cotangents, row[F_DY], dy)
        last = row[F_MICRO] == self.micro_batches - 1
        states = self._states(carry.states, states, chunk, (last & is_first, last, last & is_last))
        carry = carry._replace(residuals=residuals, cotangents=cotangents, states=states)
        return carry, (y, loss, metrics, dh)

    def _states(
        self, total: PipelineParams, new: PipelineParams, chunk: jax.Array, last: tuple
    ) -> PipelineParams:
        """`total` with the new states of embed, chunk `chunk`'s layers and the head kept (see
        `_kept`; `last` says, per part, whether its new state is the last micro-batch's)."""
        layers = _kept(_take(total.layers, chunk), new.layers, last[1])
        return PipelineParams(
            _kept(total.embed, new.embed, last[0]),
            jax.tree.map(lambda t, x: t.at[chunk].set(x), total.layers, layers),
            _kept(total.head, new.head, last[2]),
        )

    def _head(self, y: Any, batch: Any, key: jax.Array) -> tuple:
        """The head's loss and metrics (each times 1 / (m replicas)), the gradients of the loss
        (times the loss scale, if any) for the head's parameters and for `y`, and the head's
        new model state."""

        def loss_fn(h: Any, y: Any) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
            loss, aux, state = self.model.head_loss(h, self.head_state, y, batch, key)
            aux = jax.tree.map(lambda a: a.astype(jnp.float32) * self.scale, aux)
            loss = loss.astype(jnp.float32)
            scaled = loss * self.scale
            scaled = scaled if self.loss_scale is None else scaled * self.loss_scale
            return scaled, (loss * self.scale, aux, state)

        grad = jax.grad(loss_fn, (0, 1), has_aux=True)
        (dh, dy), (loss, aux, state) = grad(self._whole("head", self.head_params), y)
        return loss, aux, dh, dy, state

    def backward(self, carry: _Carry, row: jax.Array) -> tuple:
        """The backward half of a tick, if the row has one: micro-batch ``row[B_MICRO]`` back
        through chunk ``row[B_CHUNK]`` from its kept residuals and cotangent, and back through
        embed on the first virtual stage. Returns the layers' gradients with the chunk's added,
        and the gradients of the chunk's input (to send) and of embed's parameters."""
        chunk, running = row[B_CHUNK], row[B_MICRO] >= 0
        is_first = chunk * self.stages + self.index == 0
        w, s = self._chunk(chunk)
        kept = constrain(_take(carry.residuals, row[B_RES]), [_WHOLE] * len(self.chunk.shapes))
        dy = _take(carry.cotangents, row[B_COT])
        g_layers, dx = self.chunk.backward(w, s, kept, dy, carry.g_layers, chunk, running)

        def embed_grad(dx: Any, batch: Any) -> Any:
            key = part_keys(self.key, self.replica, row[B_MICRO], 0)

            def embed(params: Any) -> Any:  # the activations (the new state is kept)
                return self.model.embed(params, self.embed_state, batch, key)[0]

            return jax.vjp(embed, self._whole("embed", self.embed_params))[1](dx)[0]

        batch = _take(self.micro, jnp.maximum(row[B_MICRO], 0))
        no_grad = lambda *_: _zeros(self.ran.embed)  # noqa: E731
        return g_layers, dx, lax.cond(is_first & running, embed_grad, no_grad, dx, batch)

    def results(self, carry: _Carry, reducer: Reducer) -> tuple[Any, Any, Any]:
        """The loss and metrics (means over every replica's micro-batches), the new model
        states (see `program`) and the gradients, reduced over the data axes by `reducer`;
        embed's and the head's also over the stages (only the first and the last make them),
        after the reducer has made them smaller."""
        data = self.layout.data
        every = (AXIS, *data)
        by_layer = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
        grads = PipelineParams(carry.g_embed, jax.tree.map(by_layer, carry.g_layers), carry.g_head)
        if data:  # the reducer averages each replica's gradients of its own mean loss
            grads = jax.tree.map(lambda g: g * self.replicas, grads)
            grads = self._reduced(grads, reducer)
        grads = grads._replace(embed=_psum(grads.embed, AXIS), head=_psum(grads.head, AXIS))
        states = carry.states
        states = PipelineParams(
            _psum(_merged(states.embed, self.micro_batches, data), AXIS),
            jax.tree.map(by_layer, _merged(states.layers, self.micro_batches, data)),
            _psum(_merged(states.head, self.micro_batches, data), AXIS),
        )
        return (_psum(carry.loss, every), _psum(carry.metrics, every)), states, grads

    def _reduced(self, grads: PipelineParams, reducer: Reducer) -> PipelineParams:
        """`grads` reduced over the data axes by `reducer`, on each device's own part of them
        (a `shard_map` over the compiler's axes too: XLA would gather a gradient split over
        mp before a reduce-scatter over sharding)."""
        compiler = self.layout.compiler
        axes = {a for s in jax.tree.leaves(compiler, is_leaf=_is_spec) for a in spec_axes(s)}
        reduce = functools.partial(reducer, axes=self.layout.data)
        if not axes:
            return reduce(grads)
        return jax.shard_map(
            reduce,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=(compiler,),
            out_specs=compiler,
            axis_names=axes,
            check_vma=False,
        )(grads)


_F32 = jax.ShapeDtypeStruct((), jnp.float32)


def _cast_shapes(shapes: Any, dtypes: Any) -> Any:
    """`shapes` with the dtypes `dtypes` gives (None: as they are)."""
    return jax.tree.map(
        lambda a, d: a if d is None else jax.ShapeDtypeStruct(a.shape, d), shapes, dtypes
    )


def _merged(states: Any, micro_batches: int, data: tuple[str, ...]) -> Any:
    """The new model state from each replica's sums of its micro-batches' new floating states
    (and the last of the others): the mean of the floating ones over every replica's
    micro-batches, the last replica's of the others."""

    def one(x: jax.Array) -> jax.Array:
        if jnp.issubdtype(x.dtype, jnp.floating):
            total = _psum(x, data) if data else x
            return (total / (micro_batches * (lax.psum(1, data) if data else 1))).astype(x.dtype)
        return lax.all_gather(x, data)[-1] if data else x

    return jax.tree.map(one, states)


def _psum(tree: Any, axes: Any) -> Any:
    """`tree` summed over `axes` in its dtypes (booleans: any)."""

    def one(x: jax.Array) -> jax.Array:
        if x.dtype == jnp.bool_:
            return lax.psum(x.astype(jnp.int32), axes) > 0
        return lax.psum(x, axes)

    return jax.tree.map(one, tree)


def _kept(total: Any, new: Any, last: jax.Array) -> Any:
    """`total` (a sum of new floating states, and the last of the others) with `new` added, or
    for the others, `new` if it is the last micro-batch's."""

    def one(t: jax.Array, n: jax.Array) -> jax.Array:
        return t + n if jnp.issubdtype(t.dtype, jnp.floating) else jnp.where(last, n, t)

    return jax.tree.map(one, total, new)


def _added(total: Any, value: Any) -> Any:
    """`total` + `value`, in `total`'s dtypes (a gradient of a half-precision copy of a
    parameter added to the parameter's gradient)."""
    return jax.tree.map(lambda t, v: t + v.astype(t.dtype), total, value)


def _zeros(shape: Any, *lead: int) -> Any:
    """Zeros of `shape` (a pytree of shapes), with leading dimensions `lead`."""
    return jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), shape)


def _put(buffers: Any, slot: jax.Array, values: Any) -> Any:
    """`values` written into slot `slot` of `buffers`."""
    return jax.tree.map(lambda b, v: b.at[slot].set(v), buffers, values)


def _put_where(buffers: Any, slot: jax.Array, write: jax.Array, values: Any) -> Any:
    """`values` written into slot `slot` of `buffers` if `write`, else `buffers` as they are."""
    kept = _take(buffers, slot)
    chosen = jax.tree.map(lambda v, k: jnp.where(write, v, k), values, kept)
    return _put(buffers, slot, chosen)


def _take(tree: Any, index: jax.Array) -> Any:
    """Entry `index` of every leaf's leading axis."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, keepdims=False), tree)
