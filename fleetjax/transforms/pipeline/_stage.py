"""One pipeline stage's program, the body of the pipeline's `shard_map`: its buffers and sums
from tick to tick (`Carry`), and `Stage`: `start`, a `tick` per row of the timetable (the
forward half, the backward half, under a zero-bubble schedule a weight-gradient part, the
sends), then `results` (the reduced gradients, the new model states, the loss and metrics)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from fleetjax.mesh import constrain
from fleetjax.transforms.grad_allreduce import Reducer
from fleetjax.transforms.pipeline._casts import cast
from fleetjax.transforms.pipeline._chunk import Chunk
from fleetjax.transforms.pipeline._layout import AXIS, Layout, is_spec, is_split
from fleetjax.transforms.pipeline._model import ModelFunctions, PipelineParams, part_keys
from fleetjax.transforms.pipeline._shapes import F32, Shapes, cast_shapes
from fleetjax.transforms.pipeline._timetable import (
    B_CARRY,
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
    W_CARRY,
    W_CHUNK,
    W_MICRO,
    W_RES,
    Segment,
    Timetable,
)
from fleetjax.transforms.pipeline._values import (
    added,
    chunk_states,
    kept_specs,
    laid_out,
    merged,
    psum,
    put,
    put_where,
    reduced,
    take,
    whole_where_split,
    zeros,
)
from fleetjax.transforms.pipeline.schedules import PipelineSchedule


class Carry(NamedTuple):
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
    # Split backward: [carry slots, layers per chunk, ...] what each B made for its W and kept
    # in no residual slot (`Chunk.carry_homes`); else ().
    carries: Any = ()


class Stage:
    """One stage's program, the body of the `shard_map` over ``pp`` and the data axes:
    `start`, then `tick` for each row of the timetable, then `results`.

    Each device runs its own replica's micro-batches ([m, micro_batch_size, ...]) and keeps its
    own gradients until `results` reduces them.
    """

    def __init__(
        self,
        model: ModelFunctions,
        schedule: PipelineSchedule,
        layout: Layout,
        shapes: Shapes,
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
                cast_shapes(s, c)
                for s, c in zip((shapes.embed, shapes.chunk, shapes.head), casts, strict=True)
            )
        )
        first_layer = jax.tree.map(lambda x: x[0], self._chunk(0))
        self.chunk = Chunk(model.stage, *first_layer, zeros(shapes.activations), key)
        self.split = schedule.split_backward
        self.residual_specs = kept_specs(layout, shapes.activations, self.chunk.shapes)
        if self.split:
            self.homes = self.chunk.carry_homes()
            self.carried = [
                c
                for c, home in zip(self.chunk.split().carry_shapes, self.homes, strict=True)
                if home is None
            ]
            self.carry_specs = kept_specs(layout, shapes.activations, self.carried)

    def _whole(self, part: str, tree: Any) -> Any:
        """`tree`, parameters of `part` ("embed", "layers" or "head") as this device holds
        them, gathered over the data axes where ZeRO-3 splits them."""

        def one(x: jax.Array, split: tuple) -> jax.Array:
            for dim, axes in split:
                x = lax.all_gather(x, axes, axis=dim, tiled=True)
            return x

        return jax.tree.map(one, tree, getattr(self.layout.gathers, part), is_leaf=is_split)

    def _chunk(self, chunk: jax.Array | int) -> tuple[Any, Any]:
        """The parameters (whole) and model state of this stage's model chunk `chunk` (its
        layers stacked)."""
        if self.chunks > 1:
            w, s = take(self.layers, chunk)
        else:
            w, s = jax.tree.map(lambda x: x[0], self.layers)
        return self._whole("layers", w), s

    def start(self, table: Timetable) -> Carry:
        """The carry before the first tick: buffers of the timetable's sizes, and zero sums."""
        activations, shapes, compiler = self.shapes.activations, self.shapes, self.layout.compiler
        states = (self.embed_state, self.layers[1], self.head_state)
        # The gradients split over mp as their parameters are (else XLA may keep them whole and
        # gather every tick's gradients to add them).
        by_chunk = lambda s: PartitionSpec(None, *s)  # noqa: E731
        chunk_specs = jax.tree.map(by_chunk, compiler.layers, is_leaf=is_spec)
        residuals = zeros(self.chunk.shapes, table.residual_slots, self.size)
        carries = ()
        if self.split:
            carried = zeros(self.carried, table.carry_slots, self.size)
            carries = laid_out(carried, self.carry_specs)
        return Carry(
            laid_out(residuals, self.residual_specs),
            zeros(activations, table.activation_slots),
            zeros(activations, table.cotangent_slots),
            constrain(zeros(shapes.chunk, self.chunks), chunk_specs),
            constrain(zeros(shapes.embed), compiler.embed),
            constrain(zeros(shapes.head), compiler.head),
            jnp.zeros((), jnp.float32),
            zeros(shapes.aux),
            PipelineParams(*zeros(states)),
            carries,
        )

    def tick(self, segment: Segment, carry: Carry, rows: jax.Array) -> tuple[Carry, None]:
        """One tick of `segment`: this stage's row of `rows` [stages, COLUMNS], its forward,
        then its backward, then the sends: activations to the next stage, cotangents to the
        previous (each only in segments that have them)."""
        row = rows[self.index]
        if segment.forward:
            carry, (y, loss, metrics, dh) = self.forward(carry, row)
            carry = carry._replace(
                g_head=added(carry.g_head, dh),
                loss=carry.loss + loss,
                metrics=jax.tree.map(jnp.add, carry.metrics, metrics),
            )
        if segment.backward:
            carry, dx = self.backward(carry, row)
        if segment.weight:
            carry = self.weight(carry, row)
        if segment.send_forward and self.to_next:
            sent = lax.ppermute(y, AXIS, self.to_next)
            carry = carry._replace(activations=put(carry.activations, row[RECV_ACT], sent))
        if segment.send_backward and self.to_prev:
            sent = lax.ppermute(dx, AXIS, self.to_prev)
            carry = carry._replace(cotangents=put(carry.cotangents, row[RECV_COT], sent))
        return carry, None

    def forward(self, carry: Carry, row: jax.Array) -> tuple[Carry, tuple]:
        """The forward half of a tick, if the row has one: micro-batch ``row[F_MICRO]`` through
        chunk ``row[F_CHUNK]``, after embed on the first virtual stage and before the head on
        the last. Keeps the residuals (and the head's cotangent) and the new model states;
        returns the carry and the output to send, the loss, the metrics and the head's
        gradients."""
        chunk = row[F_CHUNK]
        virtual = chunk * self.stages + self.index
        is_first, is_last = virtual == 0, virtual == self.last
        shapes = self.shapes
        heads = (F32, shapes.aux, self.ran.head, shapes.activations, self.head_state)

        def run(x_in: Any, batch: Any) -> tuple:
            w, s = self._chunk(chunk)
            # Parts: embed, head_loss, then this chunk's layers (in model order).
            layers = 1 + virtual * self.size + jnp.arange(self.size)
            parts = jnp.concatenate([jnp.array([0, self.head_part]), layers])
            keys = part_keys(self.key, self.replica, row[F_MICRO], parts)
            embed_params = functools.partial(self._whole, "embed", self.embed_params)
            embed = lambda: self.model.embed(embed_params(), self.embed_state, batch, keys[0])  # noqa: E731
            x, embed_state = lax.cond(is_first, embed, lambda: (x_in, zeros(self.embed_state)))
            (y, layers_state), made = self.chunk.forward(w, s, x, keys[2:])
            head = functools.partial(self._head, y, batch, keys[1])
            *out, head_state = lax.cond(is_last, head, lambda: zeros(heads))
            states = PipelineParams(embed_state, layers_state, head_state)
            return made, y, states, *out

        def idle(x_in: Any, batch: Any) -> tuple:
            states = PipelineParams(self.embed_state, self._chunk(0)[1], self.head_state)
            made = zeros(self.chunk.shapes, self.size)
            return made, *zeros((shapes.activations, states, *heads[:-1]))

        running = row[F_MICRO] >= 0
        batch = take(self.micro, jnp.maximum(row[F_MICRO], 0))
        x_in = take(carry.activations, row[F_ACT])
        made, y, states, loss, metrics, dh, dy = lax.cond(running, run, idle, x_in, batch)
        # Written outside the cond: a buffer that a cond's branch updates is copied whole.
        made = whole_where_split(made, self.residual_specs)
        residuals = put_where(carry.residuals, row[F_RES], running, made)
        cotangents = put(carry.cotangents, row[F_DY], dy)
        last = row[F_MICRO] == self.micro_batches - 1
        states = chunk_states(carry.states, states, chunk, (last & is_first, last, last & is_last))
        carry = carry._replace(residuals=residuals, cotangents=cotangents, states=states)
        return carry, (y, loss, metrics, dh)

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

    def backward(self, carry: Carry, row: jax.Array) -> tuple[Carry, Any]:
        """The backward half of a tick, if the row has one: micro-batch ``row[B_MICRO]`` back
        through chunk ``row[B_CHUNK]`` from its kept residuals and cotangent, and back through
        embed on the first virtual stage. Returns the carry, with the layers' gradients added
        (split: with what its W needs kept), and the gradient of the chunk's input (to send)."""
        chunk, running = row[B_CHUNK], row[B_MICRO] >= 0
        w, s = self._chunk(chunk)
        kept = whole_where_split(take(carry.residuals, row[B_RES]), self.residual_specs)
        dy = take(carry.cotangents, row[B_COT])
        if self.split:
            dx, made = self.chunk.backward_input(w, s, kept, dy, running)
            carry = self._keep_carry(carry, row, running, made, kept)
        else:
            g_layers, dx = self.chunk.backward(w, s, kept, dy, carry.g_layers, chunk, running)
            carry = carry._replace(g_layers=g_layers)
        g_embed = added(carry.g_embed, self._embed_grad(row, dx))
        return carry._replace(g_embed=g_embed), dx

    def _embed_grad(self, row: jax.Array, dx: Any) -> Any:
        """The gradient of embed's parameters, from `dx` on the first virtual stage (else
        zeros)."""
        running = row[B_MICRO] >= 0
        is_first = row[B_CHUNK] * self.stages + self.index == 0

        def embed_grad(dx: Any, batch: Any) -> Any:
            key = part_keys(self.key, self.replica, row[B_MICRO], 0)

            def embed(params: Any) -> Any:  # the activations (the new state is kept)
                return self.model.embed(params, self.embed_state, batch, key)[0]

            return jax.vjp(embed, self._whole("embed", self.embed_params))[1](dx)[0]

        batch = take(self.micro, jnp.maximum(row[B_MICRO], 0))
        no_grad = lambda *_: zeros(self.ran.embed)  # noqa: E731
        return lax.cond(is_first & running, embed_grad, no_grad, dx, batch)

    def _keep_carry(
        self,
        carry: Carry,
        row: jax.Array,
        running: jax.Array,
        made: list[jax.Array],
        kept: list[jax.Array],
    ) -> Carry:
        """`carry` with what B `made` for its W kept: each value in B's residual slot, in a
        residual that W does not read and it fits (`Chunk.carry_homes`; where B did not run,
        the slot keeps what B read of it, `kept`), the others in the carry buffer."""
        residuals = list(carry.residuals)
        for value, home in zip(made, self.homes, strict=True):
            if home is not None:
                value = whole_where_split([value], [self.residual_specs[home]])[0]
                chosen = jnp.where(running, value, kept[home])
                residuals[home] = put(residuals[home], row[B_RES], chosen)
        rest = [m for m, home in zip(made, self.homes, strict=True) if home is None]
        rest = whole_where_split(rest, self.carry_specs)
        carries = put_where(carry.carries, row[B_CARRY], running, rest)
        return carry._replace(residuals=residuals, carries=carries)

    def weight(self, carry: Carry, row: jax.Array) -> Carry:
        """The weight-gradient part of a tick under a split backward, if the row has one:
        chunk ``row[W_CHUNK]``'s parameter gradients for micro-batch ``row[W_MICRO]``, from
        its kept residuals and what its B made, added to the layers' gradients."""
        chunk, running = row[W_CHUNK], row[W_MICRO] >= 0
        w, s = self._chunk(chunk)
        kept = whole_where_split(take(carry.residuals, row[W_RES]), self.residual_specs)
        rest = iter(whole_where_split(take(carry.carries, row[W_CARRY]), self.carry_specs))
        made = [next(rest) if home is None else kept[home] for home in self.homes]
        grads = self.chunk.backward_weight(w, s, kept, made, carry.g_layers, chunk, running)
        return carry._replace(g_layers=grads)

    def results(self, carry: Carry, reducer: Reducer) -> tuple[Any, Any, Any]:
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
            grads = reduced(grads, reducer, self.layout)
        grads = grads._replace(embed=psum(grads.embed, AXIS), head=psum(grads.head, AXIS))
        states = carry.states
        states = PipelineParams(
            psum(merged(states.embed, self.micro_batches, data), AXIS),
            jax.tree.map(by_layer, merged(states.layers, self.micro_batches, data)),
            psum(merged(states.head, self.micro_batches, data), AXIS),
        )
        return (psum(carry.loss, every), psum(carry.metrics, every)), states, grads
