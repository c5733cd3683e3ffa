"""fleetjax.export: an exported model, loaded by fleetjax or by plain JAX without any fleetjax
or model code, gives the outputs of the original function."""

import itertools
import os
import pathlib
import re
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
from fleetjax import export
from fleetjax.export import load_inference_model, save_inference_model
from fleetjax.mesh import build_mesh

HERE = pathlib.Path(__file__).parents[1]  # the tests folder: its workers and data


# The exported program is compiled again (and for another platform's lowering rules), so each dot
# product's 64 and then 32 multiply-adds may be ordered or fused differently: float32 rounding
# then differs by up to about one ulp per term. One ulp was seen (relative 1.33e-6 on an AMD EPYC).
ROUNDING = {
    "rtol": 64 * float(np.finfo(np.float32).eps),
    "atol": 64 * float(np.finfo(np.float32).eps),
}


def logits_fn(params, images):
    h = images
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"].astype(h.dtype) + layer["b"])
    return h @ params[-1]["w"] + params[-1]["b"]


def make_params(sizes=(64, 32, 10), seed=0):
    rng = np.random.RandomState(seed)
    return [
        {
            "w": rng.randn(n_in, n_out).astype(np.float32) / 8,
            "b": rng.randn(n_out).astype(np.float32),
        }
        for n_in, n_out in itertools.pairwise(sizes)
    ]


def images(rows, seed=1):
    return np.random.RandomState(seed).rand(rows, 64).astype(np.float32)


