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
    model: ModelFunctions, schedule: PipelineSchedule, mesh: Mesh, micro_batch_size: int
) -> Callable[..., tuple[tuple[jax.Array, Any], PipelineParams]]:
    """The pipeline of `model` on `mesh`: ``run(params, batch, key, loss_scale) -> ((loss, aux),
    grads)``, `key` raw key data, `loss_scale` a float32 scalar or None.

    The loss and metrics are the means over every replica's micro-batches; the gradients are
    the loss's, times `loss_scale` when there is one (the loss and metrics are not scaled).
    """
    table = timetable(schedule)
    whole = PartitionSpec()  # not split over pp

    def run(
        params: PipelineParams, batch: Any, key: jax.Array, loss_scale: jax.Array | None
    ) -> tuple[tuple[jax.Array, Any], PipelineParams]:
        micro = _micro_batches(batch, mesh, micro_batch_size, schedule.micro_batches)
        shapes = _shapes(model, schedule, params, micro)
        scales = () if loss_scale is None else (loss_scale,)

        def per_stage(
            embed: Any, layers: Any, head: Any, micro: Any, key: jax.Array, *scale: jax.Array
        ) -> tuple[Any, Any]:
            params = (embed, layers, head)
            stage = _Stage(model, schedule, mesh, shapes, params, micro, key, *scale)
            carry, _ = lax.scan(stage.tick, stage.start(table), jnp.asarray(table.table))
            return stage.results(carry)

        context = jax.sharding.get_abstract_mesh()  # under auto_axes: this mesh, Auto typed
        sharded = jax.shard_map(
            per_stage,
            mesh=mesh if context.empty else context,
            axis_names={AXIS},
            # embed, layers, head, micro-batches, key (and the loss scale)
            in_specs=(whole, PartitionSpec(AXIS), whole, whole, whole, *[whole] * len(scales)),
            out_specs=(PartitionSpec(None, AXIS), PartitionSpec(AXIS)),
        )
        g_layers, by_stage = sharded(params.embed, params.layers, params.head, micro, key, *scales)
        # Sum over the data-parallel replicas (each scaled by 1 / replicas already) and, for
        # the loss and the embed and head gradients, over the stages that made them.
        g_layers = jax.tree.map(lambda g: g.sum(0), g_layers)
        loss, aux, g_embed, g_head = jax.tree.map(lambda x: x.sum((0, 1)), by_stage)
        return (loss, aux), PipelineParams(g_embed, g_layers, g_head)

    return run


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


class _ChunkVjp:
    """A chunk's forward that also returns its `jax.vjp` residuals, and the backward from them.

    The forward is traced once, here, and that one jaxpr runs in every tick: tracing `jax.vjp`
    again (inside `cond`, `vmap`, `shard_map`) may give its residuals in another order, or
    more of them (constants lifted), than the buffers were made for. Residuals that are the
    chunk's parameters themselves are not returned; `backward` takes them from the parameters.
    """

    def __init__(
        self, chunk: Callable[[Any, Any, jax.Array], Any], params: Any, x: Any, keys: jax.Array
    ) -> None:
        """Traces `chunk`'s forward for values like `params`, `x` and the layers' `keys` (typed
        as in the ticks)."""

        def forward(w: Any, x: Any, keys: jax.Array) -> tuple[Any, list[jax.Array]]:
            y, vjp_fn = jax.vjp(lambda w, x: chunk(w, x, keys), w, x)
            leaves, treedef = jax.tree.flatten(vjp_fn)
            w_leaves = jax.tree.leaves(w)
            # Per residual: the index of the parameter it is, or None.
            where = [next((j for j, p in enumerate(w_leaves) if r is p), None) for r in leaves]
            self._vjp_def = (treedef, where)
            return y, [r for r, j in zip(leaves, where, strict=True) if j is None]

        jaxpr, (y, residuals) = jax.make_jaxpr(forward, return_shape=True)(params, x, keys)
        self._forward = jaxpr_as_fun(jaxpr)
        self._y_def = jax.tree.structure(y)
        self.shapes: list[jax.ShapeDtypeStruct] = residuals

    def forward(self, w: Any, x: Any, keys: jax.Array) -> tuple[Any, list[jax.Array]]:
        """The chunk's output and its residuals."""
        out = self._forward(*jax.tree.leaves((w, x, keys)))
        split = self._y_def.num_leaves
        return jax.tree.unflatten(self._y_def, out[:split]), list(out[split:])

    def backward(self, w: Any, residuals: list[jax.Array], dy: Any) -> tuple[Any, Any]:
        """The gradients for the chunk's parameters and input, given its output's `dy`."""
        treedef, where = self._vjp_def
        w_leaves, stored = jax.tree.leaves(w), iter(residuals)
        leaves = [next(stored) if j is None else w_leaves[j] for j in where]
        return jax.tree.unflatten(treedef, leaves)(dy)


