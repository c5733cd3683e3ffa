"""`pipeline`: Paddle's pipeline parallelism (`pipeline`, `pipeline_configs`) as one SPMD program.

The model is ``embed -> stage (once per layer) -> head_loss``. The layers' parameters are
stacked on a leading layer axis split over the mesh axis ``pp``: each of the P stages owns L / P
consecutive layers or, with V virtual stages (VPP), V chunks of L / (P V) layers taken
round-robin. Each data-parallel replica's rows are cut into ``accumulate_steps`` micro-batches of
``micro_batch_size`` rows; the loss is the mean of the micro-batch losses, as in Paddle.

One `jax.shard_map` over ``pp`` alone runs a `lax.scan` over the ticks of a schedule table (see
`pipeline_schedule`). In a tick every stage runs, each under its own `lax.cond`, the forward
and then the backward the table gives it; then activations `ppermute` to the next stage and
cotangents to the previous one. A forward keeps its `jax.vjp` residuals in a buffer slot until
its backward reads them. Under 1F1B the buffer is a ring of 2 P - 1 slots whatever m is
(Paddle's MPMD 1F1B holds P: here a hop between stages costs a whole tick), so activation memory
does not grow with the number of micro-batches; under FThenB it holds all m.

The other mesh axes (``dp``, ``sharding``, ``mp``) stay with the compiler. The model runs under
a `vmap` over the data-parallel replicas, so each replica accumulates its own gradients and the
reduction over the data axes happens once, after the pipeline.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from fleetjax.mesh import constrain, data_axes, data_parallel_size
from fleetjax.transforms._schedules import SCHEDULE_MODES, PipelineSchedule, pipeline_schedule

__all__ = [
    "SCHEDULE_MODES",
    "PipelineLayer",
    "PipelineParams",
    "PipelineSchedule",
    "part_keys",
    "pipeline",
    "pipeline_schedule",
    "to_model_order",
    "to_pipeline_order",
]

AXIS = "pp"


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
        keys = part_keys(key[0] if key else _NO_KEY, 0, 0, jnp.arange(num_layers + 2))

        def layer(h: Any, params_and_key: tuple[Any, jax.Array]) -> tuple[Any, None]:
            return self.stage(params_and_key[0], h, *rng(params_and_key[1])), None

        x = self.embed(params.embed, batch, *rng(keys[0]))
        x = lax.scan(layer, x, (params.layers, keys[1:-1]))[0]
        return self.head_loss(params.head, x, batch, *rng(keys[-1]))


_NO_KEY = np.zeros(2, np.uint32)  # stands in for the key of a model that takes none


def part_keys(key: jax.Array, replica: Any, micro_batch: Any, part: Any) -> jax.Array:
    """The PRNG keys (raw key data) that a pipelined model's parts get with ``has_rng``.

    ``fold_in(fold_in(fold_in(key, replica), micro_batch), part)``: `key` is the step's key,
    `replica` the data-parallel replica, `micro_batch` the replica's micro-batch, and `part` 0
    for ``embed``, ``1 + l`` for layer ``l`` (in model order) and ``L + 1`` for ``head_loss``.
    The arguments broadcast: an array of parts gives an array of keys.
    """
    fold = jnp.vectorize(jax.random.fold_in, signature="(k),()->(k)")
    return fold(fold(fold(_raw(key), replica), micro_batch), part)


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
    chunk = _chunk_size(num_layers, pp_degree, vpp_degree)
    # Position (stage s, chunk v, layer j) holds model layer ((v P + s) chunk + j).
    index = np.arange(num_layers).reshape(vpp_degree, pp_degree, chunk)
    return index.transpose(1, 0, 2).reshape(-1)


def _chunk_size(num_layers: int, pp_degree: int, vpp_degree: int) -> int:
    if num_layers % (pp_degree * vpp_degree):
        raise ValueError(
            f"the layers' leading axis has {num_layers} layers, which do not split into "
            f"pp_degree x vpp_degree = {pp_degree} x {vpp_degree} equal chunks"
        )
    return num_layers // (pp_degree * vpp_degree)


def pipeline(
    embed: Callable[[Any, Any], Any],
    stage: Callable[[Any, Any], Any],
    head_loss: Callable[[Any, Any, Any], jax.Array],
    *,
    mesh: Mesh,
    micro_batch_size: int,
    accumulate_steps: int,
    schedule_mode: str = "1F1B",
    vpp_degree: int = 1,
    has_aux: bool = False,
    has_rng: bool = False,
) -> Callable[..., tuple[Any, PipelineParams]]:
    """The loss and gradients of a layered model, pipelined over the mesh axis ``pp``.

    Paddle's `pipeline` with `pipeline_configs` (`micro_batch_size`, `accumulate_steps`,
    `schedule_mode`) and `Strategy.pipeline.vpp_degree`.

    Args:
      embed: ``embed(params.embed, micro_batch) -> activations`` (an array or a pytree), run by
        the first stage; it runs again in that stage's backward (its residuals are not kept).
      stage: ``stage(layer_params, activations) -> activations`` for one layer, with the same
        shapes and dtypes out as in; wrap it in `jax.checkpoint` to recompute inside stages.
      head_loss: ``head_loss(params.head, activations, micro_batch) -> scalar`` (or, with
        `has_aux`, ``-> (scalar, aux)``), run by the last stage.
      mesh: a mesh with a ``pp`` axis; the others (``dp``, ``sharding``, ``mp``) are left to
        the compiler, and the batch is split over ``dp`` x ``sharding``.
      micro_batch_size: rows in a micro-batch of one data-parallel replica.
      accumulate_steps: micro-batches per step, m.
      schedule_mode: "1F1B" (default), "FThenB" (or "F-then-B"), or "VPP".
      vpp_degree: model chunks per stage for "VPP" (at least 2; then m >= pp_degree).
      has_aux: whether `head_loss` also returns a pytree of metrics (accuracy, ...): they come
        back in float32, averaged over the micro-batches and replicas as the loss is.
      has_rng: whether `embed`, `stage` and `head_loss` take a PRNG key (raw key data) as
        their last argument, for dropout and the like: each part of each micro-batch of each
        replica gets its own, derived from the step's key by `part_keys`.

    Returns:
      ``value_and_grad(params, batch[, key]) -> (loss, grads)`` for a `PipelineParams` and a
      batch (and, with `has_rng`, the step's PRNG key)
      whose leaves have ``micro_batch_size * accumulate_steps`` rows per data-parallel replica:
      the loss is the mean of the micro-batch losses (over all replicas), and the gradients are
      exactly its gradients, in a `PipelineParams` with the layers' split over ``pp``. With
      `has_aux`, ``((loss, aux), grads)``.

    Raises:
      ValueError: for a mesh without ``pp``, an unknown schedule, or counts Paddle does not
        allow; when called, for a batch of the wrong size, layers that do not split into
        pp_degree x vpp_degree chunks, or a `stage` that changes the activations' shape.
    """
    if AXIS not in mesh.axis_names:
        raise ValueError(f"mesh must have a 'pp' axis for the pipeline, got axes {mesh.axis_names}")
    size = micro_batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"micro_batch_size must be a positive int, got {size!r}")
    schedule = pipeline_schedule(schedule_mode, mesh.shape[AXIS], accumulate_steps, vpp_degree)
    plan = _plan(schedule)
    # One program for every model: it gives each part a key, which a model without
    # has_rng never sees, and takes metrics, which one without has_aux does not make.
    if not has_rng:
        embed = lambda p, b, k, f=embed: f(p, b)  # noqa: E731
        stage = lambda p, h, k, f=stage: f(p, h)  # noqa: E731
        head_loss = lambda p, x, b, k, f=head_loss: f(p, x, b)  # noqa: E731
    if not has_aux:
        head_loss = lambda p, x, b, k, f=head_loss: (f(p, x, b, k), {})  # noqa: E731
    model = _Model(embed, stage, head_loss)
    replicas = data_parallel_size(mesh)
    by_replica = NamedSharding(mesh, PartitionSpec(None, data_axes(mesh) or None))
    specs = dict(
        in_specs=(
            PartitionSpec(),
            PartitionSpec(AXIS),
            PartitionSpec(),
            PartitionSpec(),
            PartitionSpec(),
        ),
        out_specs=(PartitionSpec(None, AXIS), PartitionSpec(AXIS)),
    )

    def split(batch: Any) -> Any:
        """[replicas * m * b, ...] -> [m, replicas, b, ...]. As in Paddle, micro-batch i of a
        replica is rows [i b, (i + 1) b) of that replica's rows."""
        sizes = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(batch)}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"every batch leaf needs the same leading (batch) size, got {sizes}")
        (size,) = sizes
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

        return constrain(jax.tree.map(cut, batch), by_replica)

    def value_and_grad(
        params: PipelineParams, batch: Any, *key: jax.Array
    ) -> tuple[Any, PipelineParams]:
        if not isinstance(params, PipelineParams):
            raise TypeError(
                "params must be a fleetjax PipelineParams(embed, layers, head), "
                f"got {type(params).__name__}"
            )
        if len(key) != has_rng:
            raise TypeError(
                f"the pipeline was made with has_rng={has_rng}: call it as "
                f"value_and_grad(params, batch{', key' if has_rng else ''})"
            )
        key = jnp.asarray(_NO_KEY) if not key else _raw(key[0])
        explicit = tuple(
            a
            for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
            if t == AxisType.Explicit
        )
        if not explicit:
            return pipelined(params, batch, key)
        # On Explicit axes the pipeline runs on Auto ones (as jnp runs a sharded gather), its
        # buffers and branches then typed alike; the gradients come back placed as the params.
        out = (PartitionSpec(), jax.tree.map(lambda x: jax.typeof(x).sharding.spec, params))
        run = jax.sharding.auto_axes(pipelined, axes=explicit, out_sharding=out)
        if jax.sharding.get_abstract_mesh().empty:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return run(params, batch, key)
        return run(params, batch, key)

    def pipelined(params: PipelineParams, batch: Any, key: jax.Array) -> tuple[Any, PipelineParams]:
        micro = split(batch)
        shapes = _shapes(model, schedule, params, micro)
        run = _program(model, schedule, plan, mesh, shapes)
        context = jax.sharding.get_abstract_mesh()  # under auto_axes: this mesh, Auto typed
        on = mesh if context.empty else context
        sharded = jax.shard_map(run, mesh=on, axis_names={AXIS}, **specs)
        g_layers, by_stage = sharded(params.embed, params.layers, params.head, micro, key)
        # Sum over the data-parallel replicas (each scaled by 1 / replicas already) and, for
        # the loss and the embed and head gradients, over the stages that made them.
        g_layers = jax.tree.map(lambda g: g.sum(0), g_layers)
        loss, aux, g_embed, g_head = jax.tree.map(lambda x: x.sum((0, 1)), by_stage)
        return ((loss, aux) if has_aux else loss), PipelineParams(g_embed, g_layers, g_head)

    return value_and_grad


