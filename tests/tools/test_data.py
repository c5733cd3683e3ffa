"""fleetjax.data.Loader: grain batches sharded per process, shuffled per epoch, placed like the
step's batch, prefetched while the step runs, resumed from a checkpoint, and refusing what does
not fit the step."""

import io
import json
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

import fleetjax
from fleetjax.checkpoint import CheckpointManager
from fleetjax.data import Loader

WORKER = [sys.executable, "-u", str(pathlib.Path(__file__).parents[1] / "data_worker.py")]
ENV = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
RECORDS = 100


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def make_step(strategy=None, loss=loss_fn):
    step = fleetjax.make_train_step(loss, optax.sgd(0.05), strategy)
    step.init({"w": np.zeros((4, 1), np.float32)})
    return step


@pytest.fixture(scope="module")
def step():
    return make_step()


def records(n=RECORDS):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return {"id": np.arange(n, dtype=np.int32), "x": x, "y": x[:, :1] * 2}


def ids(batch):
    return np.asarray(batch["id"]).tolist()


# -- what the batches are --------------------------------------------------------------------
def test_each_epoch_is_a_new_order_of_whole_global_batches(step):
    with Loader(records(), step, 16, seed=5) as loader:
        assert (loader.batches_per_epoch, loader.process_rows) == (6, range(16))
        epochs = [[ids(next(loader)) for _ in range(6)] for _ in range(3)]
        assert (loader.batches, loader.samples, loader.epoch) == (18, 288, 3.0)
    for epoch, batches in enumerate(epochs):
        read = [i for batch in batches for i in batch]
        assert len(set(read)) == 96  # no record twice in an epoch; 4 left out of it
        # Epoch e is grain's shuffle of the records with seed 5 + e.
        order = grain.MapDataset.range(RECORDS).shuffle(seed=5 + epoch)
        assert read == [order[i] for i in range(96)]
    assert epochs[0] != epochs[1] != epochs[2]


def test_batches_are_global_arrays_placed_like_the_steps_batch(step):
    with Loader(records(), step, 16, seed=1) as loader:
        batch = next(loader)
    assert set(batch) == {"id", "x", "y"}
    for leaf in batch.values():
        assert isinstance(leaf, jax.Array) and leaf.shape[0] == 16
        assert leaf.sharding.is_equivalent_to(step.batch_sharding, leaf.ndim)
    expected = records()
    np.testing.assert_array_equal(np.asarray(batch["x"]), expected["x"][ids(batch)])


def test_unshuffled_epochs_repeat_in_order_and_end(step):
    with Loader(records(40), step, 16, shuffle=False, num_epochs=2) as loader:
        read = [ids(batch) for batch in loader]
    first = [list(range(16)), list(range(16, 32))]
    assert read == first + first


def test_a_grain_dataset_and_a_transform(step):
    source = grain.MapDataset.source(records()["x"]).map(lambda x: {"x": x, "y": x[:1]})
    threads = set()

    def transform(record):
        threads.add(threading.current_thread().name)
        return {**record, "y": record["y"] * 3}

    with Loader(source, step, 8, seed=0, transform=transform) as loader:
        threads.clear()  # the check of the first batch against the loss read it here
        batch = next(loader)
    np.testing.assert_allclose(np.asarray(batch["y"]), np.asarray(batch["x"])[:, :1] * 3)
    assert threads and threading.current_thread().name not in threads  # in the background


def write_files(directory, sizes):
    """ArrayRecord files of npz records with consecutive ids; `sizes` records in each."""
    data, start = records(sum(sizes)), 0
    for number, size in enumerate(sizes):
        writer = ArrayRecordWriter(str(directory / f"part-{number}"), "group_size:1")
        for i in range(start, start + size):
            buffer = io.BytesIO()
            np.savez(buffer, **{k: v[i : i + 1] for k, v in data.items()})
            writer.write(buffer.getvalue())
        writer.close()
        start += size
    return sorted(str(p) for p in directory.iterdir())


def decode(record):
    return {k: v[0] for k, v in np.load(io.BytesIO(record)).items()}


