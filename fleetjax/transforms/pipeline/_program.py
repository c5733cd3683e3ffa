"""The pipeline's SPMD program: one `shard_map` over ``pp`` that runs a timetable tick by tick.

`program` splits the batch into micro-batches and runs `_Stage`, the per-stage program, as the
body of the `shard_map`: a `lax.scan` over the timetable's rows, each tick the forward half
(`_Stage.forward`: embed on the first virtual stage, the chunk's layers with their residuals
kept, the head on the last) and then the backward half (`_Stage.backward`: the chunk's `jax.vjp`
from the kept residuals, embed's on the first virtual stage), then the sends to the neighbours.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleetjax.mesh import constrain, data_axes, data_parallel_size
from fleetjax.transforms.grad_allreduce import Reducer
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
    Timetable,
    timetable,
)
from fleetjax.transforms.pipeline.schedules import PipelineSchedule

AXIS = "pp"


def program(
    model: ModelFunctions,
    schedule: PipelineSchedule,
    mesh: Mesh,
    micro_batch_size: int,
    reducer: Reducer | None = None,
) -> Callable[..., tuple[tuple[jax.Array, Any], PipelineParams, PipelineParams]]:
    """The pipeline of `model` on `mesh`: ``run(params, model_state, batch, key, loss_scale) ->
    ((loss, aux), new_model_state, grads)``, `key` raw key data, `loss_scale` a float32 scalar
    or None, `model_state` a `PipelineParams` of the parts' states (``()`` for none).

    The loss and metrics are the means over every replica's micro-batches; the gradients are
    the loss's, times `loss_scale` when there is one (the loss and metrics are not scaled).
    Each replica's gradients are summed over the replicas after the `shard_map`, or with a
    `reducer`, reduced by it over the data axes at the end of each stage's program. Every
    micro-batch sees `model_state`; of the new states, the floating ones are averaged over every
    replica's micro-batches and the others are the last micro-batch's (of the last replica), as
    `gradient_merge.microbatched` does.
    """
    table = timetable(schedule)
    whole = PartitionSpec()  # not split over pp
    split = PipelineParams(whole, PartitionSpec(AXIS), whole)  # the layers split over pp
    # The gradients of every replica, [replicas, ...], or those the reducer made, [...].
    replica = () if reducer is not None else (None,)

    def run(
        params: PipelineParams,
        model_state: PipelineParams,
        batch: Any,
        key: jax.Array,
        loss_scale: jax.Array | None,
    ) -> tuple[tuple[jax.Array, Any], PipelineParams, PipelineParams]:
        micro = _micro_batches(batch, mesh, micro_batch_size, schedule.micro_batches)
        shapes = _shapes(model, schedule, params, model_state, micro)
        scales = () if loss_scale is None else (loss_scale,)

        def per_stage(
            params: PipelineParams, model_state: PipelineParams, micro: Any, *rest: jax.Array
        ) -> tuple[Any, Any, Any]:
            inputs = (params, model_state, micro, *rest)
            stage = _Stage(model, schedule, mesh, shapes, *inputs, reducer=reducer)
            carry, _ = lax.scan(stage.tick, stage.start(table), jnp.asarray(table.table))
            return stage.results(carry)

        context = jax.sharding.get_abstract_mesh()  # under auto_axes: this mesh, Auto typed
        sharded = jax.shard_map(
            per_stage,
            mesh=mesh if context.empty else context,
            axis_names={AXIS},
            # params, model state, micro-batches, key (and the loss scale)
            in_specs=(split, split, whole, whole, *[whole] * len(scales)),
            # gradients, new model states, loss and metrics: see _Stage.results
            out_specs=(
                (PartitionSpec(*replica, AXIS), PartitionSpec(AXIS)),
                (PartitionSpec(None, AXIS), PartitionSpec(AXIS)),
                PartitionSpec(AXIS),
            ),
        )
        grads, states, sums = sharded(params, model_state, micro, key, *scales)
        (g_layers, g_ends), (s_layers, s_ends) = grads, states
        if reducer is None:  # sum over the replicas (each scaled by 1 / replicas already)
            g_layers = jax.tree.map(lambda g: g.sum(0), g_layers)
        # The loss, the metrics and the embed and head gradients and states: also over the
        # stages that made them (the others have zeros).
        g_embed, g_head = jax.tree.map(lambda x: x.sum(tuple(range(1 + len(replica)))), g_ends)
        loss, aux = jax.tree.map(lambda x: x.sum((0, 1)), sums)
        s_embed, s_head = jax.tree.map(lambda x: x.sum(0).astype(x.dtype), s_ends)
        count = schedule.micro_batches * data_parallel_size(mesh)
        new_state = _merged(PipelineParams(s_embed, s_layers, s_head), count)
        return (loss, aux), new_state, PipelineParams(g_embed, g_layers, g_head)

    return run


def _merged(states: Any, count: int) -> Any:
    """The new model state from each replica's [replicas, ...] sums of its micro-batches' new
    floating states (and the last of the others): the mean of the floating ones over all
    `count` micro-batches, the last replica's of the others."""

    def one(x: jax.Array) -> jax.Array:
        if jnp.issubdtype(x.dtype, jnp.floating):
            return (x.sum(0) / count).astype(x.dtype)
        return x[-1]

    return jax.tree.map(one, states)


