"""A process of tests/tools/test_data.py: reads batches with fleetjax.data.Loader and prints them.

    python data_worker.py shards DEVICES FILES_DIR   # one of 1 or 2 processes (see below)
    python data_worker.py train DEVICES CKPT STEPS   # trains, saving every step; resumes

`shards`: with WORKER_RANK and JAX_COORDINATOR_ADDRESS set it joins 2 processes first. Prints,
per batch, `name: [this process's record ids, the global batch's]` (JSON), for arrays and for
the ArrayRecord files in FILES_DIR. `train`: a linear model trained with the
loader and a CheckpointManager; prints each step's loss and record ids, and resumes from the
newest intact checkpoint in CKPT, data position included.
"""

import io
import json
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(sys.argv[2]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import fleetjax  # noqa: E402
from fleetjax.checkpoint import CheckpointManager  # noqa: E402
from fleetjax.data import Loader  # noqa: E402

RECORDS, BATCH = 100, 16


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def dataset() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(RECORDS, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1
    return {"id": np.arange(RECORDS, dtype=np.int32), "x": x, "y": y}


def make_step() -> tuple[fleetjax.TrainStep, fleetjax.TrainState]:
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.05))
    return step, step.init({"w": np.zeros((4, 1), np.float32)})


def ids(batch: dict[str, jax.Array]) -> tuple[list[int], list[int]]:
    """(this process's ids, in global row order; the global batch's ids)."""
    shards = sorted(batch["id"].addressable_shards, key=lambda s: s.index[0].start or 0)
    local = list(dict.fromkeys(i for s in shards for i in np.asarray(s.data).tolist()))
    return local, multihost_utils.process_allgather(batch["id"], tiled=True).tolist()


def decode(record: bytes) -> dict[str, np.ndarray]:
    return {k: v[0] for k, v in np.load(io.BytesIO(record)).items()}


def report(name: str, value: object) -> None:
    """One result line, in the file the test names (Gloo's C++ logging writes to stdout too, in
    the middle of lines)."""
    with open(os.environ["DATA_WORKER_RESULTS"], "a") as results:
        results.write(f"{name}: {json.dumps(value)}\n")


def shards(files_dir: str) -> None:
    if "WORKER_RANK" in os.environ:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=2,
            process_id=int(os.environ["WORKER_RANK"]),
        )
    step, _ = make_step()
    with Loader(dataset(), step, BATCH, seed=5) as loader:
        report("rows", [loader.process_rows.start, loader.process_rows.stop])
        for i in range(9):  # an epoch is 6 batches: into the second
            report(f"arrays {i}", ids(next(loader)))
    files = sorted(os.path.join(files_dir, f) for f in os.listdir(files_dir))
    with Loader(files, step, BATCH, seed=5, transform=decode) as loader:
        report("files per epoch", loader.batches_per_epoch)
        for i in range(3):
            report(f"files {i}", ids(next(loader)))
    try:  # one file for two processes: each raises, neither waits for the other
        Loader(files[:1], step, BATCH, transform=decode)
    except ValueError as e:
        report("one file", str(e))
    multihost_utils.sync_global_devices("done")


def train(directory: str, steps: int) -> None:
    step, state = make_step()
    loader = Loader(dataset(), step, BATCH, seed=5, prefetch=3)
    manager = CheckpointManager(directory, max_to_keep=2)
    if manager.latest_step() is not None:
        done, state, extra = manager.restore_latest_intact(state)
        loader.set_state(extra["data"])
        print(f"resumed at step {done}", flush=True)
    while int(state.step) < steps:
        batch = next(loader)
        state, metrics = step(state, batch)
        done = int(state.step)
        manager.save(done, state, extra={"data": loader.get_state()})
        print(f"step {done}: loss {float(metrics['loss']):.9g} ids {ids(batch)[1]}", flush=True)
    manager.close()
    loader.close()


if __name__ == "__main__":
    if sys.argv[1] == "shards":
        shards(sys.argv[3])
    else:
        train(sys.argv[3], int(sys.argv[4]))
