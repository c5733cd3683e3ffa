"""Every test runs on 8 simulated CPU devices; the flags must be set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

import fleetjax
from fleetjax import _support

pytest_plugins = ["launching"]  # the `launcher` fixture of the tests that run fleetjax-run


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test sees each once-per-process strategy warning anew."""
    _support._warned.clear()
    yield


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
