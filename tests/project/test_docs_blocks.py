"""Every python block of README.md and docs/*.md runs as pasted.

A block (indented ones in lists too) runs in a fresh Python process, in an empty directory, with
no device variables set (one CPU device, as a new user's machine: a block that needs more sets
them up itself) and prints no ERROR or traceback. The files a block leaves are not left by a
block of another page, so pasting pages one after another in one directory does not collide.
A block whose fence follows the marker line
`<!-- continues the block above -->` continues the page's block before it (the site renders
both, and hides the marker): the test runs the two as one script. Every other block is
complete on its own.
"""

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
from pasted import pasted_env

ROOT = pathlib.Path(__file__).parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CONTINUES = "<!-- continues the block above -->"
_BLOCK = re.compile(
    r"^(?P<marker>[ \t]*<!-- [^\n]* -->\n\n?)?"  # an HTML comment on the line(s) before
    r"(?P<indent>[ \t]*)```python\n(?P<code>.*?)^(?P=indent)```$",
    re.M | re.S,
)


def scripts(page: pathlib.Path) -> list[tuple[str, str]]:
    """(name, code) of each script on `page`: a block with the blocks that continue it. The name
    is the page and the number of the script's first block, `index.md:1`."""
    found: list[tuple[str, str]] = []
    for number, block in enumerate(_BLOCK.finditer(page.read_text()), start=1):
        marker = (block["marker"] or "").strip()
        if marker and marker != CONTINUES:
            raise AssertionError(f"{page.name}: block {number} has an unknown marker {marker}")
        if marker == CONTINUES:
            assert found, f"{page.name}: block {number} continues nothing"
            name, code = found[-1]
            found[-1] = (name, f"{code}\n{textwrap.dedent(block['code'])}")
        else:
            found.append((f"{page.name}:{number}", textwrap.dedent(block["code"])))
    return found


SCRIPTS = [script for page in PAGES for script in scripts(page)]


def run(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=pasted_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


# The names each script left in its directory, by script, as the scripts run.
LEFT: dict[str, set[str]] = {}


def test_every_python_block_is_found():
    texts = [page.read_text() for page in PAGES]
    found = [len(_BLOCK.findall(text)) for text in texts]
    assert found == [text.count("```python\n") for text in texts]  # no fence missed
    assert sum(found) >= 20  # README.md's and docs/*.md's


@pytest.mark.parametrize(("name", "code"), SCRIPTS, ids=[name for name, _ in SCRIPTS])
def test_block_runs_as_pasted(name, code, tmp_path):
    result = run(code, tmp_path)
    assert result.returncode == 0, f"{name} failed:\n{result.stderr[-4000:]}"
    assert not re.search(r"ERROR|Traceback", result.stderr), f"{name}:\n{result.stderr[-4000:]}"
    LEFT[name] = {path.name for path in tmp_path.iterdir()}
    page = name.partition(":")[0]
    for other, names in LEFT.items():
        clash = names & LEFT[name] if other.partition(":")[0] != page else set()
        assert not clash, f"{name} and {other} both write {sorted(clash)}"
