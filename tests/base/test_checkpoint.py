"""fleetjax.checkpoint: round trips, restoring onto other meshes, keep-N / every-k / async
saves, a kill during a save, and resuming a killed training run with the same losses."""

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import fleetjax
from fleetjax.checkpoint import CheckpointManager, load_persistables, save_persistables
from fleetjax.mesh import build_mesh

HERE = pathlib.Path(__file__).parents[1]  # the tests folder: its workers and data
EXAMPLE = HERE.parent / "examples" / "train_digits.py"
ENV = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def trained_state(steps=2):
    """A TrainState after `steps` Adam steps, replicated over dp=8."""
    rng = np.random.RandomState(0)
    params = {
        "w1": rng.randn(16, 32).astype(np.float32),
        "b1": rng.randn(32).astype(np.float32),
        "w2": rng.randn(32, 4).astype(np.float32),
    }
    step = fleetjax.make_train_step(loss_fn, optax.adam(1e-2))
    state = step.init(params, seed=7)
    for _ in range(steps):
        batch = {"x": rng.randn(64, 16).astype(np.float32), "y": rng.randn(64, 4)}
        state, _ = step(state, batch)
    return state


def assert_same_values(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == e.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def abstract_like(state, mesh, spec_of):
    """ShapeDtypeStructs of `state` on `mesh`, each with `spec_of(leaf name, leaf)`."""

    def leaf(path, x):
        name = getattr(path[-1], "key", None)
        sharding = NamedSharding(mesh, spec_of(name, x))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(leaf, state)


def test_save_and_load_persistables(tmp_path):
    state = trained_state()
    save_persistables(tmp_path / "ckpt", state)
    restored = load_persistables(tmp_path / "ckpt", trained_state(steps=0))
    assert isinstance(restored, fleetjax.TrainState)
    assert int(restored.step) == 2
    assert_same_values(restored, state)
    assert restored.params["w1"].sharding == state.params["w1"].sharding


def test_save_persistables_replaces_the_previous_save(tmp_path):
    first, second = trained_state(steps=1), trained_state(steps=3)
    save_persistables(tmp_path, first)
    save_persistables(tmp_path, second)
    assert_same_values(load_persistables(tmp_path, first), second)
    assert CheckpointManager(tmp_path, read_only=True).all_steps() == [2]  # version 1 is gone


def _tensor_parallel(name, x):
    # Megatron-style: w1 split by columns, w2 by rows, b1 with w1; scalars replicated.
    return {
        "w1": PartitionSpec(None, "mp"),
        "b1": PartitionSpec("mp"),
        "w2": PartitionSpec("mp", None),
    }.get(name, PartitionSpec())


def _zero(name, x):
    # ZeRO-like: the first dimension of every array over the `sharding` axis.
    return PartitionSpec("sharding") if x.ndim and x.shape[0] % 4 == 0 else PartitionSpec()


@pytest.mark.parametrize(
    "mesh_of, spec_of, local_shape",
    [
        (lambda: build_mesh(dp=2, mp=4), _tensor_parallel, (16, 8)),
        (lambda: build_mesh(dp=2, sharding=4), _zero, (4, 32)),
        (
            lambda: build_mesh(dp=4, devices=jax.devices()[:4]),
            lambda n, x: PartitionSpec(),
            (16, 32),
        ),
    ],
    ids=["dp2-mp4", "dp2-sharding4", "4-devices"],
)
def test_restore_onto_another_mesh(tmp_path, mesh_of, spec_of, local_shape):
    state = trained_state()  # saved replicated over dp=8
    save_persistables(tmp_path, state)
    mesh = mesh_of()
    target = abstract_like(state, mesh, spec_of)
    restored = load_persistables(tmp_path, target)
    assert_same_values(restored, state)
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True):
        assert got.sharding == want.sharding
    # Each device holds only its part of w1 (and of Adam's moments of it).
    for w1 in (restored.params["w1"], restored.opt_state[0].mu["w1"]):
        assert {s.data.shape for s in w1.addressable_shards} == {local_shape}
        assert {s.device for s in w1.addressable_shards} == set(mesh.devices.flat)


def test_manager_keeps_n_saves_every_k_steps_in_the_background(tmp_path):
    sharding = NamedSharding(build_mesh(), PartitionSpec())
    states = {i: {"x": jax.device_put(jnp.full(3, float(i)), sharding)} for i in range(1, 11)}
    with CheckpointManager(tmp_path, max_to_keep=2, save_interval_steps=3) as manager:
        saved = [
            step
            for step, state in states.items()
            if manager.save(step, state, {"data_position": 7 * step}, force=step == 10)
        ]
    assert saved == [3, 6, 9, 10]
    manager = CheckpointManager(tmp_path)
    assert manager.all_steps() == [9, 10]
    assert manager.latest_step() == 10
    state, extra = manager.restore(states[1])
    assert_same_values(state, states[10])
    assert extra == {"data_position": 70}
    state, extra = manager.restore(states[1], step=9)
    assert_same_values(state, states[9])
    assert extra == {"data_position": 63}
    with pytest.raises(ValueError, match="already exists"):
        manager.save(10, states[10])
    # max_to_keep=3 and three newer: step 1 would be pruned as soon as it is written.
    manager.save(8, states[8], force=True)
    message = (
        r"^checkpoint 1 would be deleted at once: .* keeps the newest max_to_keep=3 "
        r"and holds 3 newer \(\[8, 9, 10\]\)"
    )
    with pytest.raises(ValueError, match=message):
        manager.save(1, states[1], force=True)
    assert manager.all_steps() == [8, 9, 10]
    manager.close()


