"""Every `pip install` in the docs, examples, notebooks, benchmarks, messages and tests works
from a clone as written: this project's extras by path (`pip install -e ".[aot]"`), never by a
name on the package index, where `fleetjax` is not this project."""

import pathlib
import re
import tomllib

ROOT = next(p for p in pathlib.Path(__file__).parents if (p / "pyproject.toml").exists())
FILES = [
    ROOT / "README.md",
    *ROOT.glob("docs/**/*.md"),
    *ROOT.glob("examples/**/*.py"),
    *ROOT.glob("examples/**/*.md"),
    *ROOT.glob("benchmarks/**/*.py"),
    *ROOT.glob("benchmarks/**/*.md"),
    *ROOT.glob("notebooks/*.ipynb"),
    *ROOT.glob("fleetjax/**/*.py"),
    *ROOT.glob("tests/**/*.py"),
]
# `pip install`, an optional -e, and the first requirement (quoted or not).
INSTALL = re.compile(r"pip install\s+(?:-e\s+)?(['\"]?)([^\s'\"`]+)\1")


def _requirements() -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(ROOT)), found[2])
        for path in FILES
        for found in INSTALL.finditer(path.read_text())
    ]


def test_every_install_names_this_projects_extras_by_path():
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    found = _requirements()
    assert len(found) >= 20  # the README's two commands, the docs, the skip reasons, ...
    for where, requirement in found:
        name = re.split(r"[\[=<>;]", requirement)[0].lower()
        assert name != "fleetjax", f"{where}: pip install {requirement} asks the index for fleetjax"
        if requirement.startswith("."):
            wanted = re.fullmatch(r"\.\[([\w,-]+)\]", requirement)
            assert wanted, f"{where}: pip install {requirement}"
            assert set(wanted[1].split(",")) <= extras, f"{where}: no such extra: {requirement}"
