"""The environment of a machine as a new user pastes code on it: this one without the device
settings of `conftest.py` (one CPU device), jax's CUDA plugin installed as the README's test
command leaves it."""

import os


def pasted_env() -> dict[str, str]:
    """os.environ without `JAX_PLATFORMS`, `JAX_NUM_CPU_DEVICES` and XLA's device count."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")}
    env["XLA_FLAGS"] = " ".join(
        f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f
    )
    return env