def trained_params():
    """Parameters from a data-parallel step on 8 devices (replicated global arrays)."""

    def loss_fn(params, batch):
        logits = logits_fn(params, batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    step = fleetjax.make_train_step(loss_fn, optax.sgd(0.1))
    state = step.init(make_params())
    batch = {"image": images(32), "label": np.arange(32, dtype=np.int32) % 10}
    state, _ = step(state, batch)
    return state.params


def test_the_exported_model_gives_the_same_outputs(tmp_path):
    params = trained_params()
    save_inference_model(tmp_path, logits_fn, params, (images(16),))
    model = load_inference_model(tmp_path)
    for rows in (16, 5):  # any batch size: the leading dimension is symbolic
        np.testing.assert_allclose(model(images(rows)), logits_fn(params, images(rows)), **ROUNDING)
    assert str(model.exported.in_avals[-1]) == "float32[batch,64]"
    assert model.exported.platforms == ("cpu",)
    with np.load(tmp_path / export.PARAMS_FILE) as f:
        assert sorted(f.files) == ["0:[0]['b']", "1:[0]['w']", "2:[1]['b']", "3:[1]['w']"]


def _documented_loader() -> str:
    """The plain-JAX loader from fleetjax.export's docstring."""
    text = export.__doc__.split("with plain JAX and numpy it is:")[1]
    return "\n".join(line[4:] for line in text.splitlines() if line.startswith("    "))


def test_plain_jax_runs_the_export(tmp_path):
    params = trained_params()
    save_inference_model(tmp_path / "model", logits_fn, params, (images(16),))
    np.save(tmp_path / "inputs.npy", images(7))
    script = "\n".join(
        [
            "import sys",
            "import jax",
            "import numpy as np",
            f"dirname = {str(tmp_path / 'model')!r}",
            f"inputs = [np.load({str(tmp_path / 'inputs.npy')!r})]",
            _documented_loader(),
            f"np.save({str(tmp_path / 'outputs.npy')!r}, np.asarray(outputs))",
            "assert not [m for m in sys.modules if m.startswith('fleetjax')]",
        ]
    )
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=tmp_path,  # not the repository: nothing of it is importable
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    np.testing.assert_allclose(
        np.load(tmp_path / "outputs.npy"), logits_fn(params, images(7)), **ROUNDING
    )


def test_bfloat16_parameters_sharded_over_a_mesh(tmp_path):
    mesh = build_mesh(dp=2, mp=4)
    params = make_params()
    params[0]["w"] = jax.device_put(
        jnp.asarray(params[0]["w"], jnp.bfloat16), NamedSharding(mesh, PartitionSpec(None, "mp"))
    )
    params[1]["w"] = jax.device_put(params[1]["w"], NamedSharding(mesh, PartitionSpec("mp")))
    save_inference_model(tmp_path, logits_fn, params, (images(8),))
    model = load_inference_model(tmp_path)
    assert model.params[1].dtype == np.uint16  # stored as its bits; bit-cast inside
    # The reference computes on the mesh, the model on one device: rounding may differ.
    np.testing.assert_allclose(model(images(8)), logits_fn(params, images(8)), rtol=1e-5, atol=1e-6)


def test_fixed_shapes_and_other_platforms(tmp_path):
    params = make_params()
    save_inference_model(
        tmp_path, logits_fn, params, [images(4)], dynamic_batch=False, platforms=("cpu", "cuda")
    )
    model = load_inference_model(tmp_path)
    assert model.exported.platforms == ("cpu", "cuda")
    assert str(model.exported.in_avals[-1]) == "float32[4,64]"
    np.testing.assert_allclose(model(images(4)), logits_fn(params, images(4)), **ROUNDING)
    with pytest.raises(ValueError, match=re.escape("expected (4, 64) and called with (5, 64)")):
        model(images(5))


def test_errors(tmp_path):
    params = make_params()
    with pytest.raises(
        TypeError,
        match=r"^example_inputs must be a tuple or list of fn's positional inputs after params, "
        r"got ndarray$",
    ):
        save_inference_model(tmp_path, logits_fn, params, images(4))
    message = (
        "example_inputs[1] is a scalar, which has no batch dimension; pass dynamic_batch=False "
        "to export fixed shapes"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        save_inference_model(
            tmp_path, lambda p, x, t: logits_fn(p, x) / t, params, (images(4), 2.0)
        )
    assert not pathlib.Path(tmp_path, export.MODEL_FILE).exists()


def _cut_in_half(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_16_bytes(path, start=None):
    data = bytearray(path.read_bytes())
    start = len(data) // 2 if start is None else start
    data[start : start + 16] = bytes(b ^ 0xFF for b in data[start : start + 16])
    path.write_bytes(data)


def _flip_the_header(path):
    _flip_16_bytes(path, start=0)


def _flip_the_stablehlo(path):
    _flip_16_bytes(path, start=path.read_bytes().index(b"ML\xefR") + 16)  # MLIR bytecode


def _other_params(path):
    np.savez(path, **{f"{i}:{i}": x for i, x in enumerate(jax.tree.leaves(make_params()))})


def _one_param_more(path):
    leaves = [*jax.tree.leaves(make_params((64, 8, 10))), np.ones(2)]
    np.savez(path, **{f"{i}:{i}": x for i, x in enumerate(leaves)})


NOT_A_MODEL = "is not a model written by save_inference_model, or is damaged"
NOT_PARAMS = "is not a parameter file written by save_inference_model, or is damaged"


@pytest.mark.parametrize(
    "file, damage, problem",
    [
        (export.MODEL_FILE, _cut_in_half, rf"{NOT_A_MODEL} \(error: unpack_from requires"),
        (export.MODEL_FILE, _flip_the_header, rf"{NOT_A_MODEL} \(error: unpack_from requires"),
        (export.MODEL_FILE, _flip_the_stablehlo, rf"{NOT_A_MODEL} \(JaxRuntimeError: .*StableHLO"),
        (export.PARAMS_FILE, _cut_in_half, rf"{NOT_PARAMS} \(BadZipFile: File is not a zip"),
        (export.PARAMS_FILE, _flip_16_bytes, rf"{NOT_PARAMS} \(BadZipFile: Bad CRC-32 for file"),
        (export.PARAMS_FILE, _other_params, r": 0:0 is float32\[32\] but its model takes "
         r"float32\[8\]$"),
        (export.PARAMS_FILE, _one_param_more, r" holds 5 arrays but its model takes 4 parameters$"),
    ],
    ids=lambda x: x.__name__.strip("_") if callable(x) else None,
)  # fmt: skip
def test_damaged_files_are_named(tmp_path, file, damage, problem):
    params = make_params((64, 8, 10))
    save_inference_model(tmp_path, logits_fn, params, (images(2),))
    damage(tmp_path / file)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / file))}:? ?{problem}"):
        load_inference_model(tmp_path)


@pytest.mark.slow
def test_parameters_split_over_processes(tmp_path):
    """2 processes x 2 devices (fleetjax.launch), with a parameter no process holds whole."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-m", "fleetjax.launch", "--nproc_per_node", "2",
         "--cpu_devices_per_proc", "2", "--start_port", str(port), "--log_dir",
         str(tmp_path / "log"), str(HERE / "export_worker.py"), str(tmp_path / "model")],
        env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "exported" in run.stdout
    model = load_inference_model(tmp_path / "model")
    x = images(3)[:, :4]
    w = np.arange(32, dtype=np.float32).reshape(4, 8) / 32
    np.testing.assert_allclose(model(x), np.tanh(x @ w), **ROUNDING)
