"""Every test runs on 8 simulated CPU devices; the flags must be set before JAX starts."""

import os
import pathlib

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

import fleetjax

# pytest imported fleetjax, and so jax, before this file (pyproject's warning filter names
# fleetjax.StrategyWarning): jax's config read the environment before JAX_PLATFORMS was set
# above. No backend has started yet (it starts below). Without this JAX would also try CUDA
# where jax's CUDA plugin is installed (the `aot` extra), and log the plugin's failed
# CUDA-library check.
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

# The suite's programs are small and run a few steps each, so compiling them is most of its
# time: XLA's CPU backend without LLVM's optimizations (--xla_backend_optimization_level=0)
# compiles them 2 to 3 times faster (a test compares results computed in one process, under
# the same flag). XLA reads XLA_FLAGS once, as its backend starts, so the flag holds for this
# process alone: the scripts tests start (examples, docs, notebooks, workers) run as users run
# them, at XLA's defaults, and print the numbers their pages show.
_SCRIPTS_FLAGS = os.environ["XLA_FLAGS"]
os.environ["XLA_FLAGS"] = f"{_SCRIPTS_FLAGS} --xla_backend_optimization_level=0"
jax.devices()
os.environ["XLA_FLAGS"] = _SCRIPTS_FLAGS

# `launcher` (tests that run fleetjax-run), `two_hosts` (network namespaces as two hosts), the
# order tests start in (`start_order`)
pytest_plugins = ["launching", "hosts", "start_order"]


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test sees each once-per-process strategy warning anew."""
    fleetjax.StrategyWarning.reset()
    yield


@pytest.fixture
def fresh_fleet(monkeypatch):
    """A `Fleet` of its own in a process alone (no launcher's variables)."""
    for name in ("PADDLE_TRAINER_ID", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINERS_NUM"):
        monkeypatch.delenv(name, raising=False)
    jax.devices()  # so fleet.init leaves XLA_FLAGS alone: the backend already started
    return fleetjax.fleet.Fleet()


@pytest.fixture
def every_flag_strategy() -> fleetjax.DistributedStrategy:
    """A DistributedStrategy setting every knob that maps to an XLA flag."""
    return fleetjax.DistributedStrategy(
        fuse_grad_size_in_MB=16,
        fuse_grad_size_in_num=4,
        cudnn_exhaustive_search=False,
        calc_comm_same_stream=True,
        hybrid_configs={"sharding_configs": {"comm_buffer_size_MB": 64}},
        build_strategy={"fuse_gemm_epilogue": True, "debug_graphviz_path": "/tmp/graphs"},
    )


# Tests of the default selection that took over 15 s each under `pytest -n 2` on 2 cores
# (`--durations=0`), one node id a line: they run with the slow tests (`-m slow`), so that the
# default part of CI stays under 15 minutes. Regenerate it from a durations run when that drifts.
MEASURED_SLOW = frozenset(
    (pathlib.Path(__file__).parent / "slow_in_ci.txt").read_text().split("\n")
) - {""}


@pytest.hookimpl(tryfirst=True)  # before pytest's -m selection reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid in MEASURED_SLOW:
            item.add_marker(pytest.mark.slow)
