"""Paddle's `local_map`: a function of local tensors run on every device of a mesh, its inputs'
and outputs' placements given; on JAX a `jax.shard_map` over the mesh's named dimensions."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from fleetjax.auto_parallel._placements import (
    Placement,
    ReduceType,
    Replicate,
    check_placements,
    partition_spec,
)
from fleetjax.auto_parallel._process_mesh import ProcessMesh, get_mesh
from fleetjax.auto_parallel._reshard import Layout
from fleetjax.auto_parallel._tensor import (
    average_parts,
    global_shape,
    is_traced,
    place_as,
    placements_of,
    sharding_of,
)

Placements = Sequence[Placement]


def _mesh(leaves: list[Any], process_mesh: ProcessMesh | None) -> Mesh | AbstractMesh:
    """The mesh the call runs on: `process_mesh`, the first distributed input's, or
    `get_mesh()`."""
    if process_mesh is not None:
        return process_mesh.jax_mesh
    for leaf in leaves:
        if (sharding := sharding_of(leaf)) is not None:
            return sharding.mesh
    if (mesh := get_mesh()) is not None:
        return mesh.jax_mesh
    raise ValueError(
        "local_map: no input is a distributed tensor and no process_mesh is given (nor a "
        "global one, set_mesh): say which mesh the function runs on"
    )


def _spec(placements: Placements, mesh: Mesh | AbstractMesh, shape: Sequence[int], what: str):
    return partition_spec(placements, list(mesh.axis_names), list(mesh.axis_sizes), shape, what)


def _input(
    leaf: Any, wanted: Placements | None, mesh: Mesh | AbstractMesh, reshard: bool, number: int
) -> tuple[Any, PartitionSpec]:
    """Input `number` placed as the function wants it, and its spec."""
    what = f"local_map's input {number}"
    if wanted is not None and any(
        p.is_partial() and p.reduce_type() == ReduceType.kRedAvg for p in wanted
    ):
        raise ValueError(
            f"{what}: in_placements {list(wanted)} has Partial(kRedAvg); fleetjax holds pending "
            "sums only (an average comes in as the sum of its parts over their number): "
            "ask for Partial()"
        )
    held = placements_of(leaf)
    sharding = sharding_of(leaf)
    if held is not None and sharding.mesh not in (mesh, getattr(mesh, "abstract_mesh", mesh)):
        raise ValueError(f"{what} is on another mesh ({dict(sharding.mesh.shape)}) than {mesh}")
    if wanted is None:  # as it is; an array no mesh places: whole on every device
        wanted = held if held is not None else [Replicate()] * len(mesh.axis_names)
    spec = _spec(wanted, mesh, np.shape(leaf), what)
    rank = np.ndim(leaf)
    moved = held is None or Layout.of(sharding.spec, rank) != Layout.of(spec, rank)
    if held is not None and moved and not reshard:
        raise ValueError(
            f"{what} is placed as {held}, the function takes it as {list(wanted)}: reshard "
            "it first, or pass reshard_inputs=True"
        )
    return (place_as(leaf, mesh, spec) if moved else leaf), spec


def _pending(value: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """`value` typed as varying along `axes`, the mesh axes of its pending sum: a value equal
    on every device there is still one part per device (its sum counts each), as in Paddle."""
    missing = tuple(a for a in axes if a not in jax.typeof(value).mat.varying)
    return jax.lax.pcast(value, missing, to="varying") if missing else value


def local_map(
    func: Callable[..., Any],
    out_placements: Sequence[Placements | None],
    in_placements: Sequence[Placements | None] | None = None,
    process_mesh: ProcessMesh | None = None,
    reshard_inputs: bool = False,
) -> Callable[..., Any]:
    """Paddle's `paddle.distributed.local_map`: `func` of each device's local tensors, as a
    function of distributed tensors (`jax.shard_map` over the mesh's named dimensions; inside
    `func`, `jax.lax.axis_index(name)` is the device's place along mesh dimension `name`).

    Args:
      func: a function of local arrays.
      out_placements: the placements of each output (the outputs flattened, as
        `jax.tree.leaves` orders them); None (Paddle: a non-tensor output) is Replicate.
        `Partial()` outputs are pending sums: each device's value is its part;
        `Partial(kRedAvg)` ones are divided by the number of parts, so that their sum is the
        average.
      in_placements: how `func` takes each input (the arguments flattened; None: as it is).
      process_mesh: the mesh (default: the first distributed input's, else `get_mesh()`).
      reshard_inputs: reshard inputs placed otherwise than `in_placements` (else an error).

    Arguments that are not arrays (Python numbers, strings) reach `func` unchanged; arrays that
    no mesh places are whole on every device. JAX checks that an output said to be replicated
    does not differ between devices (`shard_map`'s `check_vma`).
    """

    def call(*args: Any) -> Any:
        leaves, tree = jax.tree.flatten(args)
        if in_placements is not None and len(in_placements) != len(leaves):
            raise ValueError(
                f"local_map: {len(in_placements)} in_placements for {len(leaves)} inputs (the "
                "arguments flattened)"
            )
        mesh = _mesh(leaves, process_mesh)
        arrays = [isinstance(x, jax.Array | np.ndarray) or is_traced(x) for x in leaves]
        placed, specs = [], []
        for number, (leaf, is_array) in enumerate(zip(leaves, arrays, strict=True)):
            wanted = None if in_placements is None else in_placements[number]
            if is_array:
                leaf, spec = _input(leaf, wanted, mesh, reshard_inputs, number)
                placed.append(leaf)
                specs.append(spec)
            elif wanted is not None:
                raise ValueError(f"local_map's input {number} is not an array: {leaf!r}")
        static = [None if is_array else leaf for leaf, is_array in zip(leaves, arrays, strict=True)]
        return _run(func, tree, static, arrays, placed, specs, mesh, out_placements)

    functools.update_wrapper(call, func)
    return call


def _run(
    func: Callable[..., Any],
    tree: Any,
    static: list[Any],
    arrays: list[bool],
    placed: list[Any],
    specs: list[PartitionSpec],
    mesh: Mesh | AbstractMesh,
    out_placements: Sequence[Placements | None],
) -> Any:
    """`func` under `shard_map`, its outputs placed as `out_placements`."""
    out_tree: list[Any] = []
    sizes = list(mesh.axis_sizes)
    names = list(mesh.axis_names)
    out_placements = [
        None if p is None else check_placements(p, names, f"local_map's output {number}")
        for number, p in enumerate(out_placements)
    ]
    scales = [1 if p is None else average_parts(p, sizes) for p in out_placements]
    summed = [
        () if p is None else tuple(n for n, q in zip(names, p, strict=True) if q.is_partial())
        for p in out_placements
    ]

    def flat(*values: Any) -> tuple[Any, ...]:
        given = iter(values)
        leaves = [next(given) if a else s for s, a in zip(static, arrays, strict=True)]
        outputs, structure = jax.tree.flatten(func(*jax.tree.unflatten(tree, leaves)))
        out_tree[:] = [structure]
        if len(out_placements) != len(outputs):
            raise ValueError(
                f"local_map: {len(out_placements)} out_placements for {len(outputs)} outputs "
                "(the function's results flattened)"
            )
        return tuple(
            _pending(o / n if n > 1 else o, axes)
            for o, n, axes in zip(outputs, scales, summed, strict=True)
        )

    local = jax.eval_shape(
        jax.shard_map(
            flat, mesh=mesh, in_specs=tuple(specs), out_specs=PartitionSpec(), check_vma=False
        ),
        *placed,
    )
    out_specs = []
    for number, (o, p) in enumerate(zip(local, out_placements, strict=True)):
        what = f"local_map's output {number}"
        shape = global_shape(p, names, sizes, np.shape(o), what) if p is not None else ()
        out_specs.append(PartitionSpec() if p is None else _spec(p, mesh, shape, what))
    # jitted: outside a traced function shard_map would run each operation on its own
    mapped = jax.shard_map(flat, mesh=mesh, in_specs=tuple(specs), out_specs=tuple(out_specs))
    results = jax.jit(mapped)(*placed)
    return jax.tree.unflatten(out_tree[0], results)