def test_a_list_of_array_record_files(step, tmp_path):
    files = write_files(tmp_path, [20, 30, 14])
    with Loader(files, step, 16, seed=2, transform=decode) as loader:
        assert loader.batches_per_epoch == 4
        read = [i for _ in range(4) for i in ids(next(loader))]
    assert len(set(read)) == 64 - 64 % 16 == 64


# -- prefetch --------------------------------------------------------------------------------
def slow(record):
    time.sleep(0.004)  # 32 ms for a batch of 8: waiting on storage, say
    return record


@pytest.mark.parametrize(("prefetch", "waits"), [(0, True), (2, False)])
def test_prefetch_reads_the_next_batches_while_the_step_runs(step, prefetch, waits):
    with Loader(records(), step, 8, transform=slow, prefetch=prefetch) as loader:
        next(loader)
        waited = []
        for _ in range(5):
            time.sleep(0.08)  # the step
            next(loader)
            waited.append(loader.last_wait_s)
    if waits:
        assert min(waited) > 0.03, waited
    else:
        assert max(waited) < 0.02, waited


def test_an_error_in_the_transform_reaches_the_loop(step):
    def broken(record):
        if record["id"] == 12:
            raise RuntimeError("record 12 is damaged")
        return record

    with Loader(records(), step, 8, shuffle=False, transform=broken) as loader:
        next(loader)
        with pytest.raises(RuntimeError, match="record 12 is damaged"):
            next(loader)


def test_a_transform_that_returns_another_shape_names_the_record_and_the_leaf(step):
    # grain would say only "Expected all input elements to have the same structure".
    def cut(record):
        return {**record, "x": record["x"][:3]} if record["id"] == 13 else record

    def grows(record):
        return {**record, "extra": np.float32(1)} if record["id"] == 13 else record

    with Loader(records(), step, 8, shuffle=False, transform=cut) as loader:
        next(loader)
        with pytest.raises(
            ValueError,
            match=r"^the loader's transform returned for record 13 another tree, shape or dtype "
            r"than for record 0, so they cannot be stacked into a batch: \['x'\]: float32\[3\] "
            r"\(record 0: float32\[4\]\)",
        ):
            next(loader)
    with Loader(records(), step, 8, shuffle=False, transform=grows, prefetch=0) as loader:
        next(loader)
        with pytest.raises(ValueError, match=r"\['extra'\]: float32\[\] \(record 0: missing\)"):
            next(loader)


# -- resuming --------------------------------------------------------------------------------
def test_the_state_resumes_at_the_next_unseen_batch(step, tmp_path):
    loader = Loader(records(), step, 16, seed=3, prefetch=3)
    for _ in range(8):
        next(loader)
    time.sleep(0.2)  # the prefetch thread reads ahead; the state is that of the batches yielded
    with CheckpointManager(tmp_path) as manager:
        manager.save(8, {"w": jnp.zeros(2)}, extra={"data": loader.get_state()})
    expected = [ids(next(loader)) for _ in range(6)]
    loader.close()
    _, extra = CheckpointManager(tmp_path, read_only=True).restore({"w": jnp.zeros(2)})
    assert extra["data"]["batches"] == 8
    with Loader(records(), step, 16, seed=3) as resumed:
        resumed.set_state(extra["data"])
        assert [ids(next(resumed)) for _ in range(6)] == expected
        assert resumed.batches == 14


def test_a_state_of_other_batches_is_refused(step):
    with Loader(records(), step, 16, seed=3) as loader:
        state = json.loads(json.dumps(loader.get_state()))
    with Loader(records(), step, 8, seed=4) as other:
        changed = r"global_batch_size: saved 16, now 8, seed: saved 3, now 4"
        with pytest.raises(ValueError, match=rf"saved by a loader with other batches \({changed}"):
            other.set_state(state)
        with pytest.raises(ValueError, match=r"not a Loader state .*: \['data_position'\]"):
            other.set_state({"data_position": 3})
    with pytest.raises(ValueError, match="the loader is closed"):
        next(other)


def _losses(lines):
    return [line for line in lines if line.startswith("step ")]


