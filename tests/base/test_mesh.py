"""build_mesh and the degrees a strategy asks for."""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import fleetjax
from fleetjax.mesh import build_mesh
from fleetjax.plan import mesh_for, read_plan, strategy_degrees


def test_default_is_pure_data_parallel_over_all_devices():
    mesh = build_mesh()
    assert dict(mesh.shape) == {"dp": 8, "pp": 1, "sharding": 1, "mp": 1}
    assert mesh.axis_names == ("dp", "pp", "sharding", "mp")
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_paddle_topology_order_mp_fastest():
    # Paddle's CommunicateTopology for dp=2, pp=2, mp=2: rank(data=1, pipe=0, model=1) == 5,
    # 'model' groups [[0,1],[2,3],...], 'pipe' groups [[0,2],[1,3],...], 'data' [[0,4],...].
    mesh = build_mesh(dp=2, pp=2, mp=2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)  # axes: dp, pp, sharding, mp
    assert ids[1, 0, 0, 1] == 5
    assert ids[0, 0, 0, :].tolist() == [0, 1]
    assert ids[0, :, 0, 1].tolist() == [1, 3]
    assert ids[:, 0, 0, 0].tolist() == [0, 4]


def test_custom_order():
    mesh = build_mesh(sharding=2, mp=2, order=["sharding", "mp", "dp", "pp"])
    assert mesh.axis_names == ("sharding", "mp", "dp", "pp")
    assert dict(mesh.shape) == {"sharding": 2, "mp": 2, "dp": 2, "pp": 1}
    # Paddle's longer order lists (with sep and cp) are accepted.
    assert build_mesh(order=["dp", "pp", "sharding", "sep", "cp", "mp"]).axis_names[-1] == "mp"


def test_dp_is_inferred():
    assert build_mesh(sharding=2, pp=2).shape["dp"] == 2
    assert build_mesh(mp=8).shape["dp"] == 1


def test_explicit_axis_types_and_devices():
    devices = jax.devices()[:4]
    mesh = build_mesh(dp=2, mp=2, devices=devices, axis_types=AxisType.Explicit)
    assert all(t == AxisType.Explicit for t in mesh.axis_types)
    assert sorted(d.id for d in mesh.devices.flat) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dp": 3}, "dp x sharding x pp x mp = 3 x 1 x 1 x 1 = 3, but there are 8 devices"),
        ({"dp": 2, "mp": 2}, "= 2 x 1 x 1 x 2 = 4, but there are 8 devices"),
        ({"mp": 3}, "cannot infer dp: 8 devices are not divisible by sharding x pp x mp = 1"),
        ({"mp": 0}, "mp degree must be a positive int, got 0"),
        ({"dp": -2}, "dp degree must be -1 or a positive int, got -2"),
        ({"mp": True}, "mp degree must be a positive int, got True"),
        ({"dp": 2.0}, "dp degree must be -1 or a positive int, got 2.0"),
        ({"order": ["dp", "pp", "mp"]}, "order must name each of dp, sharding, pp, mp"),
        ({"order": ["dp", "pp", "sharding", "mp", "mp"]}, "exactly once"),
    ],
)
def test_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_mesh(**kwargs)


def test_degrees_from_hybrid_configs():
    s = fleetjax.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 2, "mp_degree": 2, "pp_degree": 2}
    assert strategy_degrees(s)._asdict() == {
        "dp": 2,
        "sharding": 1,
        "pp": 2,
        "mp": 2,
        "sep": 1,
        "cp": 1,
    }
    s.hybrid_configs = {"order": ["mp", "pp", "sharding", "dp"]}
    assert mesh_for(read_plan(s)).axis_names == ("mp", "pp", "sharding", "dp")


def test_degrees_from_sharding_configs():
    s = fleetjax.DistributedStrategy()
    s.sharding = True
    assert strategy_degrees(s)._asdict() == {
        "dp": -1,
        "sharding": 8,
        "pp": 1,
        "mp": 1,
        "sep": 1,
        "cp": 1,
    }
    s.sharding_configs = {"sharding_degree": 4, "dp_degree": 2}
    assert strategy_degrees(s)._asdict() == {
        "dp": 2,
        "sharding": 4,
        "pp": 1,
        "mp": 1,
        "sep": 1,
        "cp": 1,
    }
    s.hybrid_configs = {"sharding_degree": 4}  # the same value twice is fine
    assert strategy_degrees(s).sharding == 4


def test_inconsistent_degrees_are_an_error():
    s = fleetjax.DistributedStrategy()
    s.sharding = True
    s.sharding_configs = {"sharding_degree": 4}
    s.hybrid_configs = {"sharding_degree": 2}
    with pytest.raises(ValueError, match=(
        "the sharding degree is set twice: hybrid_configs.sharding_degree=2 but "
        "sharding_configs.sharding_degree=4"
    )):  # fmt: skip
        strategy_degrees(s)


