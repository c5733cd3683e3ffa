"""The launcher-worker contract has one home: every `FLEETJAX_*` variable that `fleetjax-run`
gives a worker is spelled in fleetjax/_worker.py and nowhere else in the library, and the
launcher imports no private module of `fleetjax.fleet`."""

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).parents[2] / "fleetjax"
CONTRACT = PACKAGE / "_worker.py"
VARIABLE = re.compile(r"FLEETJAX_[A-Z_]+")


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def spelled(path: pathlib.Path) -> set[str]:
    """The `FLEETJAX_*` names in the string constants of `path`'s code (not its prose)."""
    tree = ast.parse(path.read_text())
    prose = _docstrings(tree)
    return {
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
        for name in VARIABLE.findall(node.value)
    }


def test_every_fleetjax_variable_is_spelled_in_the_contract_only():
    contract = spelled(CONTRACT)
    assert len(contract) == 7, contract
    elsewhere = {
        str(path.relative_to(PACKAGE)): names
        for path in PACKAGE.rglob("*.py")
        if path != CONTRACT and (names := spelled(path))
    }
    assert elsewhere == {}


def test_the_launcher_imports_no_private_module_of_the_fleet():
    private = re.compile(r"fleetjax\.fleet(\.\w+)*\._\w+|from fleetjax\.fleet import _\w+")
    found = {
        str(path.relative_to(PACKAGE)): private.findall(path.read_text())
        for path in (PACKAGE / "launch").rglob("*.py")
        if private.search(path.read_text())
    }
    assert found == {}
