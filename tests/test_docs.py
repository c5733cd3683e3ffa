"""The documentation states what the code does."""

import os
import pathlib
import re
import subprocess
import sys

import fleetjax

ROOT = pathlib.Path(__file__).parents[1]


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


def test_readme_quickstart_runs(tmp_path):
    readme = (ROOT / "README.md").read_text()
    quickstart = re.search(r"## Quickstart\n.*?```python\n(.*?)```", readme, re.DOTALL)[1]
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    result = subprocess.run(
        [sys.executable, "-c", quickstart], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert "reduce-scatter" in result.stdout  # ZeRO-2: the gradients end in their shards
