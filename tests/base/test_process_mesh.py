"""`ProcessMesh`: Paddle's attributes and sub-meshes (the values below are what Paddle 3.3.1
gives), process ids in any order as this job's devices, and clear errors for ids that are not
this job's devices and for mesh dimensions that do not exist."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import fleetjax.distributed as dist

MESH_3D = [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_paddles_example():
    mesh = dist.ProcessMesh([[2, 4, 5], [0, 1, 3]], dim_names=["x", "y"])
    assert mesh.shape == [2, 3] and mesh.process_ids == [2, 4, 5, 0, 1, 3]
    assert mesh.ndim == 2 and mesh.dim_names == ["x", "y"]
    assert dist.ProcessMesh([[2, 4, 5], [0, 1, 3]]).dim_names == ["d0", "d1"]
    assert dist.ProcessMesh(shape=[2, 3], process_ids=[2, 4, 5, 0, 1, 3]) == mesh


def test_ids_in_any_order_are_the_jobs_devices():
    mesh = dist.ProcessMesh([[6, 2], [7, 0]], dim_names=["a", "b"])
    devices = jax.devices()
    assert mesh.jax_mesh.devices.tolist() == [[devices[6], devices[2]], [devices[7], devices[0]]]
    assert mesh.jax_mesh.axis_names == ("a", "b")
    assert mesh.jax_mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    assert dist.ProcessMesh.from_jax(mesh.jax_mesh).process_ids == [6, 2, 7, 0]


@pytest.mark.parametrize(
    ("args", "shape", "ids", "names"),
    [
        (("dp",), [2, 2, 2], [0, 1, 4, 5, 2, 3, 6, 7], ["dp", "pp", "tp"]),
        (("dp", 1), [2, 2], [2, 3, 6, 7], ["pp", "tp"]),
        (("tp", 0), [2, 2], [0, 2, 4, 6], ["pp", "dp"]),
        (("pp", 1), [2, 2], [4, 5, 6, 7], ["dp", "tp"]),
    ],
)
def test_get_mesh_with_dim_as_paddle(args, shape, ids, names):
    sub = dist.ProcessMesh(MESH_3D, dim_names=["pp", "dp", "tp"]).get_mesh_with_dim(*args)
    assert (sub.shape, sub.process_ids, sub.dim_names) == (shape, ids, names)


def test_indexing_as_paddle():
    mesh = dist.ProcessMesh(MESH_3D, dim_names=["pp", "dp", "tp"])
    assert (mesh[1].process_ids, mesh[1].dim_names) == ([4, 5, 6, 7], ["dp", "tp"])
    assert (mesh[:, :, 1].process_ids, mesh[:, :, 1].dim_names) == ([1, 3, 5, 7], ["pp", "dp"])
    # Paddle 3.3.1 fails on this one (it names only the sliced dimensions)
    assert (mesh[:, 0].process_ids, mesh[:, 0].dim_names) == ([0, 1, 4, 5], ["pp", "tp"])
    assert mesh[0, 1, 0].process_ids == [2] and mesh[0, 1, 0].dim_names == ["d0"]
    line = dist.ProcessMesh([3, 1, 2], dim_names=["x"])
    assert line.get_mesh_with_dim("x", 1).process_ids == [1] and line[1:].process_ids == [1, 2]
    assert mesh.get_dim_size("tp") == 2 and mesh.get_dim_size(0) == 2


def test_submesh_of_this_process():
    whole = dist.ProcessMesh(list(range(8)), dim_names=["dp"])
    assert whole.get_submesh_with_dim("dp") == whole
    with pytest.raises(ValueError, match="drives devices of 4 sub-meshes along 'dp'"):
        dist.ProcessMesh(MESH_3D, dim_names=["pp", "dp", "tp"]).get_submesh_with_dim("dp")


def test_global_mesh():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    before = dist.get_mesh()
    try:
        dist.set_mesh(mesh)
        assert dist.get_mesh() is mesh
    finally:
        dist.set_mesh(before)
    with pytest.raises(TypeError, match="set_mesh takes a ProcessMesh"):
        dist.set_mesh([0, 1])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"mesh": [[0, 1], [8, 9]]},
            ValueError,
            r"process ids \[8, 9\] are not devices of this job: it has 8 devices",
        ),
        ({"mesh": [0, 0]}, ValueError, r"distinct and >= 0, got \[0, 0\]"),
        ({"mesh": [-1, 0]}, ValueError, r"distinct and >= 0"),
        (
            {"mesh": [0, 1], "dim_names": ["x", "y"]},
            ValueError,
            r"1 distinct names .* got \['x', 'y'\]",
        ),
        ({"mesh": [[0, 1]], "dim_names": ["x", "x"]}, ValueError, r"2 distinct names"),
        ({"mesh": [0.5, 1]}, ValueError, "grid of ints"),
        ({"mesh": "0,1"}, TypeError, "a list or a numpy array"),
        ({"shape": [2]}, ValueError, "needs mesh, or shape and process_ids"),
    ],
)
def test_bad_meshes_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        dist.ProcessMesh(**kwargs)


def test_a_dimension_that_does_not_exist_is_named():
    mesh = dist.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    for call in (
        lambda: mesh.get_dim_size("pp"),
        lambda: mesh.get_mesh_with_dim("pp"),
        lambda: mesh.get_submesh_with_dim("pp"),
    ):
        with pytest.raises(
            ValueError, match=r"'pp' is not a dimension of .*: its dimensions are \['dp', 'mp'\]"
        ):
            call()
    with pytest.raises(ValueError, match="neither a name in"):
        mesh.get_dim_size(2)
    assert np.array_equal(mesh.mesh, [[0, 1], [2, 3]])