def _kept(total: Any, new: Any, last: jax.Array) -> Any:
    """`total` (a sum of new floating states, and the last of the others) with `new` added, or
    for the others, `new` if it is the last micro-batch's."""

    def one(t: jax.Array, n: jax.Array) -> jax.Array:
        return t + n if jnp.issubdtype(t.dtype, jnp.floating) else jnp.where(last, n, t)

    return jax.tree.map(one, total, new)


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
        needed = replicas * micro_batch_size * accumulate_steps
        raise ValueError(
            f"a pipeline batch has data-parallel replicas x micro_batch_size x accumulate_steps "
            f"= {replicas} x {micro_batch_size} x {accumulate_steps} = {needed} rows, got "
            f"{size}: pass {needed} rows, or change pipeline_configs' micro_batch_size or "
            "accumulate_steps (each replica's rows are accumulate_steps micro-batches)"
        )

    def cut(x: jax.Array) -> jax.Array:
        x = x.reshape(replicas, accumulate_steps, micro_batch_size, *x.shape[1:])
        return x.swapaxes(0, 1)

    by_replica = NamedSharding(mesh, PartitionSpec(None, data_axes(mesh) or None))
    return constrain(jax.tree.map(cut, batch), by_replica)


class _ChunkVjp:
    """A chunk's forward that also returns its `jax.vjp` residuals, and the backward from them.

    The forward is traced once, here, and that one jaxpr runs in every tick: tracing `jax.vjp`
    again (inside `cond`, `vmap`, `shard_map`) may give its residuals in another order, or
    more of them (constants lifted), than the buffers were made for. Residuals that are the
    chunk's parameters themselves are not returned; `backward` takes them from the parameters.
    """

    def __init__(
        self,
        chunk: Callable[[Any, Any, Any, jax.Array], Any],
        params: Any,
        state: Any,
        x: Any,
        keys: jax.Array,
    ) -> None:
        """Traces `chunk`'s forward for values like `params`, the layers' model `state`, `x`
        and the layers' `keys` (typed as in the ticks)."""

        def forward(w: Any, s: Any, x: Any, keys: jax.Array) -> tuple[Any, list[jax.Array]]:
            y, vjp_fn, new_s = jax.vjp(lambda w, x: chunk(w, s, x, keys), w, x, has_aux=True)
            leaves, treedef = jax.tree.flatten(vjp_fn)
            kept = jax.tree.leaves((w, s))
            # Per residual: the index of the parameter (or state) it is, or None.
            where = [next((j for j, p in enumerate(kept) if r is p), None) for r in leaves]
            self._vjp_def = (treedef, where)
            return (y, new_s), [r for r, j in zip(leaves, where, strict=True) if j is None]

        trace = jax.make_jaxpr(forward, return_shape=True)
        jaxpr, (out, residuals) = trace(params, state, x, keys)
        self._forward = jaxpr_as_fun(jaxpr)
        self._out_def = jax.tree.structure(out)
        self.shapes: list[jax.ShapeDtypeStruct] = residuals

    def forward(
        self, w: Any, s: Any, x: Any, keys: jax.Array
    ) -> tuple[tuple[Any, Any], list[jax.Array]]:
        """The chunk's output and its layers' new states, and its residuals."""
        out = self._forward(*jax.tree.leaves((w, s, x, keys)))
        split = self._out_def.num_leaves
        return jax.tree.unflatten(self._out_def, out[:split]), list(out[split:])

    def backward(self, w: Any, s: Any, residuals: list[jax.Array], dy: Any) -> tuple[Any, Any]:
        """The gradients for the chunk's parameters and input, given its output's `dy`."""
        treedef, where = self._vjp_def
        kept, stored = jax.tree.leaves((w, s)), iter(residuals)
        leaves = [next(stored) if j is None else kept[j] for j in where]
        return jax.tree.unflatten(treedef, leaves)(dy)


