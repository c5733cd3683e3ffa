"""Every test runs on 8 simulated CPU devices; the flags must be set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

import fleetjax

# pytest imported fleetjax, and so jax, before this file (pyproject's warning filter names
# fleetjax.StrategyWarning): jax's config read the environment before JAX_PLATFORMS was set
# above. No backend has started yet. Without this JAX would also try CUDA where jax's CUDA plugin
# is installed (the `aot` extra), and log the plugin's failed CUDA-library check.
jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])

# `launcher` (tests that run fleetjax-run), `two_hosts` (network namespaces as two hosts)
pytest_plugins = ["launching", "hosts"]


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