class _Shapes(NamedTuple):
    """The shapes of one replica's activations, of one chunk's parameters and of the metrics."""

    activations: Any  # ShapeDtypeStructs of embed's output (and every stage's)
    chunk: Any  # ShapeDtypeStructs of one chunk's parameters
    aux: Any  # ShapeDtypeStructs of head_loss's metrics, in float32


def _shapes(
    model: ModelFunctions, schedule: PipelineSchedule, params: PipelineParams, micro: Any
) -> _Shapes:
    """The activations' and a chunk's shapes; checks that the layers split into chunks and that
    `stage` keeps the activations' shapes."""
    lengths = {x.shape[0] for x in jax.tree.leaves(params.layers)}
    if len(lengths) != 1:
        raise ValueError(f"every layers leaf needs the same leading (layer) axis, got {lengths}")
    size = chunk_size(lengths.pop(), schedule.stages, schedule.virtual_stages)
    chunk = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((size, *a.shape[1:]), a.dtype), params.layers
    )
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), micro)
    key = jax.ShapeDtypeStruct(NO_KEY.shape, NO_KEY.dtype)
    activations = jax.eval_shape(model.embed, params.embed, one, key)
    layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), chunk)
    out = jax.eval_shape(model.stage, layer, activations, key)
    if jax.tree.structure(out) != jax.tree.structure(activations) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype)
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(activations), strict=True)
    ):
        raise ValueError(f"stage must return activations like its input {activations}, got {out}")
    _, aux = jax.eval_shape(model.head_loss, params.head, activations, one, key)
    aux = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32), aux)
    return _Shapes(activations, chunk, aux)


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
        params: tuple[Any, Any, Any],
        micro: Any,
        key: jax.Array,
        loss_scale: jax.Array | None = None,
    ) -> None:
        """The stage's program for `params` (embed's, this stage's layers', the head's), the
        micro-batches `micro`, the step's `key` and the `loss_scale`, as the `shard_map`
        gives them."""
        stages, chunks = schedule.stages, schedule.virtual_stages
        self.model, self.shapes, self.micro, self.key = model, shapes, micro, key
        self.loss_scale = loss_scale
        self.stages, self.chunks = stages, chunks
        self.last = stages * chunks - 1  # the last virtual stage
        self.size = jax.tree.leaves(shapes.chunk)[0].shape[0]  # layers per chunk
        self.head_part = self.size * stages * chunks + 1  # the head's part in `part_keys`
        self.replicas = data_parallel_size(mesh)
        self.scale = 1.0 / (schedule.micro_batches * self.replicas)  # of each micro-batch loss
        self.by_replica = PartitionSpec(None, data_axes(mesh) or None)  # [slots, replicas, ...]
        # Without virtual stages nothing goes from the last stage round to the first.
        self.to_next = [
            (s, (s + 1) % stages) for s in range(stages) if chunks > 1 or s < stages - 1
        ]
        self.to_prev = [(s, (s - 1) % stages) for s in range(stages) if chunks > 1 or s > 0]

        embed_params, layers, head_params = params
        self.index = lax.axis_index(AXIS)
        self.replica_ids = jnp.arange(self.replicas)
        # Varying from the start: a gradient for a value invariant over pp would be summed
        # over pp inside the cond branches. `nil` is a zero typed as varying over pp.
        self.embed_params, self.head_params, self.nil = _varying(
            (embed_params, head_params, jnp.float32(0))
        )
        self.layers = jax.tree.map(lambda x: x.reshape(self.chunks, -1, *x.shape[1:]), layers)
        layer_keys = jnp.zeros((self.size, *key.shape), key.dtype)
        example = (self._chunk_params(0), _zeros(shapes.activations), layer_keys)
        self.chunk_vjp = _ChunkVjp(model.chunk, *example)

    def _chunk_params(self, chunk: jax.Array | int) -> Any:
        """The parameters of this stage's model chunk `chunk` (its layers stacked)."""
        if self.chunks > 1:
            return _take(self.layers, chunk)
        return jax.tree.map(lambda x: x[0], self.layers)

    def _buffer(self, shape: Any, slots: int) -> Any:
        """`slots` slots for every replica's value of `shape`."""
        return constrain(_zeros(shape, slots, self.replicas), self.by_replica)

    def start(self, table: Timetable) -> _Carry:
        """The carry before the first tick: buffers of the timetable's sizes, and zero sums."""
        activations, replicas = self.shapes.activations, self.replicas
        return _Carry(
            self._buffer(self.chunk_vjp.shapes, table.residual_slots),
            self._buffer(activations, table.activation_slots),
            self._buffer(activations, table.cotangent_slots),
            _zeros(self.layers, replicas),
            _zeros(self.embed_params, replicas),
            _zeros(self.head_params, replicas),
            _zeros(_F32, replicas),
            _zeros(self.shapes.aux, replicas),
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
        sums = (g_layers, g_embed, g_head, carry.loss + loss, metrics)
        return _Carry(carry.residuals, activations, cotangents, *sums), None

    def forward(self, carry: _Carry, row: jax.Array) -> tuple[_Carry, tuple]:
        """The forward half of a tick, if the row has one: micro-batch ``row[F_MICRO]`` through
        chunk ``row[F_CHUNK]``, after embed on the first virtual stage and before the head on
        the last. Keeps the residuals (and the head's cotangent); returns the carry and, per
        replica, the output to send, the loss, the metrics and the head's gradients."""
        chunk = row[F_CHUNK]
        is_first = chunk * self.stages + self.index == 0
        is_last = chunk * self.stages + self.index == self.last
        shapes = self.shapes

        def one(w: Any, x_in: Any, batch: Any, replica: jax.Array) -> tuple:
            # Parts: embed, head_loss, then this chunk's layers (in model order).
            first_layer = (chunk * self.stages + self.index) * self.size
            layers = 1 + first_layer + jnp.arange(self.size)
            parts = jnp.concatenate([jnp.array([0, self.head_part]), layers])
            keys = part_keys(self.key, replica, row[F_MICRO], parts)
            embed_key, head_key = keys[0], keys[1]
            embed = lambda: self.model.embed(self.embed_params, batch, embed_key)  # noqa: E731
            x = lax.cond(is_first, embed, lambda: x_in)
            y, residuals = self.chunk_vjp.forward(w, x, keys[2:])
            head = functools.partial(self._head, y, batch, head_key)
            made = (_F32, shapes.aux, self.head_params, shapes.activations)
            return residuals, y, *lax.cond(is_last, head, lambda: _zeros(made))

        def run(residuals: Any, x_in: Any, batch: Any) -> tuple:
            w = self._chunk_params(chunk)
            made, *out = jax.vmap(one, in_axes=(None, 0, 0, 0))(w, x_in, batch, self.replica_ids)
            return _put(residuals, row[F_RES], made), *out

        def idle(residuals: Any, x_in: Any, batch: Any) -> tuple:
            made = (shapes.activations, _F32, shapes.aux, self.head_params, shapes.activations)
            return residuals, *_zeros(made, self.replicas)

        batch = _take(self.micro, jnp.maximum(row[F_MICRO], 0))
        x_in = _take(carry.activations, row[F_ACT])
        residuals, y, loss, metrics, dh, dy = lax.cond(
            row[F_MICRO] >= 0, run, idle, carry.residuals, x_in, batch
        )
        cotangents = _put(carry.cotangents, row[F_DY], dy)
        return carry._replace(residuals=residuals, cotangents=cotangents), (y, loss, metrics, dh)

    def _head(self, y: Any, batch: Any, key: jax.Array) -> tuple:
        """The head's loss and metrics (each times 1 / (m replicas)), and the gradients of
        the loss (times the loss scale, if any) for the head's parameters and for `y`."""

        def loss_fn(h: Any, y: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
            loss, aux = self.model.head_loss(h, y, batch, key)
            # + a varying zero: a metric that is a constant must be typed as varying over pp
            # too, as the zeros of a stage without the head are.
            aux = jax.tree.map(lambda a: a.astype(jnp.float32) * self.scale + self.nil, aux)
            loss = loss.astype(jnp.float32) * self.scale
            scaled = loss if self.loss_scale is None else loss * self.loss_scale
            return scaled, (loss, aux)

        grad = jax.grad(loss_fn, (0, 1), has_aux=True)
        (dh, dy), (loss, aux) = grad(self.head_params, y)
        return loss, aux, dh, dy

    def backward(self, carry: _Carry, row: jax.Array) -> tuple:
        """The backward half of a tick, if the row has one: micro-batch ``row[B_MICRO]`` back
        through chunk ``row[B_CHUNK]`` from its kept residuals and cotangent, and back through
        embed on the first virtual stage. Returns, per replica, the gradients of the chunk's
        parameters, of its input (to send) and of embed's parameters."""
        chunk = row[B_CHUNK]
        shapes = self.shapes

        def one(
            w: Any, residuals: list[jax.Array], dy: Any, batch: Any, replica: jax.Array
        ) -> tuple:
            dw, dx = self.chunk_vjp.backward(w, residuals, dy)

            def embed_grad() -> Any:
                embed_key = part_keys(self.key, replica, row[B_MICRO], 0)
                embed = lambda e: self.model.embed(e, batch, embed_key)  # noqa: E731
                return jax.vjp(embed, self.embed_params)[1](dx)[0]

            is_first = chunk * self.stages + self.index == 0
            return dw, dx, lax.cond(is_first, embed_grad, lambda: _zeros(self.embed_params))

        def run(residuals: Any, dy: Any, batch: Any) -> tuple:
            w, kept = self._chunk_params(chunk), _take(residuals, row[B_RES])
            in_axes = (None, 0, 0, 0, 0)
            return jax.vmap(one, in_axes=in_axes)(w, kept, dy, batch, self.replica_ids)

        def idle(residuals: Any, dy: Any, batch: Any) -> tuple:
            return _zeros((shapes.chunk, shapes.activations, self.embed_params), self.replicas)

        batch = _take(self.micro, jnp.maximum(row[B_MICRO], 0))
        dy = _take(carry.cotangents, row[B_COT])
        return lax.cond(row[B_MICRO] >= 0, run, idle, carry.residuals, dy, batch)

    def results(self, carry: _Carry) -> tuple[Any, Any]:
        """The layers' gradients [replicas, layers, ...] and, per stage, [1, replicas, ...] of
        the loss, the metrics and the embed and head gradients."""
        g_layers = jax.tree.map(
            lambda g: g.reshape(self.replicas, -1, *g.shape[3:]), carry.g_layers
        )
        sums = (carry.loss, carry.metrics, carry.g_embed, carry.g_head)
        return g_layers, jax.tree.map(lambda x: x[None], sums)


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