class _Model(NamedTuple):
    """The user's model functions, each taking a key last; `head_loss` returns ``(loss, aux)``."""

    embed: Callable[[Any, Any, jax.Array], Any]
    stage: Callable[[Any, Any, jax.Array], Any]
    head_loss: Callable[[Any, Any, Any, jax.Array], tuple[jax.Array, Any]]

    def chunk(self, chunk_params: Any, x: Any, keys: jax.Array) -> Any:
        """A chunk's consecutive layers (parameters and keys stacked on the leading axis)."""
        layers = (chunk_params, keys)
        return lax.scan(lambda h, layer: (self.stage(layer[0], h, layer[1]), None), x, layers)[0]


# Columns of the execution table [ticks, stages, COLUMNS]. The forward: its micro-batch (-1:
# none), chunk, input's activation slot, residual slot, and head-cotangent slot (last virtual
# stage); the backward: micro-batch, chunk, residual slot, cotangent slot; then the slots that
# receive this tick's activation and cotangent.
F_MICRO, F_CHUNK, F_ACT, F_RES, F_DY = range(5)
B_MICRO, B_CHUNK, B_RES, B_COT = range(5, 9)
RECV_ACT, RECV_COT = range(9, 11)
COLUMNS = 11


class _Slots:
    """Buffer slots of one stage, the lowest free one taken first."""

    def __init__(self) -> None:
        self.size = 0
        self._free: list[int] = []

    def take(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self.size += 1
        return self.size - 1

    def give(self, slot: int) -> None:
        heapq.heappush(self._free, slot)


class _Plan(NamedTuple):
    """A schedule made executable: the table [ticks, stages, COLUMNS] and the buffers' slots."""

    table: np.ndarray
    residual_slots: int  # vjp residuals of forwards whose backward has not run
    activation_slots: int  # activations received and not yet consumed, and a trash slot
    cotangent_slots: int  # cotangents received (or made by the head) not yet consumed, + trash


def _plan(schedule: PipelineSchedule) -> _Plan:
    """Assign buffer slots to every value the schedule keeps across ticks.

    Within a tick a stage reads its forward input, writes residuals (and, at the last virtual
    stage, the head's cotangent), then reads the backward's cotangent and residuals, and at the
    end of the tick receives; a slot is reused as soon as that order allows. Residuals are
    written only by a forward that runs, so idle rows point at slot 0; activations and
    cotangents are written every tick, so their buffers get a trash slot, the last, for idle
    rows.
    """
    stages, last = schedule.stages, schedule.stages * schedule.virtual_stages - 1
    residuals = [_Slots() for _ in range(stages)]
    activations = [_Slots() for _ in range(stages)]
    cotangents = [_Slots() for _ in range(stages)]
    held: dict[tuple[str, int, int, int], int] = {}  # (kind, stage, virtual stage, micro) -> slot
    trash = -1
    table = np.full((schedule.ticks, stages, COLUMNS), trash, np.int32)
    for t in range(schedule.ticks):
        row = table[t]
        row[:, F_MICRO], row[:, F_CHUNK] = schedule.forward[t], schedule.forward_chunk[t]
        row[:, B_MICRO], row[:, B_CHUNK] = schedule.backward[t], schedule.backward_chunk[t]
        for s in range(stages):
            i, k = row[s, F_MICRO], row[s, F_CHUNK] * stages + s
            if i < 0:
                continue
            if k > 0:
                row[s, F_ACT] = held.pop(("act", s, k, i))
                activations[s].give(row[s, F_ACT])
            row[s, F_RES] = held["res", s, k, i] = residuals[s].take()
            if k == last:
                row[s, F_DY] = held["cot", s, k, i] = cotangents[s].take()
        for s in range(stages):
            i, k = row[s, B_MICRO], row[s, B_CHUNK] * stages + s
            if i < 0:
                continue
            row[s, B_COT] = held.pop(("cot", s, k, i))
            cotangents[s].give(row[s, B_COT])
            row[s, B_RES] = held.pop(("res", s, k, i))
            residuals[s].give(row[s, B_RES])
        for s in range(stages):
            i, k = row[s, F_MICRO], row[s, F_CHUNK] * stages + s
            if i >= 0 and k < last:
                to = (s + 1) % stages
                row[to, RECV_ACT] = held["act", to, k + 1, i] = activations[to].take()
            i, k = row[s, B_MICRO], row[s, B_CHUNK] * stages + s
            if i >= 0 and k > 0:
                to = (s - 1) % stages
                row[to, RECV_COT] = held["cot", to, k - 1, i] = cotangents[to].take()
    sizes = [max(b.size for b in buffers) for buffers in (residuals, activations, cotangents)]
    # A ring of the rule's bound: the same memory whatever the number of micro-batches.
    sizes[0] = max(sizes[0], schedule.in_flight_bound or 0)
    unused = (0, sizes[1], sizes[2])
    for columns, slot in zip(
        ((F_RES, B_RES), (F_ACT, RECV_ACT), (F_DY, B_COT, RECV_COT)), unused, strict=True
    ):
        for c in columns:
            table[..., c] = np.where(table[..., c] == trash, slot, table[..., c])
    return _Plan(table, sizes[0], sizes[1] + 1, sizes[2] + 1)


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
    model: _Model, schedule: PipelineSchedule, params: PipelineParams, micro: Any
) -> _Shapes:
    """The activations' and a chunk's shapes; checks that the layers split into chunks and that
    `stage` keeps the activations' shapes."""
    lengths = {x.shape[0] for x in jax.tree.leaves(params.layers)}
    if len(lengths) != 1:
        raise ValueError(f"every layers leaf needs the same leading (layer) axis, got {lengths}")
    size = _chunk_size(lengths.pop(), schedule.stages, schedule.virtual_stages)
    chunk = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((size, *a.shape[1:]), a.dtype), params.layers
    )
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), micro)
    key = jax.ShapeDtypeStruct(_NO_KEY.shape, _NO_KEY.dtype)
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