@pytest.mark.slow
def test_kill_at_a_random_step_and_resume_gives_the_same_losses_and_data(tmp_path):
    steps, kill_at = 14, random.Random().randint(2, 12)
    reference = subprocess.run(
        [*WORKER, "train", "8", str(tmp_path / "reference"), str(steps)],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    killed = subprocess.Popen(
        [*WORKER, "train", "8", str(tmp_path / "resumed"), str(steps)],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        before = []
        for line in killed.stdout:
            before.append(line.strip())
            if line.startswith(f"step {kill_at}:"):
                killed.send_signal(signal.SIGKILL)
                break
        killed.wait(timeout=60)
    finally:
        killed.kill()
        killed.communicate()
    assert killed.returncode == -signal.SIGKILL
    resumed = subprocess.run(
        [*WORKER, "train", "8", str(tmp_path / "resumed"), str(steps)],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stdout.splitlines()
    start = int(lines[0].removeprefix("resumed at step "))
    assert kill_at - 2 <= start <= kill_at  # saved asynchronously: the last one may be lost
    expected = _losses(reference.stdout.splitlines())
    assert len(expected) == steps
    assert _losses(before) == expected[:kill_at]
    assert _losses(lines) == expected[start:]


# -- several processes -----------------------------------------------------------------------
def _shards(files_dir, processes, logs):
    """Each process's output of `data_worker.py shards` over 8 devices in all."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(processes):
        results = logs / f"{processes}-{rank}.results"
        env = {
            **ENV,
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "DATA_WORKER_RESULTS": str(results),
        }
        if processes > 1:
            env["WORKER_RANK"] = str(rank)
        command = [*WORKER, "shards", str(8 // processes), str(files_dir)]
        with open(logs / f"{processes}-{rank}.log", "w") as log:
            procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=log))
    try:
        for proc in procs:
            proc.communicate(timeout=240)
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, (logs / f"{processes}-{rank}.log").read_text()
    outputs = [(logs / f"{processes}-{rank}.results").read_text() for rank in range(processes)]
    return [
        {name: json.loads(value) for name, _, value in map(_split, out.splitlines())}
        for out in outputs
    ]


def _split(line):
    return line.partition(": ")


def test_two_processes_read_disjoint_shards_of_one_processs_batches(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    write_files(files, [24, 20, 24])  # 2 files for the first process, 1 for the second
    one, (first, second) = _shards(files, 1, tmp_path)[0], _shards(files, 2, tmp_path)
    assert first["rows"] == [0, 8] and second["rows"] == [8, 16] and one["rows"] == [0, 16]
    for i in range(9):
        (mine, whole), (theirs, whole_too) = first[f"arrays {i}"], second[f"arrays {i}"]
        assert whole == whole_too == one[f"arrays {i}"][1]  # batch for batch
        assert mine + theirs == whole and not set(mine) & set(theirs)
    # Files: each process its own (file_shard: files 0-1, file 2), its batch rows from them.
    # As many batches as the second process's 24 records give: 3 (of 5 the first could read).
    assert first["files per epoch"] == second["files per epoch"] == 3
    for i in range(3):
        (mine, whole), (theirs, _) = first[f"files {i}"], second[f"files {i}"]
        assert set(mine) <= set(range(44)) and set(theirs) <= set(range(44, 68))
        assert whole == mine + theirs and len(mine) == len(theirs) == 8
    # Fewer files than processes: both refuse, naming the one left without.
    assert first["one file"] == second["one file"]
    assert re.match(
        r"process 1's files \[\] has 0 records, fewer than one global batch needs "
        r"\(8 rows of global_batch_size=16\)$",
        first["one file"],
    )


# -- bad input -------------------------------------------------------------------------------
def test_a_dataset_smaller_than_one_global_batch(step):
    with pytest.raises(ValueError, match=r"^the dataset has 12 records, fewer than one global "):
        Loader(records(12), step, 16)


def test_a_file_smaller_than_its_share_of_a_global_batch(step, tmp_path):
    files = write_files(tmp_path, [5, 4])
    with pytest.raises(
        ValueError,
        match=r"process 0's files \[.*part-0', .*part-1'\] has 9 records, fewer than one "
        r"global batch needs \(global_batch_size=16\)",
    ):
        Loader(files, step, 16, transform=decode)


@pytest.mark.parametrize(
    ("strategy", "size", "message"),
    [
        (None, 12, r"global_batch_size=12 does not split evenly over the 8 data-parallel "),
        (
            fleetjax.DistributedStrategy(
                gradient_merge=True, gradient_merge_configs={"k_steps": 4, "mode": "in_step"}
            ),
            16,
            r"global_batch_size=16 does not split into gradient_merge k_steps=4 micro-batches "
            r"on each of the 8 data-parallel devices \(dp=8 x sharding=1\): give a multiple "
            r"of 32",
        ),
    ],
)
def test_a_batch_size_that_does_not_split_as_the_step_splits_it(strategy, size, message):
    with pytest.raises(ValueError, match=message):
        Loader(records(), make_step(strategy), size)


def test_a_batch_size_other_than_the_pipelines():
    strategy = fleetjax.DistributedStrategy(
        pipeline=True, pipeline_configs={"micro_batch_size": 2, "accumulate_steps": 4}
    )
    strategy.hybrid_configs = {"dp_degree": 2, "pp_degree": 4}
    layer = fleetjax.PipelineLayer(
        lambda p, b: b["x"] @ p, lambda p, h: h @ p, lambda p, h, b: jnp.mean((h - b["y"]) ** 2)
    )
    step = fleetjax.make_train_step(layer, optax.sgd(0.1), strategy)
    with pytest.raises(
        ValueError,
        match=r"global_batch_size=32, but the pipeline takes 2 data-parallel replicas \(dp=2 x "
        r"sharding=1\) x micro_batch_size=2 x accumulate_steps=4 = 16 rows per step",
    ):
        Loader(records(), step, 32)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"z": records()["x"]},
            r"the loader's batches \{'z': 'float32\[16, 4\]'\} do not fit the step's loss: "
            r"KeyError: 'x'",
        ),
        (
            {"x": records()["x"][:, :3], "y": records()["y"]},
            r"batches \{'x': 'float32\[16, 3\]', 'y': 'float32\[16, 1\]'\} do not fit the "
            r"step's loss: TypeError: dot_general requires contracting dimensions to have the "
            r"same shape, got \(3,\) and \(4,\)",
        ),
    ],
)
def test_records_that_do_not_fit_the_loss(step, data, message):
    with pytest.raises(ValueError, match=message):
        Loader(data, step, 16)


def test_the_records_are_checked_once_the_step_has_a_state():
    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.05))
    loader = Loader({"z": records()["x"]}, step, 16)
    with pytest.raises(ValueError, match=r"call step.init\(params\) before reading batches"):
        next(loader)
    step.init({"w": np.zeros((4, 1), np.float32)})
    with pytest.raises(ValueError, match=r"do not fit the step's loss: KeyError: 'x'"):
        next(loader)
    loader.close()


@pytest.mark.parametrize(
    ("source", "kwargs", "error", "message"),
    [
        (grain.MapDataset.range(64).to_iter_dataset(), {}, TypeError, r"can only be read in "),
        (3, {}, TypeError, r"^source is int; give a grain MapDataset, a data source"),
        (
            {"x": np.zeros((64, 4)), "y": np.zeros((60, 1))},
            {},
            ValueError,
            r"different numbers of records: \{\"\['x'\]\": 64, \"\['y'\]\": 60\}",
        ),
        (grain.MapDataset.range(64).repeat(), {}, ValueError, r"^source is infinite"),
        (records(), {"seed": -1}, ValueError, r"^seed must be an int in \[0, 2\*\*32\), got -1"),
        (records(), {"prefetch": -1}, ValueError, r"^prefetch must be an int >= 0, got -1"),
        (records(), {"num_epochs": 0}, ValueError, r"^num_epochs must be an int >= 1, got 0"),
    ],
)
def test_bad_arguments(step, source, kwargs, error, message):
    with pytest.raises(error, match=message):
        Loader(source, step, 16, **kwargs)