class _Shapes(NamedTuple):
    """The shapes of one replica's activations, of one chunk's parameters and of the metrics."""

    activations: Any  # ShapeDtypeStructs of embed's output (and every stage's)
    chunk: Any  # ShapeDtypeStructs of one chunk's parameters
    aux: Any  # ShapeDtypeStructs of head_loss's metrics, in float32


def _shapes(
    model: ModelFunctions,
    schedule: PipelineSchedule,
    params: PipelineParams,
    model_state: PipelineParams,
    micro: Any,
) -> _Shapes:
    """The activations' and a chunk's shapes; checks that the layers split into chunks and that
    `stage` keeps the activations' shapes, and every part its model state's."""
    lengths = {x.shape[0] for x in jax.tree.leaves((params.layers, model_state.layers))}
    if len(lengths) != 1:
        raise ValueError(
            f"every layers leaf (of the parameters and model state) needs the same leading "
            f"(layer) axis, got {lengths}"
        )
    size = chunk_size(lengths.pop(), schedule.stages, schedule.virtual_stages)
    chunk = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((size, *a.shape[1:]), a.dtype), params.layers
    )
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), micro)
    key = jax.ShapeDtypeStruct(NO_KEY.shape, NO_KEY.dtype)
    activations, state = jax.eval_shape(model.embed, params.embed, model_state.embed, one, key)
    _check_like("embed must return a model state", state, model_state.embed)
    layer = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), (chunk, model_state.layers)
    )
    out, state = jax.eval_shape(model.stage, *layer, activations, key)
    _check_like("stage must return activations", out, activations)
    _check_like("stage must return a model state", state, layer[1])
    head = (params.head, model_state.head, activations, one, key)
    _, aux, state = jax.eval_shape(model.head_loss, *head)
    _check_like("head_loss must return a model state", state, model_state.head)
    aux = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), aux)
    return _Shapes(activations, chunk, aux)


def _check_like(what: str, got: Any, want: Any) -> None:
    """`got` has the structure, shapes and dtypes of `want` (`what` says whose)."""
    if jax.tree.structure(got) != jax.tree.structure(want) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ):
        raise ValueError(f"{what} like its input {want}, got {got}")


class _Carry(NamedTuple):
    """What a stage carries from tick to tick: its buffers and, per replica, its sums so far."""

    residuals: Any  # [residual slots, replicas, ...]: of forwards whose backward has not run
    activations: Any  # [activation slots, replicas, ...]: received and not yet consumed
    cotangents: Any  # [cotangent slots, replicas, ...]: received (or made by the head)
    g_layers: Any  # [replicas, chunks, layers per chunk, ...]
    g_embed: Any  # [replicas, ...]
    g_head: Any  # [replicas, ...]
    loss: jax.Array  # [replicas]
    metrics: Any  # [replicas, ...]
    # Per replica, the sums of the new floating model states and the last of the others: a
    # PipelineParams of [replicas, ...], the layers' [replicas, chunks, layers per chunk, ...].
    states: PipelineParams