def _program(
    model: _Model, schedule: PipelineSchedule, plan: _Plan, mesh: Mesh, shapes: _Shapes
) -> Callable[..., tuple[Any, Any]]:
    """The per-stage program (the body of `shard_map`): the plan's table, tick by tick.

    The model runs under a `vmap` over the data-parallel replicas (the micro-batches are [m,
    replicas, micro_batch_size, ...]), so that each replica accumulates its own gradients and
    they are reduced over the data axes once, after the pipeline. Returns the layers' gradients
    [replicas, layers, ...] and, per stage, [1, replicas, ...] of the loss, the metrics and the
    embed and head gradients.
    """
    stages, chunks = schedule.stages, schedule.virtual_stages
    last = stages * chunks - 1
    replicas = data_parallel_size(mesh)
    scale = 1.0 / (schedule.micro_batches * replicas)
    by_replica = PartitionSpec(None, data_axes(mesh) or None)  # [slots, replicas, ...]
    to_next = [(s, (s + 1) % stages) for s in range(stages) if chunks > 1 or s + 1 < stages]
    to_prev = [(s, (s - 1) % stages) for s in range(stages) if chunks > 1 or s > 0]
    activations = shapes.activations
    f32 = jax.ShapeDtypeStruct((), jnp.float32)

    def zeros(shape: Any, *lead: int) -> Any:
        """Zeros of `shape` (a pytree of shapes), with leading dimensions `lead`."""
        return _varying(jax.tree.map(lambda a: jnp.zeros((*lead, *a.shape), a.dtype), shape))

    def buffer(shape: Any, slots: int) -> Any:
        """`slots` slots for every replica's value of `shape`."""
        return constrain(zeros(shape, slots, replicas), by_replica)

    def put(buffers: Any, slot: jax.Array, values: Any) -> Any:
        return jax.tree.map(lambda b, v: b.at[slot].set(v), buffers, values)

    size = jax.tree.leaves(shapes.chunk)[0].shape[0]  # layers per chunk
    head_part = size * stages * chunks + 1

    def run(
        embed_params: Any, layers: Any, head_params: Any, micro: Any, key: jax.Array
    ) -> tuple[Any, Any]:
        s = lax.axis_index(AXIS)
        replica_ids = jnp.arange(replicas)
        # Varying from the start: a gradient for a value invariant over pp would be summed
        # over pp inside the cond branches.
        embed_params, head_params, nil = _varying((embed_params, head_params, jnp.float32(0)))
        layers = jax.tree.map(lambda x: x.reshape(chunks, -1, *x.shape[1:]), layers)

        def chunk_params(chunk: jax.Array | int) -> Any:
            return _take(layers, chunk) if chunks > 1 else jax.tree.map(lambda x: x[0], layers)

        layer_keys = jnp.zeros((size, *key.shape), key.dtype)
        chunk_vjp = _ChunkVjp(model.chunk, chunk_params(0), zeros(activations), layer_keys)

        def tick(carry: tuple, rows: jax.Array) -> tuple[tuple, None]:
            res, acts, cots, g_layers, g_embed, g_head, loss, metrics = carry
            row = rows[s]
            f_chunk, b_chunk = row[F_CHUNK], row[B_CHUNK]
            is_first = f_chunk * stages + s == 0
            is_last = f_chunk * stages + s == last

            def forward_one(w: Any, x_in: Any, batch: Any, replica: jax.Array) -> tuple:
                # Parts: embed, head_loss, then this chunk's layers (in model order).
                first_layer = (f_chunk * stages + s) * size
                layers = 1 + first_layer + jnp.arange(size)
                parts = jnp.concatenate([jnp.array([0, head_part]), layers])
                keys = part_keys(key, replica, row[F_MICRO], parts)
                embed_key, head_key = keys[0], keys[1]
                x = lax.cond(
                    is_first, lambda: model.embed(embed_params, batch, embed_key), lambda: x_in
                )
                y, residuals = chunk_vjp.forward(w, x, keys[2:])

                def head() -> tuple:
                    def loss_fn(h: Any, y: Any) -> tuple[jax.Array, Any]:
                        loss, aux = model.head_loss(h, y, batch, head_key)
                        # + a varying zero: a metric that is a constant must be typed as
                        # varying over pp too, as no_head's zeros are.
                        aux = jax.tree.map(lambda a: a.astype(jnp.float32) * scale + nil, aux)
                        return loss.astype(jnp.float32) * scale, aux

                    (value, aux), (dh, dy) = jax.value_and_grad(loss_fn, (0, 1), has_aux=True)(
                        head_params, y
                    )
                    return value, aux, dh, dy

                def no_head() -> tuple:
                    return zeros((f32, shapes.aux, head_params, activations))

                return (residuals, y, *lax.cond(is_last, head, no_head))

            def forward(res: Any, x_in: Any, batch: Any) -> tuple:
                w = chunk_params(f_chunk)
                residuals, *out = jax.vmap(forward_one, in_axes=(None, 0, 0, 0))(
                    w, x_in, batch, replica_ids
                )
                return put(res, row[F_RES], residuals), *out

            def no_forward(res: Any, x_in: Any, batch: Any) -> tuple:
                made = (activations, f32, shapes.aux, head_params, activations)
                return res, *zeros(made, replicas)

            f_batch = _take(micro, jnp.maximum(row[F_MICRO], 0))
            res, y, value, aux, dh, dy = lax.cond(
                row[F_MICRO] >= 0, forward, no_forward, res, _take(acts, row[F_ACT]), f_batch
            )
            cots = put(cots, row[F_DY], dy)

            def backward_one(
                w: Any, residuals: list[jax.Array], dy: Any, batch: Any, replica: jax.Array
            ) -> tuple:
                dw, dx = chunk_vjp.backward(w, residuals, dy)

                def embed_grad() -> Any:
                    embed_key = part_keys(key, replica, row[B_MICRO], 0)
                    embed = lambda e: model.embed(e, batch, embed_key)  # noqa: E731
                    return jax.vjp(embed, embed_params)[1](dx)[0]

                is_first = b_chunk * stages + s == 0
                return dw, dx, lax.cond(is_first, embed_grad, lambda: zeros(embed_params))

            def backward(res: Any, dy: Any, batch: Any) -> tuple:
                w = chunk_params(b_chunk)
                residuals = _take(res, row[B_RES])
                return jax.vmap(backward_one, in_axes=(None, 0, 0, 0, 0))(
                    w, residuals, dy, batch, replica_ids
                )

            def no_backward(res: Any, dy: Any, batch: Any) -> tuple:
                return zeros((shapes.chunk, activations, embed_params), replicas)

            b_batch = _take(micro, jnp.maximum(row[B_MICRO], 0))
            dw, dx, de = lax.cond(
                row[B_MICRO] >= 0, backward, no_backward, res, _take(cots, row[B_COT]), b_batch
            )
            g_layers = jax.tree.map(lambda g, d: g.at[:, b_chunk].add(d), g_layers, dw)
            g_embed = jax.tree.map(jnp.add, g_embed, de)
            g_head = jax.tree.map(jnp.add, g_head, dh)
            if to_next:
                acts = put(acts, row[RECV_ACT], lax.ppermute(y, AXIS, to_next))
                cots = put(cots, row[RECV_COT], lax.ppermute(dx, AXIS, to_prev))
            metrics = jax.tree.map(jnp.add, metrics, aux)
            carry = (res, acts, cots, g_layers, g_embed, g_head, loss + value, metrics)
            return carry, None

        carry = (
            buffer(chunk_vjp.shapes, plan.residual_slots),
            buffer(activations, plan.activation_slots),
            buffer(activations, plan.cotangent_slots),
            zeros(layers, replicas),
            zeros(embed_params, replicas),
            zeros(head_params, replicas),
            zeros(f32, replicas),
            zeros(shapes.aux, replicas),
        )
        carry, _ = lax.scan(tick, carry, jnp.asarray(plan.table))
        _, _, _, g_layers, g_embed, g_head, loss, metrics = carry
        g_layers = jax.tree.map(lambda g: g.reshape(replicas, -1, *g.shape[3:]), g_layers)
        return g_layers, jax.tree.map(lambda x: x[None], (loss, metrics, g_embed, g_head))

    return run


def _raw(key: jax.Array) -> jax.Array:
    """A PRNG key as raw key data (uint32), which `shard_map` and `fold_in` take alike."""
    return (
        jax.random.key_data(key) if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    )


def _varying(tree: Any) -> Any:
    """`tree` (values invariant over pp) typed as varying over pp, as values that differ
    between stages (loop carries, cond branches) must be inside `shard_map`."""
    return jax.tree.map(lambda x: lax.pcast(x, (AXIS,), to="varying"), tree)


def _take(tree: Any, index: jax.Array) -> Any:
    """Entry `index` of every leaf's leading axis."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, index, keepdims=False), tree)