def test_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^max_to_keep must be a positive int or None, got 0$"):
        CheckpointManager(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match=r"^save_interval_steps must be a positive int, got 2.5$"):
        CheckpointManager(tmp_path, save_interval_steps=2.5)
    state = trained_state(steps=0)
    with pytest.raises(FileNotFoundError, match=r"\(complete checkpoints: none\)$"):
        load_persistables(tmp_path, state)
    save_persistables(tmp_path, state)
    with pytest.raises(
        FileNotFoundError, match=r"^no checkpoint 5 in .* \(complete checkpoints: \[1\]\)$"
    ):
        CheckpointManager(tmp_path, read_only=True).restore(state, step=5)

    wrong = state._replace(params={**state.params, "w1": jnp.zeros((16, 30)), "extra": jnp.ones(2)})
    message = (
        f"the checkpoint {tmp_path}/1 does not fit the target: params/extra is not in the "
        "checkpoint; params/w1 has shape (16, 32) in the checkpoint but (16, 30) in the target"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_persistables(tmp_path, wrong)
    with pytest.raises(ValueError, match=r"^the CheckpointManager of .* is read-only$"):
        CheckpointManager(tmp_path, read_only=True).save(2, state)
    host = state._replace(rng=np.zeros(2, np.uint32))
    with pytest.raises(TypeError, match=r"^target\.rng is ndarray; each target leaf must be"):
        load_persistables(tmp_path, host)


# -- crashes ---------------------------------------------------------------------------------
def test_a_kill_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    worker = subprocess.run(
        [sys.executable, str(HERE / "checkpoint_worker.py"), "die-saving", str(tmp_path)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == -signal.SIGKILL, worker.stderr
    assert "saving 2" in worker.stdout, worker.stderr
    # The save of 2 was cut short: only its temporary directory exists.
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("2")]
    assert leftovers and all("tmp" in name for name in leftovers), leftovers

    target = {"w": jnp.zeros((4096, 4096))}
    restored, extra = CheckpointManager(tmp_path, read_only=True).restore(target)
    assert extra == {"data_position": 1}
    np.testing.assert_array_equal(np.asarray(restored["w"]), 1.0)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("2")] == leftovers
    # A new writer cleans up the leftovers (a reader does not) and can save step 2.
    with CheckpointManager(tmp_path) as manager:
        manager.save(2, target, force=True)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name[0].isdigit()) == ["1", "2"]


def _losses(output: str) -> dict[int, str]:
    return dict((int(s), v) for s, v in re.findall(r"^step (\d+): loss (\S+)$", output, re.M))


@pytest.mark.slow  # 30 s; test_launch_restarts kills a worker and resumes by default
def test_resuming_after_a_kill_repeats_the_losses(tmp_path):
    args = [sys.executable, "-u", str(EXAMPLE), "--steps", "24", "--log-every", "1"]
    args += ["--hidden", "64"]
    resumable = [*args, "--checkpoint-dir", str(tmp_path), "--save-every", "5"]
    reference = subprocess.Popen(args, env=ENV, stdout=subprocess.PIPE, text=True)
    killed = subprocess.Popen(resumable, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        for line in killed.stdout:
            if line.startswith("step 17:"):
                killed.kill()
        reference_out = reference.communicate(timeout=300)[0]
    finally:
        for proc in (reference, killed):
            proc.kill()
            proc.communicate()
    assert killed.returncode == -signal.SIGKILL

    resumed = subprocess.run(resumable, env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    start = int(re.search(r"resumed from .* at step (\d+)", resumed.stdout).group(1))
    assert start in (5, 10, 15)
    expected = _losses(reference_out)
    assert list(expected) == list(range(1, 25))
    assert _losses(resumed.stdout) == {s: v for s, v in expected.items() if s > start}


@pytest.mark.slow
def test_a_two_process_checkpoint_resumes_in_one_process(tmp_path):
    """Saved by 2 processes x 4 devices (fleetjax.launch), resumed by 1 process x 8 devices."""
    args = [str(EXAMPLE), "--log-every", "5", "--hidden", "64", "--save-every", "10"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launched = subprocess.run(
        [sys.executable, "-m", "fleetjax.launch", "--nproc_per_node", "2",
         "--cpu_devices_per_proc", "4", "--start_port", str(port), "--log_dir",
         str(tmp_path / "log"), *args, "--steps", "10", "--checkpoint-dir", str(tmp_path / "c")],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    one = [sys.executable, *args, "--steps", "20", "--cpu-devices", "8"]
    resumed = subprocess.run(
        [*one, "--checkpoint-dir", str(tmp_path / "c")],
        env=ENV, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    reference = subprocess.run(one, env=ENV, capture_output=True, text=True, timeout=300)
    assert "at step 10" in resumed.stdout, resumed.stderr
    expected = _losses(reference.stdout)
    assert list(expected) == [5, 10, 15, 20]
    assert _losses(launched.stdout) == {5: expected[5], 10: expected[10]}
    assert _losses(resumed.stdout) == {15: expected[15], 20: expected[20]}
