"""Paddle's semi-automatic API around the tensors: `shard_layer`, `shard_optimizer` with
`ShardingStage1/2/3`, `shard_scaler`, `shard_dataloader`.

Each records what the user asks for; the auto-parallel dygraph loop (`_loop.SemiAutoLoop`)
reads it into the train step's inputs: the parameters' placements into their specs, the
`ShardingStage` into ZeRO over its mesh dimension, `gradient_accumulation_steps` into gradient
merge, the loader's `shard_dims` into the data-parallel dimension.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from fleetjax import amp
from fleetjax.auto_parallel import (
    Placement,
    ProcessMesh,
    Replicate,
    Shard,
    get_mesh,
    partition_spec,
    placements_of,
    process_mesh_of,
    shard_tensor,
)
from fleetjax.distributed._hooks import add_hooks
from fleetjax.distributed._loop import Request, SemiAutoLoop, loop_of
from fleetjax.fleet import DygraphLoop, Trainer
from fleetjax.fleet._loop import DygraphCalls
from fleetjax.nn import Parameters, named_sublayers

__all__ = [
    "ShardDataloader",
    "ShardOptimizer",
    "ShardingStage1",
    "ShardingStage2",
    "ShardingStage3",
    "shard_dataloader",
    "shard_layer",
    "shard_optimizer",
    "shard_scaler",
]


# -- shard_layer --------------------------------------------------------------------------------


def shard_layer(
    layer: nnx.Module,
    process_mesh: ProcessMesh,
    shard_fn: Callable[[str, nnx.Module, ProcessMesh], None] | None = None,
    input_fn: Callable[[Any, ProcessMesh], Any] | None = None,
    output_fn: Callable[[Any, ProcessMesh], Any] | None = None,
) -> nnx.Module:
    """Paddle's `paddle.distributed.shard_layer`: `shard_fn(name, sublayer, process_mesh)` for
    the layer and each sublayer (Paddle's `named_sublayers(include_self=True)`; it places
    parameters with `dist.shard_tensor`), then every parameter it left unplaced replicated on
    `process_mesh`. `input_fn(inputs, process_mesh)` and `output_fn(outputs, process_mesh)`
    become the layer's forward pre- and post-hooks (they run inside the compiled step, where a
    `dist.reshard` is a layout constraint). Returns the layer, changed in place.

    Raises:
      ValueError: for a `process_mesh` that is not a `ProcessMesh` (Paddle's message).
      TypeError: for a layer that is not a flax nnx Module.
    """
    if process_mesh is None:
        raise ValueError("The argument `process_mesh` cannot be empty.")
    if not isinstance(process_mesh, ProcessMesh):
        raise ValueError("The argument `process_mesh` is not `dist.ProcessMesh` type.")
    if not isinstance(layer, nnx.Module):
        raise TypeError(f"shard_layer takes a flax nnx Module, got {type(layer).__name__}")
    for name, sublayer in named_sublayers(layer, include_self=True):
        if shard_fn is not None:
            shard_fn(name, sublayer, process_mesh)
    for _, variable in nnx.to_flat_state(nnx.state(layer, nnx.Not(nnx.RngState))):
        if placements_of(variable[...]) is None:
            placements = [Replicate() for _ in process_mesh.dim_names]
            variable.set_value(shard_tensor(variable[...], process_mesh, placements))
    before = () if input_fn is None else (lambda _, inputs: input_fn(inputs, process_mesh),)
    after = () if output_fn is None else (lambda _, i, out: output_fn(out, process_mesh),)
    if before or after:
        add_hooks(layer, before, after)
    return layer


# -- shard_optimizer ----------------------------------------------------------------------------


class _ShardingStage:
    """ZeRO over one mesh dimension (Paddle's `ShardingStage1/2/3(sharding_mesh_dim,
    mesh=None)`): the optimizer state (stage 1), and the gradients (2), and the parameters (3)
    split over `sharding_mesh_dim` of `mesh` (default: the parameters' mesh, or `get_mesh()`).
    """

    stage = 0

    def __init__(self, sharding_mesh_dim: int | str, mesh: ProcessMesh | None = None) -> None:
        if mesh is not None and not isinstance(mesh, ProcessMesh):
            raise TypeError(f"{type(self).__name__}'s mesh must be a ProcessMesh, got {mesh!r}")
        if isinstance(sharding_mesh_dim, bool) or not isinstance(sharding_mesh_dim, int | str):
            raise TypeError(
                f"{type(self).__name__}'s sharding_mesh_dim is a mesh dimension's name or "
                f"index, got {sharding_mesh_dim!r}"
            )
        if mesh is not None:
            mesh.get_dim_size(sharding_mesh_dim)  # a dimension of the mesh, or its error
        self.sharding_mesh_dim, self.mesh = sharding_mesh_dim, mesh

    def dim_name(self, mesh: ProcessMesh) -> str:
        """The dimension's name on `mesh`."""
        dim = self.sharding_mesh_dim
        mesh.get_dim_size(dim)  # a dimension of the mesh, or its error
        return dim if isinstance(dim, str) else mesh.dim_names[dim]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sharding_mesh_dim!r}, mesh={self.mesh})"


class ShardingStage1(_ShardingStage):
    """Paddle's `ShardingStage1(sharding_mesh_dim, mesh=None)`: the optimizer state split over
    the mesh dimension (ZeRO-1)."""

    stage = 1


class ShardingStage2(_ShardingStage):
    """Paddle's `ShardingStage2(sharding_mesh_dim, mesh=None)`: the optimizer state and the
    gradients split over the mesh dimension (ZeRO-2)."""

    stage = 2


class ShardingStage3(_ShardingStage):
    """Paddle's `ShardingStage3(sharding_mesh_dim, mesh=None)`: the optimizer state, the
    gradients and the parameters split over the mesh dimension (ZeRO-3)."""

    stage = 3


class ShardOptimizer(DygraphCalls):
    """What `shard_optimizer` returns (Paddle's `_ShardOptimizer`): the optimizer, how it is
    sharded, and Paddle's dygraph calls (`step`, `clear_grad`, `minimize`, `state_dict`,
    `set_state_dict`, `get_lr`, `set_lr`) on the layer it trains, the layer whose
    `parameters()` made it.

    Attributes:
      optimizer: the user's optimizer (an optax transformation).
      shard_fn: the `ShardingStage` (None: the state laid out as its parameters).
      gradient_accumulation_steps: steps whose gradients one update averages.
      request: what the loop reads from them.
    """

    def __init__(
        self,
        optimizer: optax.GradientTransformation,
        shard_fn: _ShardingStage | None,
        gradient_accumulation_steps: int,
    ) -> None:
        self.optimizer, self.shard_fn = optimizer, shard_fn
        self.gradient_accumulation_steps = gradient_accumulation_steps
        parameters = getattr(optimizer, "parameter_list", None)
        self.layer = parameters.layer if isinstance(parameters, Parameters) else None
        mesh = self._mesh(shard_fn)
        self.request = Request(
            optimizer,
            stage=0 if shard_fn is None else shard_fn.stage,
            sharding_dim=None if shard_fn is None else shard_fn.dim_name(mesh),
            sharding_mesh=mesh if shard_fn is not None else None,
            accumulation=gradient_accumulation_steps,
        )
        if self.layer is not None:
            SemiAutoLoop(self.layer, self.request)

    def bind(self, layer: nnx.Module) -> None:
        """Train `layer` (`parallelize`'s model) from now on."""
        self.layer = layer
        SemiAutoLoop(layer, self.request)

    def _mesh(self, shard_fn: _ShardingStage | None) -> ProcessMesh | None:
        if shard_fn is None:
            return None
        mesh = shard_fn.mesh or get_mesh()
        if mesh is None and self.layer is not None:  # the parameters' mesh
            meshes = (process_mesh_of(v[...]) for _, v in _params(self.layer))
            mesh = next((m for m in meshes if m is not None), None)
        if mesh is None:
            raise ValueError(
                "The global mesh or shard_fn mesh should be set for the sharding strategy: "
                f"give {shard_fn!r} a mesh, or dist.set_mesh(mesh)"
            )
        return mesh

    @property
    def trainer(self) -> Trainer | None:
        """The fleet's `Trainer` the layer's first `backward` made (None before): its
        `train_step` is the compiled step (`fleetjax.explain(opt.trainer.train_step, batch)`).
        """
        return self._dygraph_loop().trainer

    def _dygraph_loop(self) -> DygraphLoop:
        loop = loop_of(self.layer) if self.layer is not None else None
        if loop is None or loop.request is not self.request:
            raise RuntimeError(
                "this optimizer trains no layer: make it with parameters=model.parameters() "
                "of a fleetjax.nn.Layer (Paddle's paddle.nn.Layer), then dist.shard_optimizer; "
                "a later shard_optimizer or to_static of the layer replaces it"
            )
        return loop

    def __repr__(self) -> str:
        return f"ShardOptimizer({self.optimizer!r}, shard_fn={self.shard_fn!r})"


def _params(layer: nnx.Module) -> list[tuple[Any, nnx.Param]]:
    return list(nnx.to_flat_state(nnx.state(layer, nnx.Param)))


def shard_optimizer(
    optimizer: optax.GradientTransformation,
    shard_fn: _ShardingStage | None = None,
    gradient_accumulation_steps: int = 1,
) -> ShardOptimizer:
    """Paddle's `paddle.distributed.shard_optimizer`: the optimizer state laid out as its
    parameters, and with `ShardingStage1/2/3(dim)` split over mesh dimension `dim` (ZeRO);
    `gradient_accumulation_steps` > 1 averages the gradients of that many `step()`s into one
    update (gradient merge across calls: each batch is `backward()`, `step()`,
    `clear_grad()`). Made with `parameters=layer.parameters()`, it trains that layer:
    `loss.backward(); opt.step(); opt.clear_grad()` on the layer's deferred outputs.

    Raises:
      TypeError: for an optimizer that is not an optax transformation, or a `shard_fn` that is
        not a `ShardingStage` (Paddle's custom accumulator functions have no counterpart).
      ValueError: for a `ShardingStage` dimension that is not one of its mesh's, or
        `gradient_accumulation_steps` below 1.
    """
    if isinstance(optimizer, ShardOptimizer):
        optimizer = optimizer.optimizer
    if not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise TypeError(
            "shard_optimizer takes an optimizer (fleetjax.optimizers.AdamW, SGD, ... or any "
            f"optax transformation), got {type(optimizer).__name__}"
        )
    if shard_fn is not None and not isinstance(shard_fn, _ShardingStage):
        raise TypeError(
            "shard_fn must be dist.ShardingStage1/2/3(mesh_dim, mesh): fleetjax lays out the "
            "optimizer state as its parameters, split over the stage's dim (ZeRO); a custom "
            f"function of each accumulator has no counterpart, got {shard_fn!r}"
        )
    steps = gradient_accumulation_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be an int >= 1, got {steps!r}")
    return ShardOptimizer(optimizer, shard_fn, steps)


def shard_scaler(scaler: amp.GradScaler) -> amp.GradScaler:
    """Paddle's `paddle.distributed.shard_scaler`: the `GradScaler` for distributed tensors.
    The compiled step checks the gradients of every device for non-finite values already (one
    step of the whole mesh is skipped or taken), so the scaler is returned as it is.

    Raises:
      TypeError: for a scaler that is not a `fleetjax.amp.GradScaler`.
    """
    if not isinstance(scaler, amp.GradScaler):
        raise TypeError(
            f"shard_scaler takes a fleetjax.amp.GradScaler (paddle.amp.GradScaler), got "
            f"{type(scaler).__name__}"
        )
    return scaler


# -- shard_dataloader ---------------------------------------------------------------------------


class ShardDataloader:
    """What `shard_dataloader` returns (Paddle's `ShardDataloader`): iterating it (or calling
    it, `for x, y in loader()`) gives the loader's batches with each array placed on its mesh,
    its rows split over the `shard_dims` dimension (`Shard(0)`), whole on the others.

    Attributes:
      dataloader: the batches: any iterable (fleetjax's `fleetjax.data.Loader`, a list, a
        generator function's iterator) of arrays, tuples or lists of arrays, or dicts.
    """

    def __init__(
        self,
        dataloader: Iterable[Any],
        meshes: ProcessMesh | Sequence[ProcessMesh],
        input_keys: Sequence[str] | None,
        shard_dims: Any,
        is_dataset_splitted: bool,
        dense_tensor_idx: Sequence[int] | None,
    ) -> None:
        self.dataloader = dataloader
        self.meshes = _one_mesh(meshes)
        self.input_keys = None if input_keys is None else list(input_keys)
        self.shard_dims = shard_dims
        self.is_dataset_splitted = is_dataset_splitted
        self.dense_tensor_idx = set(dense_tensor_idx or ())
        _dim(self.meshes, shard_dims, "shard_dims")

    def __iter__(self) -> Iterator[Any]:
        for batch in self.dataloader:
            yield self._placed(batch)

    def __call__(self) -> Iterator[Any]:
        return iter(self)

    def __len__(self) -> int:
        return len(self.dataloader)  # type: ignore[arg-type]

    def _placed(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            keys = self.input_keys if self.input_keys is not None else list(batch)
            return {k: self._leaf(v, k) if k in keys else v for k, v in batch.items()}
        if isinstance(batch, list | tuple):
            return type(batch)(
                v if i in self.dense_tensor_idx else self._leaf(v, i) for i, v in enumerate(batch)
            )
        return self._leaf(batch, 0)

    def _leaf(self, value: Any, key: Any) -> Any:
        dims = self.shard_dims
        dim = dims.get(key) if isinstance(dims, Mapping) else dims
        dim = dim[key] if isinstance(dim, list) and isinstance(key, int) else dim
        mesh = self.meshes
        placements: list[Placement] = [Replicate() for _ in mesh.dim_names]
        if dim is not None:
            placements[mesh.dim_names.index(_dim(mesh, dim, "shard_dims"))] = Shard(0)
        return jax.tree.map(lambda x: self._array(x, placements), value)

    def _array(self, x: Any, placements: list[Placement]) -> jax.Array:
        if self.is_dataset_splitted and jax.process_count() > 1:
            mesh = self.meshes
            spec = partition_spec(placements, mesh.dim_names, mesh.shape, np.shape(x))
            sharding = jax.sharding.NamedSharding(mesh.jax_mesh, spec)
            return jax.make_array_from_process_local_data(sharding, np.asarray(x))
        return shard_tensor(np.asarray(x), self.meshes, placements)


def _one_mesh(meshes: ProcessMesh | Sequence[ProcessMesh]) -> ProcessMesh:
    if isinstance(meshes, ProcessMesh):
        return meshes
    if not isinstance(meshes, list | tuple) or not meshes:
        raise TypeError(f"meshes must be a ProcessMesh or a list of them, got {meshes!r}")
    for m in meshes:
        if not isinstance(m, ProcessMesh):
            raise TypeError(f"meshes must be ProcessMeshes, got {m!r}")
        if m != meshes[0] or m.dim_names != meshes[0].dim_names:
            raise ValueError(
                f"shard_dataloader got several meshes {list(meshes)}: Paddle puts a pipeline's "
                "inputs on its first stage's mesh and its labels on its last; fleetjax's "
                "pipeline is one program over one mesh (dist.parallelize's pp_config "
                "split_spec), so give the one mesh"
            )
    return meshes[0]


def _dim(mesh: ProcessMesh, dims: Any, what: str) -> Any:
    """`dims` checked against `mesh` (a name or index, a list of them, a dict of them, None);
    a single one returned as its name."""
    if dims is None:
        return None
    if isinstance(dims, Mapping):
        return {k: _dim(mesh, v, what) for k, v in dims.items()}
    if isinstance(dims, list | tuple):
        return [_dim(mesh, d, what) for d in dims]
    if isinstance(dims, str):
        mesh.get_dim_size(dims)
        return dims
    if isinstance(dims, int) and not isinstance(dims, bool):
        mesh.get_dim_size(dims)  # a dimension of the mesh, or its error
        return mesh.dim_names[dims]
    raise TypeError(
        f"{what} must be a mesh dimension's name or index (or a list, a dict), got {dims!r}"
    )


def shard_dataloader(
    dataloader: Iterable[Any],
    meshes: ProcessMesh | Sequence[ProcessMesh],
    input_keys: Sequence[str] | None = None,
    shard_dims: Any = None,
    is_dataset_splitted: bool = False,
    dense_tensor_idx: Sequence[int] | None = None,
) -> ShardDataloader:
    """Paddle's `paddle.distributed.shard_dataloader`: the loader's batches placed on `meshes`
    (one mesh, or a list of the same mesh), each array's rows split over the mesh dimension
    `shard_dims` (a name or index; a list per input, a dict per key; None: whole on every
    device). `input_keys` names the dict keys to place, `dense_tensor_idx` the inputs to leave
    as they are. With `is_dataset_splitted` and several processes, each process's loader gives
    its own rows. The dimension it splits the batch over is the training's data-parallel one.

    Raises:
      ValueError, TypeError: for a dimension the mesh does not have, or meshes that differ
        (a pipeline's stages: fleetjax's pipeline is `parallelize`'s `split_spec`).
    """
    return ShardDataloader(
        dataloader, meshes, input_keys, shard_dims, is_dataset_splitted, dense_tensor_idx
    )
