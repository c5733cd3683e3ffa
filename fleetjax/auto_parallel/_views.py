"""A `ProcessMesh` seen through another JAX mesh of the same devices: the mesh a train step runs
on, whose axes carry fleetjax's names (`dp`, `sharding`, `pp`, `mp`, ...) and `Auto` types.

Paddle's front ends (`shard_tensor`, `shard_optimizer`, `to_static`, ...) name a mesh's
dimensions as the user likes; the train step names its axes by their role. A `MeshView` is the
one translation between them: each dimension of the `ProcessMesh` is one axis of the step's
mesh (the devices in the same order, so moving an array between the two is free), and the
step's mesh may have more axes, of one device each. Registered (`register_view`), it makes an
array on the step's mesh read as the user placed it (`placements_of`, `process_mesh_of`), and a
`reshard` to the `ProcessMesh` inside the traced step a layout constraint on the step's mesh.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from fleetjax.auto_parallel._process_mesh import ProcessMesh

__all__ = ["MeshView", "register_view", "view_of", "views_of"]


@dataclasses.dataclass(frozen=True)
class MeshView:
    """`process_mesh` seen as `mesh`: dimension i of the `ProcessMesh` is `mesh`'s axis
    `axes[i]`, over the same devices in the same order; `mesh`'s other axes have one device.

    Attributes:
      process_mesh: the user's mesh (Paddle's dimension names).
      mesh: the train step's mesh (fleetjax's axis names).
      axes: the step's axis for each dimension of `process_mesh`, in dimension order.
    """

    process_mesh: ProcessMesh
    mesh: Mesh
    axes: tuple[str, ...]

    def __post_init__(self) -> None:
        names = self.process_mesh.dim_names
        if len(self.axes) != len(names) or len(set(self.axes)) != len(self.axes):
            raise ValueError(f"a view needs one distinct axis per mesh dim {names}: {self.axes}")
        for dim, axis in zip(names, self.axes, strict=True):
            if self.mesh.shape[axis] != self.process_mesh.get_dim_size(dim):
                raise ValueError(
                    f"mesh dim {dim!r} has {self.process_mesh.get_dim_size(dim)} devices, the "
                    f"step's axis {axis!r} {self.mesh.shape[axis]}"
                )
        others = [a for a in self.mesh.axis_names if a not in self.axes]
        if any(self.mesh.shape[a] != 1 for a in others):
            raise ValueError(f"the step's axes {others} must have one device each")
        ordered = self.mesh.devices.transpose(
            [self.mesh.axis_names.index(a) for a in (*self.axes, *others)]
        )
        if list(ordered.flat) != list(self.process_mesh.jax_mesh.devices.flat):
            raise ValueError("a view's mesh holds the ProcessMesh's devices in its order")

    def dim_of(self, axis: str) -> str | None:
        """The mesh dimension the step's `axis` stands for (None: an axis of one device)."""
        return self.process_mesh.dim_names[self.axes.index(axis)] if axis in self.axes else None

    def to_step(self, spec: PartitionSpec) -> PartitionSpec:
        """A spec over the `ProcessMesh`'s dimensions as one over the step's axes."""
        rename = dict(zip(self.process_mesh.dim_names, self.axes, strict=True))
        return _renamed(spec, rename.get)

    def to_user(self, spec: PartitionSpec) -> PartitionSpec:
        """A spec over the step's axes as one over the `ProcessMesh`'s dimensions (axes of one
        device that stand for no dimension drop out: they split nothing)."""
        return _renamed(spec, self.dim_of)


def _renamed(spec: PartitionSpec, rename: object) -> PartitionSpec:
    def entry(e: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        kept = tuple(n for n in map(rename, axes) if n is not None)  # type: ignore[operator]
        return None if not kept else kept[0] if len(kept) == 1 else kept

    unreduced = frozenset(n for n in map(rename, spec.unreduced) if n is not None)  # type: ignore[operator]
    return PartitionSpec(*map(entry, spec.partitions), unreduced=unreduced)


_VIEWS: dict[Mesh, MeshView] = {}


def register_view(view: MeshView) -> MeshView:
    """Read arrays on `view.mesh` as placed on `view.process_mesh` from now on (a step's mesh
    stands for one `ProcessMesh`: registering another for it replaces the first)."""
    _VIEWS[view.mesh] = view
    return view


def view_of(mesh: Mesh | AbstractMesh) -> MeshView | None:
    """The view registered for `mesh` (an abstract mesh: the one view with its axes, if only
    one has them)."""
    if isinstance(mesh, Mesh):
        return _VIEWS.get(mesh)
    found = views_of(mesh)
    return found[0] if len(found) == 1 else None


def views_of(abstract: AbstractMesh, target: ProcessMesh | None = None) -> list[MeshView]:
    """The registered views whose step mesh has the axes of `abstract` (and, if `target` is
    given, that see `target`: its devices and its dimension names)."""
    return [
        v
        for m, v in _VIEWS.items()
        if m.abstract_mesh == abstract
        and (
            target is None
            or (v.process_mesh == target and v.process_mesh.dim_names == target.dim_names)
        )
    ]
