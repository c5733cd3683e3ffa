"""A process that dies during a checkpoint save, for tests/test_checkpoint.py.

    checkpoint_worker.py DIR

Saves checkpoint 1 (w = 1) and waits for it; starts the background save of checkpoint 2
(w = 2, 64 MB) and kills itself with SIGKILL as soon as `save` returns, while the files are
being written.
"""

import os
import signal
import sys

import jax

jax.config.update("jax_num_cpu_devices", 1)

import jax.numpy as jnp  # noqa: E402

from fleetjax.checkpoint import CheckpointManager  # noqa: E402


def main(directory: str) -> None:
    manager = CheckpointManager(directory, async_save=True)
    manager.save(1, {"w": jnp.ones((4096, 4096))}, {"data_position": 1})
    manager.wait_until_finished()
    manager.save(2, {"w": jnp.full((4096, 4096), 2.0)}, {"data_position": 2})
    print(f"saving 2: {sorted(os.listdir(directory))}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1])
