"""Processes that die while they write checkpoints, for tests/base/test_checkpoint*.py.

    checkpoint_worker.py MODE DIR

Modes:
  die-saving: saves checkpoint 1 (w = 1) and waits for it; starts the background save of
    checkpoint 2 (w = 2, 64 MB) and kills itself with SIGKILL as soon as `save` returns, while
    the files are being written.
  die-deleting: with max_to_keep=1, saves checkpoints 1 and 2; the deletion of checkpoint 1
    kills the process with SIGKILL after removing one of its files.
  hold: opens DIR as a writer, prints "holding" and sleeps until it is killed.
  save-forever: saves checkpoints `value(step)` for step = latest + 1, latest + 2, ... with
    max_to_keep=2, printing "saved <step>" once each is complete, until it is killed.
  resume: opens DIR as a writer and resumes a state of test_checkpoint_faults.py's tree
    (`state_of`), printing as JSON the step, or the error, and the warnings.
"""

import json
import os
import shutil
import signal
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from fleetjax.checkpoint import CheckpointManager


def value(step: int) -> np.ndarray:
    """The array that save-forever saves as checkpoint `step` (4 MB)."""
    return np.random.default_rng(step).standard_normal((1024, 1024), dtype=np.float32)


def die_saving(directory: str) -> None:
    manager = CheckpointManager(directory, async_save=True)
    manager.save(1, {"w": jnp.ones((4096, 4096))}, {"data_position": 1})
    manager.wait_until_finished()
    manager.save(2, {"w": jnp.full((4096, 4096), 2.0)}, {"data_position": 2})
    print(f"saving 2: {sorted(os.listdir(directory))}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def die_deleting(directory: str) -> None:
    def rmtree_then_die(path: str, *args: object, **kwargs: object) -> None:
        os.remove(os.path.join(path, "fleetjax", "manifest.json"))
        print(f"deleting: {sorted(os.listdir(directory))}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    with CheckpointManager(directory, max_to_keep=1, async_save=False) as manager:
        manager.save(1, {"w": jnp.ones(8)})
        shutil.rmtree = rmtree_then_die
        manager.save(2, {"w": jnp.full(8, 2.0)})


def hold(directory: str) -> None:
    CheckpointManager(directory)
    print("holding", flush=True)
    time.sleep(600)


def save_forever(directory: str) -> None:
    manager = CheckpointManager(directory, max_to_keep=2)
    print("ready", flush=True)
    step = (manager.latest_step() or 0) + 1
    while True:
        manager.save(step, {"w": jnp.asarray(value(step))}, {"step": step})
        manager.wait_until_finished()
        print(f"saved {step}", flush=True)
        step += 1


def resume(directory: str) -> None:
    target = {
        "w": jnp.zeros((512, 512)),
        "b": {"c": jnp.zeros(10, jnp.int32), "flag": jnp.zeros(2, bool)},
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            resumed = CheckpointManager(directory).resume(target)
            out = {"step": None if resumed is None else resumed[0]}
        except Exception as e:
            out = {"error": type(e).__name__, "message": str(e)}
    print(json.dumps({**out, "warnings": [str(w.message) for w in caught]}))


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 1)
    mode, directory = sys.argv[1:]
    modes = {
        "die-saving": die_saving,
        "die-deleting": die_deleting,
        "hold": hold,
        "save-forever": save_forever,
        "resume": resume,
    }
    modes[mode](directory)
