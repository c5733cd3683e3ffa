"""`save_state_dict` / `load_state_dict` reshard: a dict saved under one mesh and placements
loads bitwise under another (other devices, another mesh shape, pending sums), as Paddle's
versions (`unique_id`), with fleetjax's checksums catching damaged files."""

import numpy as np
import pytest

import fleetjax
import fleetjax.distributed as dist
from fleetjax.checkpoint import CorruptCheckpointError

R, P, S = dist.Replicate(), dist.Partial(), dist.Shard
SAVED_ON = dist.ProcessMesh([[0, 1, 2, 3], [4, 5, 6, 7]], dim_names=["dp", "mp"])
LOADED_ON = dist.ProcessMesh([6, 4, 2, 0], dim_names=["x"])
RNG = np.random.default_rng(31)
VALUES = {
    "w": RNG.standard_normal((8, 16)).astype(np.float32),
    "b": RNG.standard_normal((16,)).astype(np.float32),
    "opt": {"m": RNG.standard_normal((8, 16)).astype(np.float32)},
}


def saved() -> dict:
    return {
        "w": dist.shard_tensor(VALUES["w"], SAVED_ON, [S(0), S(1)]),
        "b": dist.shard_tensor(VALUES["b"], SAVED_ON, [P, S(0)]),  # a pending sum: saved summed
        "opt": {"m": dist.shard_tensor(VALUES["opt"]["m"], SAVED_ON, [R, S(0)])},
    }


def targets() -> dict:
    zeros = {k: np.zeros_like(v) for k, v in VALUES.items() if k != "opt"}
    return {
        "w": dist.shard_tensor(zeros["w"], LOADED_ON, [S(1)]),
        "b": dist.shard_tensor(zeros["b"], LOADED_ON, [P]),
        "opt": {"m": dist.shard_tensor(np.zeros((8, 16), np.float32), LOADED_ON, [R])},
    }


def bits(x) -> np.ndarray:
    return np.asarray(dist.unshard_dtensor(x)).view(np.uint32)


def test_saved_on_one_mesh_loaded_on_another_bitwise(tmp_path):
    dist.save_state_dict(saved(), str(tmp_path))
    loaded = targets()
    inner = loaded["opt"]
    dist.load_state_dict(loaded, str(tmp_path))
    assert loaded["opt"] is inner  # filled in place, nested dicts too
    assert [loaded["w"].placements, loaded["b"].placements, inner["m"].placements] == [
        [S(1)],
        [P],
        [R],
    ]
    assert loaded["w"].process_mesh == LOADED_ON
    for got, want in (
        (loaded["w"], VALUES["w"]),
        (loaded["b"], VALUES["b"]),
        (inner["m"], VALUES["opt"]["m"]),
    ):
        np.testing.assert_array_equal(bits(got), want.view(np.uint32))


def test_versions_as_paddles_unique_id(tmp_path):
    first = saved()
    dist.save_state_dict(first, str(tmp_path))
    second = {**first, "w": dist.shard_tensor(VALUES["w"] + 1, SAVED_ON, [S(0), S(1)])}
    dist.save_state_dict(second, str(tmp_path), async_save=True)
    newest, oldest = targets(), targets()
    dist.load_state_dict(newest, str(tmp_path))  # waits for the background save
    dist.load_state_dict(oldest, str(tmp_path), unique_id=0)
    np.testing.assert_array_equal(np.asarray(newest["w"]), VALUES["w"] + 1)
    np.testing.assert_array_equal(np.asarray(oldest["w"]), VALUES["w"])
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["0", "1"]
    with pytest.raises(ValueError, match="checkpoint 1 already exists"):
        dist.save_state_dict(first, str(tmp_path), unique_id=1)
    with pytest.raises(FileNotFoundError, match="no checkpoint 7"):
        dist.load_state_dict(targets(), str(tmp_path), unique_id=7)


def test_damaged_files_are_caught(tmp_path):
    dist.save_state_dict(saved(), str(tmp_path))
    for data in (tmp_path / "0" / "state").rglob("d/*"):  # OCDBT's data files
        damaged = bytearray(data.read_bytes())
        middle = len(damaged) // 2
        damaged[middle : middle + 16] = bytes(b ^ 0xFF for b in damaged[middle : middle + 16])
        data.write_bytes(damaged)
    with pytest.raises(CorruptCheckpointError, match="checkpoint 0 in .* is corrupt"):
        dist.load_state_dict(targets(), str(tmp_path))


def test_names_and_shapes_must_fit(tmp_path):
    dist.save_state_dict(saved(), str(tmp_path))
    wrong = targets()
    wrong["w"] = dist.shard_tensor(np.zeros((4, 16), np.float32), LOADED_ON, [S(0)])
    with pytest.raises(ValueError, match=r"w has shape \(8, 16\) in the checkpoint but \(4, 16\)"):
        dist.load_state_dict(wrong, str(tmp_path))


def test_paddles_other_arguments(tmp_path):
    with pytest.warns(
        fleetjax.StrategyWarning, match="save_state_dict's coordinator_rank=1 has no JAX meaning"
    ):
        dist.save_state_dict(saved(), str(tmp_path), coordinator_rank=1)
    with pytest.warns(
        fleetjax.StrategyWarning, match="load_state_dict's comm_method='send_recv' has no JAX"
    ):
        dist.load_state_dict(targets(), str(tmp_path), comm_method="send_recv")
    with pytest.raises(NotImplementedError, match="aoa_config"):
        dist.load_state_dict(targets(), str(tmp_path), aoa_config={"w": ["v"]})
    with pytest.raises(TypeError, match="takes a dict of tensors"):
        dist.save_state_dict([1], str(tmp_path))