class _Stage:
    """One stage's program, the body of the `shard_map` over ``pp``: `start`, then `tick` for
    each row of the timetable (`lax.scan`), then `results`.

    The model runs under a `vmap` over the data-parallel replicas (the micro-batches are [m,
    replicas, micro_batch_size, ...]), so that each replica accumulates its own gradients and
    they are reduced over the data axes once, after the pipeline.
    """

    def __init__(
        self,
        model: ModelFunctions,
        schedule: PipelineSchedule,
        mesh: Mesh,
        shapes: _Shapes,
        params: PipelineParams,
        model_state: PipelineParams,
        micro: Any,
        key: jax.Array,
        loss_scale: jax.Array | None = None,
        *,
        reducer: Reducer | None = None,
    ) -> None:
        """The stage's program for `params` and `model_state` (embed's, this stage's layers',
        the head's), the micro-batches `micro`, the step's `key`, the `loss_scale` and the
        `reducer` (if any), as the `shard_map` gives them."""
        stages, chunks = schedule.stages, schedule.virtual_stages
        self.model, self.shapes, self.micro, self.key = model, shapes, micro, key
        self.micro_batches = schedule.micro_batches
        self.loss_scale, self.reducer = loss_scale, reducer
        self.stages, self.chunks = stages, chunks
        self.last = stages * chunks - 1  # the last virtual stage
        self.size = jax.tree.leaves(shapes.chunk)[0].shape[0]  # layers per chunk
        self.head_part = self.size * stages * chunks + 1  # the head's part in `part_keys`
        self.replicas = data_parallel_size(mesh)
        self.axes = data_axes(mesh)
        # The reducer's shard_map: the data axes, and those of size 1 (nothing to partition),
        # which keeps XLA:CPU compiling bfloat16 all-reduces (see grad_allreduce).
        self.manual = {a for a in mesh.axis_names if a in self.axes or mesh.shape[a] == 1}
        self.manual.discard(AXIS)
        self.scale = 1.0 / (schedule.micro_batches * self.replicas)  # of each micro-batch loss
        # A reducer averages each replica's mean gradient over the replicas itself.
        self.grad_scale = self.scale if reducer is None else 1.0 / schedule.micro_batches
        self.by_replica = PartitionSpec(None, self.axes or None)  # [slots, replicas, ...]
        # Without virtual stages nothing goes from the last stage round to the first.
        self.to_next = [
            (s, (s + 1) % stages) for s in range(stages) if chunks > 1 or s < stages - 1
        ]
        self.to_prev = [(s, (s - 1) % stages) for s in range(stages) if chunks > 1 or s > 0]

        self.index = lax.axis_index(AXIS)
        self.replica_ids = jnp.arange(self.replicas)
        # Varying from the start: a gradient for a value invariant over pp would be summed
        # over pp inside the cond branches. `nil` is a zero typed as varying over pp.
        ends = (params.embed, params.head, model_state.embed, model_state.head, jnp.float32(0))
        self.embed_params, self.head_params, self.embed_state, self.head_state, self.nil = _varying(
            ends
        )
        by_chunk = lambda x: x.reshape(self.chunks, -1, *x.shape[1:])  # noqa: E731
        self.layers = jax.tree.map(by_chunk, (params.layers, model_state.layers))
        layer_keys = jnp.zeros((self.size, *key.shape), key.dtype)
        example = (*self._chunk(0), _zeros(shapes.activations), layer_keys)
        self.chunk_vjp = _ChunkVjp(model.chunk, *example)

    def _chunk(self, chunk: jax.Array | int) -> tuple[Any, Any]:
        """The parameters and model state of this stage's model chunk `chunk` (its layers
        stacked)."""
        if self.chunks > 1:
            return _take(self.layers, chunk)
        return jax.tree.map(lambda x: x[0], self.layers)

    def _buffer(self, shape: Any, slots: int) -> Any:
        """`slots` slots for every replica's value of `shape`."""
        return constrain(_zeros(shape, slots, self.replicas), self.by_replica)

    def start(self, table: Timetable) -> _Carry:
        """The carry before the first tick: buffers of the timetable's sizes, and zero sums."""
        activations, replicas = self.shapes.activations, self.replicas
        states = (self.embed_state, self.layers[1], self.head_state)
        return _Carry(
            self._buffer(self.chunk_vjp.shapes, table.residual_slots),
            self._buffer(activations, table.activation_slots),
            self._buffer(activations, table.cotangent_slots),
            _zeros(self.layers[0], replicas),
            _zeros(self.embed_params, replicas),
            _zeros(self.head_params, replicas),
            _zeros(_F32, replicas),
            _zeros(self.shapes.aux, replicas),
            PipelineParams(*_zeros(states, replicas)),
        )

    def tick(self, carry: _Carry, rows: jax.Array) -> tuple[_Carry, None]:
        """One tick: this stage's row of `rows` [stages, COLUMNS], its forward, then its
        backward, then the sends: activations to the next stage, cotangents to the previous."""
        row = rows[self.index]
        carry, (y, loss, metrics, dh) = self.forward(carry, row)
        dw, dx, de = self.backward(carry, row)
        b_chunk = row[B_CHUNK]
        g_layers = jax.tree.map(lambda g, d: g.at[:, b_chunk].add(d), carry.g_layers, dw)
        g_embed = jax.tree.map(jnp.add, carry.g_embed, de)
        g_head = jax.tree.map(jnp.add, carry.g_head, dh)
        activations, cotangents = carry.activations, carry.cotangents
        if self.to_next:
            activations = _put(activations, row[RECV_ACT], lax.ppermute(y, AXIS, self.to_next))
            cotangents = _put(cotangents, row[RECV_COT], lax.ppermute(dx, AXIS, self.to_prev))
        metrics = jax.tree.map(jnp.add, carry.metrics, metrics)
        sums = (g_layers, g_embed, g_head, carry.loss + loss, metrics, carry.states)
        return _Carry(carry.residuals, activations, cotangents, *sums), None

    def forward(self, carry: _Carry, row: jax.Array) -> tuple[_Carry, tuple]:
        """The forward half of a tick, if the row has one: micro-batch ``row[F_MICRO]`` through
        chunk ``row[F_CHUNK]``, after embed on the first virtual stage and before the head on
        the last. Keeps the residuals (and the head's cotangent) and the new model states;
        returns the carry and, per replica, the output to send, the loss, the metrics and the
        head's gradients."""
        chunk = row[F_CHUNK]
        is_first = chunk * self.stages + self.index == 0
        is_last = chunk * self.stages + self.index == self.last
        shapes = self.shapes
        heads = (_F32, shapes.aux, self.head_params, shapes.activations, self.head_state)

        def one(w: Any, s: Any, x_in: Any, batch: Any, replica: jax.Array) -> tuple:
            # Parts: embed, head_loss, then this chunk's layers (in model order).
            first_layer = (chunk * self.stages + self.index) * self.size
            layers = 1 + first_layer + jnp.arange(self.size)
            parts = jnp.concatenate([jnp.array([0, self.head_part]), layers])
            keys = part_keys(self.key, replica, row[F_MICRO], parts)
            embed_key, head_key = keys[0], keys[1]
            embed = functools.partial(
                self.model.embed, self.embed_params, self.embed_state, batch, embed_key
            )
            x, embed_state = lax.cond(is_first, embed, lambda: (x_in, _zeros(self.embed_state)))
            (y, layers_state), residuals = self.chunk_vjp.forward(w, s, x, keys[2:])
            head = functools.partial(self._head, y, batch, head_key)
            *out, head_state = lax.cond(is_last, head, lambda: _zeros(heads))
            states = PipelineParams(embed_state, layers_state, head_state)
            return residuals, y, states, *out

        def run(residuals: Any, x_in: Any, batch: Any) -> tuple:
            w, s = self._chunk(chunk)
            in_axes = (None, None, 0, 0, 0)
            made, *out = jax.vmap(one, in_axes=in_axes)(w, s, x_in, batch, self.replica_ids)
            return _put(residuals, row[F_RES], made), *out

        def idle(residuals: Any, x_in: Any, batch: Any) -> tuple:
            states = PipelineParams(self.embed_state, self._chunk(0)[1], self.head_state)
            made = (shapes.activations, states, *heads[:-1])
            return residuals, *_zeros(made, self.replicas)

        batch = _take(self.micro, jnp.maximum(row[F_MICRO], 0))
        x_in = _take(carry.activations, row[F_ACT])
        residuals, y, states, loss, metrics, dh, dy = lax.cond(
            row[F_MICRO] >= 0, run, idle, carry.residuals, x_in, batch
        )
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
        at_chunk = lambda x: lax.dynamic_index_in_dim(x, chunk, 1, keepdims=False)  # noqa: E731
        layers = _kept(jax.tree.map(at_chunk, total.layers), new.layers, last[1])
        return PipelineParams(
            _kept(total.embed, new.embed, last[0]),
            jax.tree.map(lambda t, x: t.at[:, chunk].set(x), total.layers, layers),
            _kept(total.head, new.head, last[2]),
        )

    def _head(self, y: Any, batch: Any, key: jax.Array) -> tuple:
        """The head's loss and metrics (each times 1 / (m replicas)), the gradients of the loss
        (times the loss scale, if any) for the head's parameters and for `y`, and the head's
        new model state."""

        def loss_fn(h: Any, y: Any) -> tuple[jax.Array, tuple[jax.Array, Any, Any]]:
            loss, aux, state = self.model.head_loss(h, self.head_state, y, batch, key)
            # + a varying zero: a metric that is a constant must be typed as varying over pp
            # too, as the zeros of a stage without the head are.
            aux = jax.tree.map(lambda a: a.astype(jnp.float32) * self.scale + self.nil, aux)
            loss = loss.astype(jnp.float32)
            scaled = loss * self.grad_scale
            scaled = scaled if self.loss_scale is None else scaled * self.loss_scale
            return scaled, (loss * self.scale, aux, state)

        grad = jax.grad(loss_fn, (0, 1), has_aux=True)
        (dh, dy), (loss, aux, state) = grad(self.head_params, y)
        return loss, aux, dh, dy, state

    def backward(self, carry: _Carry, row: jax.Array) -> tuple:
        """The backward half of a tick, if the row has one: micro-batch ``row[B_MICRO]`` back
        through chunk ``row[B_CHUNK]`` from its kept residuals and cotangent, and back through
        embed on the first virtual stage. Returns, per replica, the gradients of the chunk's
        parameters, of its input (to send) and of embed's parameters."""
        chunk = row[B_CHUNK]
        shapes = self.shapes

        def one(
            w: Any, s: Any, residuals: list[jax.Array], dy: Any, batch: Any, replica: jax.Array
        ) -> tuple:
            dw, dx = self.chunk_vjp.backward(w, s, residuals, dy)

            def embed_grad() -> Any:
                embed_key = part_keys(self.key, replica, row[B_MICRO], 0)

                def embed(params: Any) -> Any:  # the activations (the new state is kept)
                    return self.model.embed(params, self.embed_state, batch, embed_key)[0]

                return jax.vjp(embed, self.embed_params)[1](dx)[0]

            is_first = chunk * self.stages + self.index == 0
            return dw, dx, lax.cond(is_first, embed_grad, lambda: _zeros(self.embed_params))

        def run(residuals: Any, dy: Any, batch: Any) -> tuple:
            (w, s), kept = self._chunk(chunk), _take(residuals, row[B_RES])
            in_axes = (None, None, 0, 0, 0, 0)
            return jax.vmap(one, in_axes=in_axes)(w, s, kept, dy, batch, self.replica_ids)

        def idle(residuals: Any, dy: Any, batch: Any) -> tuple:
            return _zeros((shapes.chunk, shapes.activations, self.embed_params), self.replicas)

        batch = _take(self.micro, jnp.maximum(row[B_MICRO], 0))
        dy = _take(carry.cotangents, row[B_COT])
        return lax.cond(row[B_MICRO] >= 0, run, idle, carry.residuals, dy, batch)

    def results(self, carry: _Carry) -> tuple[Any, Any, Any]:
        """The gradients: the layers' [replicas, layers, ...] and per stage, embed's and the
        head's [1, replicas, ...] (with a reducer, reduced over the replicas: [layers, ...] and
        [1, ...]); the new model states (`_Carry.states`) in the same forms; and per stage, the
        loss and metrics [1, replicas, ...]."""
        per_layer = lambda x: x.reshape(self.replicas, -1, *x.shape[3:])  # noqa: E731
        by_layer = functools.partial(jax.tree.map, per_layer)
        grads = (by_layer(carry.g_layers), (carry.g_embed, carry.g_head))
        if self.reducer is not None:
            grads = self._reduced(grads)
        g_layers, g_ends = grads
        states = carry.states
        first = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
        return (
            (g_layers, first(g_ends)),
            (by_layer(states.layers), first((states.embed, states.head))),
            first((carry.loss, carry.metrics)),
        )

    def _reduced(self, grads: Any) -> Any:
        """Every replica's gradients ([replicas, ...]), reduced by the reducer over the data
        axes in a `shard_map` over them, where each device holds its own replica's."""

        def local(grads: Any) -> Any:
            return self.reducer(jax.tree.map(lambda g: g[0], grads), self.axes)

        # check_vma off: a reducer of `ppermute`s (hierarchical) makes equal values that JAX
        # cannot prove equal.
        return jax.shard_map(
            local,
            in_specs=PartitionSpec(self.axes),
            out_specs=PartitionSpec(),
            axis_names=self.manual,
            check_vma=False,
        )(grads)


_F32 = jax.ShapeDtypeStruct((), jnp.float32)


def _zeros(shape: Any, *lead: int) -> Any:
    """Zeros of `shape` (a pytree of shapes), with leading dimensions `lead`, varying over pp."""
    return _varying(jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), shape))


def _put(buffers: Any, slot: jax.Array, values: Any) -> Any:
    """`values` written into slot `slot` of `buffers`."""
    return jax.tree.map(lambda b, v: b.at[slot].set(v), buffers, values)


def _varying(tree: Any) -> Any:
    """`tree` (values invariant over pp) typed as varying over pp, as values that differ
    between stages (loop carries, cond branches) must be inside `shard_map`."""
    return jax.tree.map(lambda x: lax.pcast(x, (AXIS,), to="varying"), tree)


def _take(tree: Any, index: jax.Array) -> Any:
    """Entry `index` of every leaf's leading axis."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, keepdims=False), tree)
