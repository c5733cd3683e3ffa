"""Paddle's `ProcessMesh` on JAX: an n-d grid of process ids with named dimensions, each id
one of this job's devices (`jax.devices()[id]`: the one device a Paddle rank drives), and the
global mesh of `set_mesh` / `get_mesh`."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any, SupportsIndex

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh


class ProcessMesh:
    """Paddle's `paddle.distributed.ProcessMesh(mesh=None, dim_names=None, shape=None,
    process_ids=None)`: the Cartesian topology of the devices a tensor is placed on.

    Process id i is `jax.devices()[i]`, so the ids may come in any order, and a sub-mesh holds
    some of the job's devices. The JAX mesh (`jax_mesh`) has the same dimensions and names, as
    explicit axes: placements are part of each array's type, as in Paddle.

    Args:
      mesh: the process ids as a nested list or an integer array, one array dimension per mesh
        dimension.
      dim_names: a name per mesh dimension (default "d0", "d1", ...).
      shape, process_ids: instead of `mesh` (Paddle keeps them for compatibility): the ids in
        mesh order and the mesh's shape.

    Raises:
      TypeError, ValueError: for ids that are not distinct non-negative ints, names that are
        not distinct strings (one per dimension), or ids that are not this job's devices.
    """

    def __init__(
        self,
        mesh: np.ndarray | Sequence[Any] | None = None,
        dim_names: list[str] | None = None,
        shape: Sequence[int] | None = None,
        process_ids: Iterable[Any] | None = None,
    ) -> None:
        if mesh is None:
            if shape is None or process_ids is None:
                raise ValueError("ProcessMesh needs mesh, or shape and process_ids")
            mesh = np.array(list(process_ids)).reshape(tuple(shape))
        if not isinstance(mesh, list | tuple | np.ndarray):
            raise TypeError(f"ProcessMesh's mesh must be a list or a numpy array, got {mesh!r}")
        ids = np.array(mesh)
        if ids.ndim == 0 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise ValueError(f"ProcessMesh's mesh must be a non-empty grid of ints, got {mesh!r}")
        if ids.min() < 0 or len(np.unique(ids)) != ids.size:
            raise ValueError(f"ProcessMesh's ids must be distinct and >= 0, got {ids.tolist()}")
        names = [f"d{i}" for i in range(ids.ndim)] if dim_names is None else dim_names
        if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
            raise TypeError(f"ProcessMesh's dim_names must be a list of str, got {dim_names!r}")
        if len(names) != ids.ndim or len(set(names)) != len(names):
            raise ValueError(
                f"ProcessMesh's dim_names must be {ids.ndim} distinct names (one per dimension "
                f"of a mesh of shape {list(ids.shape)}), got {list(names)}"
            )
        self._ids = ids.astype(int)
        self._names = list(names)
        self._jax_mesh = _jax_mesh(tuple(self.process_ids), self._ids.shape, tuple(self._names))
        _KNOWN.setdefault(self._jax_mesh.abstract_mesh, {})[self._key()] = self

    @classmethod
    def from_jax(cls, mesh: Mesh) -> ProcessMesh:
        """The ProcessMesh of a JAX mesh's devices (their places in `jax.devices()`)."""
        position = {d: i for i, d in enumerate(jax.devices())}
        ids = np.vectorize(position.__getitem__, otypes=[int])(mesh.devices)
        return cls(ids, list(mesh.axis_names))

    # -- Paddle's attributes ---------------------------------------------------------------------
    @property
    def mesh(self) -> np.ndarray:
        """The process ids as an array of the mesh's shape."""
        return self._ids.copy()

    @property
    def shape(self) -> list[int]:
        return list(self._ids.shape)

    @property
    def dim_names(self) -> list[str]:
        return list(self._names)

    @property
    def process_ids(self) -> list[int]:
        """The ids in mesh order (row-major)."""
        return [int(i) for i in self._ids.flat]

    @property
    def ndim(self) -> int:
        return self._ids.ndim

    @property
    def size(self) -> int:
        return self._ids.size

    @property
    def jax_mesh(self) -> Mesh:
        """The `jax.sharding.Mesh` of these devices, with these names, as explicit axes."""
        return self._jax_mesh

    def contains(self, process_id: int) -> bool:
        return process_id in self.process_ids

    def _dim(self, dim: str | int) -> int:
        """The index of mesh dimension `dim` (a name or an index)."""
        if isinstance(dim, str):
            if dim not in self._names:
                raise ValueError(
                    f"{dim!r} is not a dimension of {self}: its dimensions are {self._names}"
                )
            return self._names.index(dim)
        if isinstance(dim, bool) or not isinstance(dim, int) or not -self.ndim <= dim < self.ndim:
            raise ValueError(
                f"mesh dimension {dim!r} is neither a name in {self._names} nor an index "
                f"below {self.ndim}"
            )
        return dim % self.ndim

    def get_dim_size(self, dim: str | int) -> int:
        """The number of devices along mesh dimension `dim` (a name or an index)."""
        return self.shape[self._dim(dim)]

    def get_mesh_with_dim(
        self, dim_name: str, index: slice | tuple[slice, ...] | SupportsIndex | None = None
    ) -> ProcessMesh:
        """This mesh with `dim_name` moved first, or (with `index`) the sub-mesh at `index`
        along it: `mesh.get_mesh_with_dim("pp", 0)` is the first pipeline stage's mesh."""
        axis = self._dim(dim_name)
        order = [axis, *(i for i in range(self.ndim) if i != axis)]
        names = [self._names[i] for i in order]
        moved = self._ids.transpose(order)
        if index is None:
            return ProcessMesh(moved, names)
        if self.ndim == 1:
            return ProcessMesh(np.atleast_1d(moved[index]), names)
        return ProcessMesh(moved[index], names[1:])

    def get_submesh_with_dim(self, dim_name: str) -> ProcessMesh | None:
        """The one-dimensional sub-mesh along `dim_name` that holds this process's devices
        (None if it holds none of them).

        Raises:
          ValueError: if this process drives devices of several such sub-meshes (one process
            drives all the devices of a single-host job): pick one with `get_mesh_with_dim`.
        """
        axis = self._dim(dim_name)
        lines = np.moveaxis(self._ids, axis, -1).reshape(-1, self.shape[axis])
        position = {d: i for i, d in enumerate(jax.devices())}
        mine = {position[d] for d in jax.local_devices()}
        held = [line for line in lines if mine & set(line.tolist())]
        if len(held) > 1:
            raise ValueError(
                f"this process drives devices of {len(held)} sub-meshes along {dim_name!r} of "
                f"{self}; pick one with get_mesh_with_dim({dim_name!r}, index)"
            )
        return ProcessMesh(held[0], [dim_name]) if held else None

    def __getitem__(self, index: slice | tuple[slice, ...] | str | SupportsIndex) -> ProcessMesh:
        """A sub-mesh, as Paddle slices one: `mesh[0]` drops the first dimension, slices keep
        theirs, a name is `get_submesh_with_dim(name)`."""
        if isinstance(index, str):
            found = self.get_submesh_with_dim(index)
            if found is None:
                raise ValueError(f"this process drives no device of {self}")
            return found
        items = index if isinstance(index, tuple) else (index,)
        kept = [n for n, item in zip(self._names, items, strict=False) if isinstance(item, slice)]
        kept += self._names[len(items) :]
        ids = self._ids[index]
        return ProcessMesh(ids, kept) if ids.ndim else ProcessMesh([int(ids)])

    # -- identity --------------------------------------------------------------------------------
    def _key(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[str, ...]]:
        return tuple(self._ids.shape), tuple(self.process_ids), tuple(self._names)

    def __eq__(self, other: object) -> bool:
        """Paddle's equality: the same shape and process ids (the names aside)."""
        if not isinstance(other, ProcessMesh):
            return NotImplemented
        return self._key()[:2] == other._key()[:2]

    def __hash__(self) -> int:
        return hash(self._key()[:2])

    def __repr__(self) -> str:
        ids, names = self.process_ids, self._names
        return f"ProcessMesh(shape={self.shape}, process_ids={ids}, dim_names={names})"


@functools.lru_cache(maxsize=256)
def _jax_mesh(ids: tuple[int, ...], shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    devices = jax.devices()
    unknown = sorted(i for i in ids if i >= len(devices))
    if unknown:
        raise ValueError(
            f"ProcessMesh: process ids {unknown} are not devices of this job: it has "
            f"{len(devices)} devices, process ids 0..{len(devices) - 1} (jax.devices())"
        )
    grid = np.array([devices[i] for i in ids], dtype=object).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Explicit,) * len(names))


# The meshes made so far, by their abstract mesh: inside a traced function an array's type
# names its mesh's axes and sizes, not its devices, and this finds the ProcessMesh it means.
_KNOWN: dict[AbstractMesh, dict[tuple[Any, ...], ProcessMesh]] = {}


def known_mesh(abstract: AbstractMesh) -> ProcessMesh:
    """The ProcessMesh made in this process whose mesh is `abstract`.

    Raises:
      ValueError: if none, or several with other devices, are (name them, and say which)."""
    found = {tuple(m.process_ids): m for m in _KNOWN.get(abstract, {}).values()}
    if len(found) == 1:
        return next(iter(found.values()))
    what = "no ProcessMesh" if not found else f"{len(found)} ProcessMeshes ({list(found.values())})"
    raise ValueError(
        f"inside a traced function an array's type names its mesh's axes, not its devices, "
        f"and {what} of this process {'has' if not found else 'have'} axes "
        f"{dict(zip(abstract.axis_names, abstract.axis_sizes, strict=True))}; read the "
        "ProcessMesh outside the traced function"
    )


_GLOBAL_MESH: list[ProcessMesh | None] = [None]


def set_mesh(mesh: ProcessMesh | None) -> None:
    """Paddle's `paddle.distributed.set_mesh`: the global mesh (`get_mesh`), which fleetjax's
    auto-parallel functions use where no mesh is given (`local_map` without inputs on one);
    None unsets it."""
    if mesh is not None and not isinstance(mesh, ProcessMesh):
        raise TypeError(f"set_mesh takes a ProcessMesh, got {mesh!r}")
    _GLOBAL_MESH[0] = mesh


def get_mesh() -> ProcessMesh | None:
    """Paddle's `paddle.distributed.get_mesh`: the mesh `set_mesh` set, or None."""
    return _GLOBAL_MESH[0]
