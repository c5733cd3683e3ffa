"""The notebooks run top to bottom on the 8 simulated CPU devices they set up themselves, in
well under two minutes each, and are stored with the outputs of that run (plots included), which
the docs site shows.

A run stores its outputs in the notebook when the notebook's code changed since the stored run
(or with FLEETJAX_STORE_NOTEBOOKS=1); commit the notebooks it wrote. The check of the stored
outputs runs before the runs, so a notebook committed without its new outputs fails it.
"""

import ast
import hashlib
import json
import os
import pathlib
import time

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
SECONDS = 120  # each notebook's budget, whole and per cell
RUN = "fleetjax"  # the notebook metadata of the stored run: the digest of the code it ran
# Appended to each executed copy: the kernel must have the devices the notebook set up.
DEVICE_CHECK = """
import jax
assert jax.device_count() == 8, jax.devices()
assert jax.devices()[0].platform == "cpu", jax.devices()
"""


def _kernel_env() -> dict[str, str]:
    """This process's environment without the device settings of `conftest.py`, so that a
    notebook passes only if its own first cell sets them."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def test_the_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_hybrid_parallel_and_zero.ipynb",
        "03_pipeline_schedules.ipynb",
        "04_optimizers.ipynb",
        "05_migrating_from_paddle.ipynb",
        "06_input_pipeline.ipynb",
        "07_auto_parallel.ipynb",
    ]


def _code_digest(nb: nbformat.NotebookNode) -> str:
    code = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    return hashlib.sha256(json.dumps(code).encode()).hexdigest()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_with_the_outputs_of_its_code(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.get(RUN, {}).get("code_sha256") == _code_digest(nb), (
        f"{path.name}: its code changed since its stored outputs were made; run "
        "tests/project/test_notebooks.py, which stores the new ones, and commit the notebook"
    )
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    outputs = [output for cell in code for output in cell.outputs]
    assert not [output for output in outputs if output.output_type == "error"]
    if "plt." in "".join(cell.source for cell in code):  # its plots are stored as PNGs
        assert any("image/png" in output.get("data", {}) for output in outputs)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_sets_up_devices_before_importing_jax(path):
    nb = nbformat.read(path, as_version=4)
    first = next(cell.source for cell in nb.cells if cell.cell_type == "code")
    assert 'os.environ["JAX_NUM_CPU_DEVICES"] = "8"' in first
    assert 'os.environ["JAX_PLATFORMS"] = "cpu"' in first
    imports = [node for node in ast.walk(ast.parse(first)) if isinstance(node, ast.Import)]
    assert [alias.name for node in imports for alias in node.names] == ["os"]
    assert not any(isinstance(node, ast.ImportFrom) for node in ast.walk(ast.parse(first)))


# Run in the default suite; the others (30-60 s each) with `-m slow`. Every notebook's stored
# outputs are checked against its code in the default suite.
QUICK_TO_RUN = ("01_quickstart", "05_migrating_from_paddle")


@pytest.mark.parametrize(
    "path",
    [p if p.stem in QUICK_TO_RUN else pytest.param(p, marks=pytest.mark.slow) for p in NOTEBOOKS],
    ids=lambda p: p.stem,
)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    stored_digest = nb.metadata.get(RUN, {}).get("code_sha256")
    nb.cells.append(nbformat.v4.new_code_cell(DEVICE_CHECK))
    client = nbclient.NotebookClient(
        nb,
        timeout=SECONDS,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(path.parent)}},  # the kernel's working directory
    )
    start = time.perf_counter()
    client.execute(env=_kernel_env())  # raises CellExecutionError, naming the failed cell
    elapsed = time.perf_counter() - start
    nb.cells.pop()  # the device check
    if stored_digest != _code_digest(nb) or os.environ.get("FLEETJAX_STORE_NOTEBOOKS") == "1":
        nb.metadata[RUN] = {"code_sha256": _code_digest(nb)}
        nbformat.write(nb, path)
    assert elapsed < SECONDS, f"{path.name} took {elapsed:.0f} s"
