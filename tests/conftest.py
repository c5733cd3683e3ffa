"""Every test runs on 8 simulated CPU devices; the flags must be set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

from fleetjax import _support


@pytest.fixture(autouse=True)
def _fresh_warnings():
    """Each test sees each once-per-process strategy warning anew."""
    _support._warned.clear()
    yield
