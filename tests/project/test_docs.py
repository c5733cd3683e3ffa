"""The documentation states what the code does."""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from pasted import pasted_env

import fleetjax

ROOT = pathlib.Path(__file__).parents[2]


def test_every_seed_default_difference_is_documented():
    table = (ROOT / "docs" / "differences.md").read_text()
    for path, ours, paddle in fleetjax.seed_default_differences():
        row = next((line for line in table.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"{path} is missing from docs/differences.md"
        assert str(ours) in row and str(paddle) in row, row


def test_readme_has_exactly_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("<!-- main-command -->") == 1
    assert readme.count("<!-- test-command -->") == 1
    assert "examples/train_digits.py" in readme


def _slug(heading: str) -> str:
    """The anchor GitHub and mkdocs give a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#([^)]+))?\)", readme)
    assert len(links) > 20
    for path, anchor in links:
        target = ROOT / path
        assert target.exists(), f"README links to a missing file: {path}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), flags=re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, f"README links to {path}#{anchor}"


def test_readme_quickstart_runs_as_pasted_on_one_device():
    readme = (ROOT / "README.md").read_text()
    quickstart = re.search(r"## Quickstart\n.*?```python\n(.*?)```", readme, re.DOTALL)[1]
    result = subprocess.run(
        [sys.executable, "-c", quickstart],
        env=pasted_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "reduce-scatter" in result.stdout  # ZeRO-2: the gradients end in their shards


# -- every shell command the README shows ------------------------------------------------------

MAIN_COMMAND = (
    'python3 -m venv .venv && .venv/bin/pip install -e ".[examples]" && '
    ".venv/bin/python examples/train_digits.py"
)
TEST_COMMAND = (
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/ruff check . && '
    ".venv/bin/ruff format --check . && .venv/bin/python -m pytest -n 2 && "
    ".venv/bin/python -m pytest -n 2 -m slow"
)
TWO_PROCESSES = (
    ".venv/bin/fleetjax-run --nproc_per_node 2 --cpu_devices_per_proc 4 examples/train_digits.py"
)
# How each command is checked: a test below runs it, or why none can.
README_COMMANDS = {
    MAIN_COMMAND: "test_readme_main_command_in_a_fresh_copy",
    TEST_COMMAND: "CI: .ci/run runs it in a fresh clone (it is this test suite)",
    TWO_PROCESSES: "test_readme_two_process_command",
    ".venv/bin/fleetjax-run --gpus 0,1,2,3 train.py": "needs 4 GPUs and the user's train.py",
    ".venv/bin/fleetjax-run --ips 10.0.0.1,10.0.0.2 train.py": "needs two machines",
    ".venv/bin/fleetjax-run --master 10.0.0.1:8090 --nnodes 2 train.py": "needs two machines",
    "srun python train.py": "needs a SLURM cluster",
}


def _readme_commands() -> list[str]:
    """The commands of the README's fenced bash blocks, without their comments."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    lines = (line.split(" #")[0].strip() for block in blocks for line in block.splitlines())
    return [line for line in lines if line]


def test_every_readme_command_is_checked():
    assert sorted(_readme_commands()) == sorted(README_COMMANDS)
    tests = {name for name in globals() if name.startswith("test_")}
    assert {how for how in README_COMMANDS.values() if how.startswith("test_")} <= tests
    # CI runs the test command: the fenced block after the <!-- test-command --> marker.
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()


def _as_pasted(command: str, cwd: pathlib.Path, **env: str) -> subprocess.CompletedProcess:
    """`command` run by bash in `cwd`, in the environment of a machine with one CPU device."""
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env={**pasted_env(), **env},
        capture_output=True,
        text=True,
        timeout=1200,
    )


@pytest.mark.slow
def test_readme_main_command_in_a_fresh_copy(tmp_path):
    """A copy of the repository's files (no .venv), and the README's command as pasted."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for name in listed:
        if (ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp_path / name)
    result = _as_pasted(MAIN_COMMAND, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert "test accuracy" in summary and "8 cpu devices" in summary, summary
    assert "applied:" in result.stdout  # the strategy in effect


@pytest.mark.slow
def test_readme_two_process_command(tmp_path):
    """The README's fleetjax-run command as pasted, from a directory whose `.venv` is this
    environment and `examples` this checkout's: both workers end with the same summary."""
    (tmp_path / ".venv").symlink_to(sys.prefix)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    # PYTHONPATH: this checkout's fleetjax, in the workers too.
    result = _as_pasted(TWO_PROCESSES, tmp_path, PYTHONPATH=str(ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    summaries = [
        (tmp_path / "log" / f"workerlog.{i}").read_text().strip().splitlines()[-1] for i in (0, 1)
    ]
    assert "test accuracy" in summaries[0] and "8 cpu devices" in summaries[0], summaries
    losses = [summary.split(" | ")[0] for summary in summaries]
    assert losses[0] == losses[1], summaries
    # Gloo's connection lines stay in the logs, off the console (which echoes worker 0).
    assert "[Gloo] Rank 0 is connected" in (tmp_path / "log" / "workerlog.0").read_text()
    assert "[Gloo]" not in result.stdout and "ERROR" not in result.stderr, result.stderr
