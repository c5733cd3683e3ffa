"""Strategy knobs -> XLA flags applied by fleet.init before JAX starts its backend; unknown flags
never set; late flags and knobs without effect warn once."""

import json
import os
import subprocess
import sys
import warnings

import jax
import optax
import pytest

import fleetjax
from fleetjax import fleet, xla_flags
from fleetjax.plan import XLA_FUSES, read_plan
from fleetjax.xla_flags import Flag

MiB = 2**20


@pytest.fixture(autouse=True)
def _backend_running():
    """In this process the backend runs, so XLA_FLAGS changes made here reach no XLA."""
    jax.devices()


def distributed(**fields):
    return fleetjax.DistributedStrategy(**fields)


CASES = {
    "fuse_grad_size_in_MB": (
        distributed(fuse_grad_size_in_MB=16),
        [f"--xla_gpu_all_reduce_combine_threshold_bytes={16 * MiB}"],
    ),
    "fuse_all_reduce_ops=True keeps Paddle's 32 MB buckets": (
        distributed(fuse_all_reduce_ops=True),
        [f"--xla_gpu_all_reduce_combine_threshold_bytes={32 * MiB}"],
    ),
    "fuse_all_reduce_ops=False": (
        distributed(fuse_all_reduce_ops=False, fuse_grad_size_in_MB=16),
        ["--xla_gpu_all_reduce_combine_threshold_bytes=0"],
    ),
    "fuse_grad_size_in_num": (
        distributed(fuse_grad_size_in_num=4),
        ["--xla_gpu_collective_combine_threshold_count=4"],
    ),
    "cudnn_exhaustive_search=False": (
        distributed(cudnn_exhaustive_search=False),
        ["--xla_gpu_autotune_level=0"],
    ),
    "cudnn_exhaustive_search=True is XLA's default": (
        distributed(cudnn_exhaustive_search=True),
        [],
    ),
    "calc_comm_same_stream": (
        distributed(calc_comm_same_stream=True),
        ["--xla_gpu_disable_async_collectives=ALLCOLLECTIVES"],
    ),
    "sharding comm_buffer_size_MB": (
        distributed(hybrid_configs={"sharding_configs": {"comm_buffer_size_MB": 64}}),
        [
            f"--xla_gpu_all_gather_combine_threshold_bytes={64 * MiB}",
            f"--xla_gpu_reduce_scatter_combine_threshold_bytes={64 * MiB}",
        ],
    ),
    "fuse_gemm_epilogue": (
        distributed(build_strategy={"fuse_gemm_epilogue": True}),
        ["--xla_gpu_enable_cublaslt=true"],
    ),
    "debug_graphviz_path": (
        distributed(build_strategy={"debug_graphviz_path": "/tmp/graphs"}),
        ["--xla_dump_to=/tmp/graphs", "--xla_dump_hlo_as_dot=true"],
    ),
    "Strategy fused_passes.gemm_epilogue": (
        fleetjax.Strategy({"fused_passes": {"enable": True, "gemm_epilogue": True}}),
        ["--xla_gpu_enable_cublaslt=true"],
    ),
    "Strategy gemm_epilogue without enable": (
        fleetjax.Strategy({"fused_passes": {"gemm_epilogue": True}}),
        [],
    ),
    "Strategy sharding.comm_buffer_size_MB": (
        fleetjax.Strategy({"sharding": {"comm_buffer_size_MB": 128}}),
        [
            f"--xla_gpu_all_gather_combine_threshold_bytes={128 * MiB}",
            f"--xla_gpu_reduce_scatter_combine_threshold_bytes={128 * MiB}",
        ],
    ),
    "defaults": (distributed(), []),
    "Strategy defaults": (fleetjax.Strategy(), []),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.filterwarnings("ignore::fleetjax.StrategyWarning")  # read_plan also says why
def test_each_knob_maps_to_its_flags(case):
    strategy, expected = CASES[case]
    assert [str(f) for f in read_plan(strategy).xla_flags] == expected


def test_this_jaxlib_knows_every_mapped_flag(every_flag_strategy):
    flags = read_plan(every_flag_strategy).xla_flags
    every_name = {text.split("=")[0][2:] for _, expected in CASES.values() for text in expected}
    assert {f.name for f in flags} == every_name
    assert xla_flags.refused(flags) == {}


def test_unknown_flags_and_bad_values_are_refused_with_jaxlibs_message():
    good = Flag("xla_gpu_autotune_level", "0", "good")
    unknown = Flag("xla_fleetjax_no_such_flag", "1", "unknown")
    bad_value = Flag("xla_gpu_autotune_level", "fast", "bad value")
    found = xla_flags.refused([good, unknown, bad_value])
    assert set(found) == {unknown, bad_value}
    assert "Unknown flag" in found[unknown] and "--xla_fleetjax_no_such_flag=1" in found[unknown]
    assert "fast" in found[bad_value]


def test_an_unknown_flag_is_never_set(monkeypatch):
    """`apply` as before the backend starts (simulated here), with one flag jaxlib lacks."""
    bogus = Flag("xla_fleetjax_no_such_flag", "1", "fuse_grad_size_in_MB=16")
    monkeypatch.setattr(xla_flags, "backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with pytest.warns(
        fleetjax.StrategyWarning,
        match=r"fuse_grad_size_in_MB=16 has no effect: the installed jaxlib refuses "
        r"--xla_fleetjax_no_such_flag=1 \(Unknown flag",
    ):
        flags = read_plan(distributed(fuse_grad_size_in_MB=16)).xla_flags
        applied = xla_flags.apply((*flags, bogus))
    threshold = f"--xla_gpu_all_reduce_combine_threshold_bytes={16 * MiB}"
    assert [str(f) for f in applied] == [threshold]
    assert os.environ["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {threshold}"


def test_a_late_flag_warns_once_and_changes_nothing(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # where the flag would matter
    strategy = distributed(fuse_grad_size_in_MB=16)
    with pytest.warns(
        fleetjax.StrategyWarning,
        match=r"too late for DistributedStrategy.fuse_grad_size_in_MB=16 "
        rf"\(--xla_gpu_all_reduce_combine_threshold_bytes={16 * MiB}\): JAX's backend already "
        r"started",
    ):
        fleet.Fleet().init(strategy=strategy)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fleet.Fleet().init(strategy=strategy)._xla_flags == ()


def test_a_late_gpu_flag_on_cpu_is_no_loss_and_says_nothing(monkeypatch):
    """Seed 003's order: fleet.init() first, the strategy later; XLA:CPU has no counterpart of
    the GPU flags, so nothing is lost by missing them."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flags = read_plan(distributed(fuse_all_reduce_ops=True)).xla_flags
        assert [f.knob for f in flags] == [
            "fuse_all_reduce_ops=True (Paddle's fuse_grad_size_in_MB=32)"
        ]
        assert xla_flags.apply(flags) == ()
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"


def test_a_flag_xla_flags_already_sets_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=2")
    with pytest.warns(
        fleetjax.StrategyWarning,
        match=r"XLA_FLAGS sets --xla_gpu_autotune_level=2, which wins over "
        r"DistributedStrategy.cudnn_exhaustive_search=False \(it asks for "
        r"--xla_gpu_autotune_level=0\)",
    ):
        assert (
            xla_flags.apply(read_plan(distributed(cudnn_exhaustive_search=False)).xla_flags) == ()
        )
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (applied,) = xla_flags.apply(
            read_plan(distributed(cudnn_exhaustive_search=False)).xla_flags
        )
    assert str(applied) == "--xla_gpu_autotune_level=0"


def test_a_value_an_earlier_apply_wrote_is_replaced_not_the_users(fresh_fleet, monkeypatch):
    """Seed 003's FLAGS_fuse_parameter_memory_size=16 sets a first fleet.init's threshold; a
    later strategy's fuse_grad_size_in_MB=64 wins over the flag, and its XLA flag replaces the
    one fleetjax wrote: one rule, one warning (no second one saying XLA_FLAGS wins)."""
    monkeypatch.setattr(xla_flags, "backend_started", lambda: False)  # as in a fresh process
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setenv("FLAGS_fuse_parameter_memory_size", "16")
    fresh_fleet.init()
    threshold = "--xla_gpu_all_reduce_combine_threshold_bytes={}"
    assert os.environ["XLA_FLAGS"].endswith(threshold.format(16 * MiB))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh_fleet.init(strategy=distributed(fuse_grad_size_in_MB=64))
    assert [str(w.message) for w in caught] == [
        "DistributedStrategy.fuse_grad_size_in_MB=64 wins over "
        "FLAGS_fuse_parameter_memory_size=16 (Paddle's strategy overwrites the flag too)"
    ]
    assert caught[0].filename == __file__  # the user's line, not fleetjax's
    assert os.environ["XLA_FLAGS"] == (
        f"--xla_force_host_platform_device_count=8 {threshold.format(64 * MiB)}"
    )
    monkeypatch.setenv("XLA_FLAGS", threshold.format(8 * MiB))  # the user's: it wins
    with pytest.warns(fleetjax.StrategyWarning, match=r"XLA_FLAGS sets .*=8388608, which wins"):
        fresh_fleet.init(strategy=distributed(fuse_grad_size_in_MB=64))


def test_defaults_apply_and_warn_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fleet.Fleet().init()._xla_flags == ()
        assert xla_flags.apply(read_plan(fleetjax.Strategy()).xla_flags) == ()


def test_backend_started():
    assert xla_flags.backend_started()
    assert jax.config.jax_num_cpu_devices == -1  # the probe leaves the setting as it was


# -- knobs with no JAX meaning ---------------------------------------------------------------


def non_default(path: str):
    """A value of the DistributedStrategy field `path` other than its default."""
    spec = fleetjax.DistributedStrategy.SPEC
    *parents, leaf = path.split(".")
    for name in parents:
        spec = spec.field(name).type
    field = spec.field(leaf)
    if field.type is bool:
        return not field.default
    return field.default * 2 if field.type is float else field.default + 1


def strategy_with(path: str, value) -> fleetjax.DistributedStrategy:
    strategy = fleetjax.DistributedStrategy()
    *parents, leaf = path.split(".")
    target = strategy
    for name in parents:
        target = target._get(name)
    target.update({leaf: value})
    return strategy


NOTED = ["sync_nccl_allreduce", "nccl_comm_num", "build_strategy.enable_inplace",
         "execution_strategy.num_threads", "hybrid_configs.mp_configs.sync_param"]  # fmt: skip


@pytest.mark.parametrize("path", NOTED)
def test_each_knob_without_jax_meaning_warns_once_saying_why(path):
    """Their reasons live in the schema; making a train step from the strategy warns."""
    *parents, leaf = path.split(".")
    spec = fleetjax.DistributedStrategy.SPEC
    for name in parents:
        spec = spec.field(name).type
    note = spec.field(leaf).note
    assert note
    value = non_default(path)
    strategy = strategy_with(path, value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        read_plan(strategy)
        read_plan(strategy)
    assert [str(w.message) for w in caught] == [
        f"DistributedStrategy.{path}={value!r} has no effect in fleetjax: {note}"
    ]
    assert all(w.category is fleetjax.StrategyWarning for w in caught)


@pytest.mark.parametrize("knob", [k for k in XLA_FUSES if k.startswith("Distributed")])
def test_fusions_xla_makes_warn_only_when_turned_off(knob):
    path = knob.removeprefix("DistributedStrategy.")
    default = fleetjax.BuildStrategy.SPEC.field(path.split(".")[-1]).default
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_plan(strategy_with(path, True))
        if not default:
            read_plan(strategy_with(path, False))
    if default:
        with pytest.warns(fleetjax.StrategyWarning, match=rf"{path}=False has no effect.*XLA"):
            read_plan(strategy_with(path, False))


def test_fused_passes_without_enable_warn():
    s = fleetjax.Strategy({"fused_passes": {"gemm_epilogue": True, "dropout_add": True}})
    with pytest.warns(fleetjax.StrategyWarning) as caught:
        read_plan(s)
    assert sorted(str(w.message) for w in caught) == [
        f"Strategy.fused_passes.{name}=True has no effect in fleetjax: fused passes apply only "
        "with fused_passes.enable=True, as in Paddle"
        for name in ("dropout_add", "gemm_epilogue")
    ]
    s.fused_passes.enable = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        read_plan(s)


def test_fleet_init_warns_for_knobs_without_jax_meaning():
    s = distributed(nccl_comm_num=2, execution_strategy={"num_threads": 4})
    with pytest.warns(fleetjax.StrategyWarning) as caught:
        fleet.Fleet().init(strategy=s)
    assert sorted(str(w.message).split(":")[0] for w in caught) == [
        "DistributedStrategy.execution_strategy.num_threads=4 has no effect in fleetjax",
        "DistributedStrategy.nccl_comm_num=2 has no effect in fleetjax",
    ]


# -- a fresh process: the flags reach XLA ----------------------------------------------------

FRESH = """
import json, os, warnings
import fleetjax
from fleetjax import fleet, xla_flags
graphs = os.environ["GRAPHS"]
started = xla_flags.backend_started()
s = fleetjax.DistributedStrategy(
    fuse_grad_size_in_MB=16, fuse_grad_size_in_num=4, cudnn_exhaustive_search=False,
    calc_comm_same_stream=True, build_strategy={"fuse_gemm_epilogue": True,
    "debug_graphviz_path": graphs})
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fleet.init(is_collective=True, strategy=s)
import jax
import optax
jax.block_until_ready(jax.jit(lambda x: x * 2)(1.0))
print(json.dumps({
    "started_before_init": started,
    "XLA_FLAGS": os.environ["XLA_FLAGS"],
    "applied": [str(f) for f in fleet.fleet._xla_flags],
    "warnings": [str(w.message) for w in caught],
    "devices": jax.device_count(),
    "dot_files": [f for f in os.listdir(graphs) if f.endswith(".dot")],
}))
"""


def test_fleet_init_in_a_fresh_process_sets_the_flags_before_the_backend_starts(tmp_path):
    graphs = tmp_path / "graphs"
    child = subprocess.run(
        [sys.executable, "-c", FRESH],
        env={**os.environ, "GRAPHS": str(graphs)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout.splitlines()[-1])
    expected = [
        f"--xla_gpu_all_reduce_combine_threshold_bytes={16 * MiB}",
        "--xla_gpu_collective_combine_threshold_count=4",
        "--xla_gpu_autotune_level=0",
        "--xla_gpu_disable_async_collectives=ALLCOLLECTIVES",
        "--xla_gpu_enable_cublaslt=true",
        f"--xla_dump_to={graphs}",
        "--xla_dump_hlo_as_dot=true",
    ]
    assert out["started_before_init"] is False
    assert out["applied"] == expected
    assert out["XLA_FLAGS"].split() == [*os.environ["XLA_FLAGS"].split(), *expected]
    assert out["warnings"] == []
    assert out["devices"] == 8  # the flags already there still count
    # XLA read the flags: it wrote the compiled modules where debug_graphviz_path says.
    assert out["dot_files"], "no .dot file in debug_graphviz_path"


def test_binding_to_a_given_mesh_leaves_xla_flags_alone(monkeypatch):
    """A mesh given means the backend started: only building the process's mesh (fleet.init,
    or a step made without a mesh) puts a strategy's flags into effect (`plan.prepare`)."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # where the flag would matter
    strategy = distributed(fuse_grad_size_in_MB=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fleetjax.distributed_optimizer(optax.sgd(0.1), strategy, fleetjax.build_mesh())
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    with pytest.warns(fleetjax.StrategyWarning, match="too late for DistributedStrategy.fuse_grad"):
        fleetjax.plan.prepare(strategy)