def test_sharding_configs_ignored_when_sharding_is_off():
    s = fleetjax.DistributedStrategy()
    s.sharding_configs = {"sharding_degree": 4}
    assert strategy_degrees(s).sharding == 1


def test_tensor_parallel_degree():
    s = fleetjax.DistributedStrategy()
    s.tensor_parallel = True
    s.tensor_parallel_configs = {"tensor_parallel_degree": 4}
    assert strategy_degrees(s).mp == 4
    s.hybrid_configs = {"mp_degree": 2}
    with pytest.raises(ValueError, match="mp degree is set twice"):
        strategy_degrees(s)


def test_axes_fleetjax_does_not_have():
    s = fleetjax.DistributedStrategy()
    s.hybrid_configs = {"ep_degree": 2}
    with pytest.raises(NotImplementedError, match="hybrid_configs.ep_degree=2"):
        strategy_degrees(s)


def test_sequence_axes_only_where_above_one():
    mesh = build_mesh(sep=2, cp=2, mp=2)
    assert mesh.axis_names == ("dp", "pp", "sharding", "sep", "cp", "mp")  # Paddle's order
    assert dict(mesh.shape) == {"dp": 1, "pp": 1, "sharding": 1, "sep": 2, "cp": 2, "mp": 2}
    assert build_mesh(cp=4).axis_names == ("dp", "pp", "sharding", "cp", "mp")
    with pytest.raises(
        ValueError, match="dp x sharding x pp x sep x cp x mp = 1 x 1 x 1 x 2 x 2 x 4 = 16, but"
    ):
        build_mesh(sharding=1, pp=1, sep=2, cp=2, mp=4, dp=1)
    with pytest.raises(ValueError, match="order must name 'cp', whose degree is above 1"):
        build_mesh(cp=2, order=["dp", "pp", "sharding", "mp"])


def test_context_parallel_is_carved_out_of_sharding():
    # Paddle: sharding_degree = cp_sharding_degree x cp_degree.
    s = fleetjax.DistributedStrategy()
    s.hybrid_configs = {"sharding_degree": 4, "cp_degree": 2, "sep_degree": 2}
    degrees = strategy_degrees(s)
    assert (degrees.sharding, degrees.cp, degrees.sep) == (2, 2, 2)
    mesh = mesh_for(read_plan(s))
    assert dict(mesh.shape) == {"dp": 1, "pp": 1, "sharding": 2, "sep": 2, "cp": 2, "mp": 1}
    s.hybrid_configs = {"sharding_degree": 4, "cp_degree": 2, "cp_sharding_degree": 2}
    assert strategy_degrees(s).sharding == 2
    s.hybrid_configs = {"sharding_degree": 4, "cp_degree": 2, "cp_sharding_degree": 4}
    with pytest.raises(ValueError, match=(
        "hybrid_configs.cp_sharding_degree=4 must be sharding_degree / cp_degree = 4 / 2 = 2"
    )):  # fmt: skip
        strategy_degrees(s)
    s = fleetjax.DistributedStrategy()
    s.hybrid_configs = {"cp_degree": 2}
    with pytest.raises(ValueError, match=(
        "hybrid_configs.cp_degree=2 must divide the sharding degree \\(1\\)"
    )):  # fmt: skip
        strategy_degrees(s)


def test_auto_parallel_strategy_degrees():
    s = fleetjax.Strategy({"sharding": {"enable": True, "degree": 2}})
    assert dict(mesh_for(read_plan(s)).shape) == {"dp": 4, "pp": 1, "sharding": 2, "mp": 1}
    s.sharding.enable = False
    assert mesh_for(read_plan(s)).shape["sharding"] == 1


def test_strategy_mesh_with_wrong_device_count():
    s = fleetjax.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 4, "mp_degree": 4}
    with pytest.raises(ValueError, match="= 16, but there are 8 devices"):
        mesh_for(read_plan(s))


def test_a_repeated_or_no_device_is_refused():
    devices = jax.devices()
    with pytest.raises(ValueError, match=r"devices lists .* twice \(at 0 and 1\)"):
        build_mesh(devices=[devices[0], devices[0]])
    with pytest.raises(ValueError, match="devices is empty"):
        build_mesh(devices=[])


def test_too_few_cpu_devices_says_how_to_simulate_more():
    with pytest.raises(ValueError, match=r"there are 2 devices. To simulate 4 CPU devices, set "
                                         r"JAX_NUM_CPU_DEVICES=4"):  # fmt: skip
        build_mesh(dp=2, sharding=2, devices=jax.devices()[:2])
    with pytest.raises(
        ValueError,
        match=r"^cannot infer dp: 2 devices are not divisible by sharding x pp x mp = 1 x 2 x 2 = "
        r"4\. To simulate 4 CPU devices, set JAX_NUM_CPU_DEVICES=4 \(or XLA_FLAGS=",
    ):
        build_mesh(pp=2, mp=2, devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"^cannot infer dp: 8 devices .* = 3$"):  # 8 fill 3
        build_mesh(mp=3)
