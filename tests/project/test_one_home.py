"""Facts with one home, found by reading the library's code (its string constants and attribute
names, not its prose): every `FLEETJAX_*` variable that `fleetjax-run` gives a worker is spelled
in fleetjax/_worker.py only, and the launcher imports no private module of `fleetjax.fleet`; an
optimizer switch is named only by the schema, where its fields are, and `fleetjax.optimizers`,
where its row and transformation are (docs/architecture.md's "Add a switch": nothing else
needs an edit)."""

import ast
import pathlib
import re

from fleetjax.optimizers import SWITCHES

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


def code_words(path: pathlib.Path) -> set[str]:
    """The string constants (docstrings aside) and attribute names of `path`'s code."""
    tree = ast.parse(path.read_text())
    prose = _docstrings(tree)
    strings = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
    }
    return strings | {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def spelled(path: pathlib.Path) -> set[str]:
    """The `FLEETJAX_*` names in the string constants of `path`'s code."""
    return {name for word in code_words(path) for name in VARIABLE.findall(word)}


def test_every_fleetjax_variable_is_spelled_in_the_contract_only():
    contract = spelled(CONTRACT)
    assert {"FLEETJAX_EXIT_FILE", "FLEETJAX_STACKS_FILE", "FLEETJAX_RUN_ID"} <= contract, contract
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


def test_a_switch_is_named_only_by_the_schema_and_the_optimizers():
    """A switch that a flag turns on (Geo-SGD is parameter-server mode's, which the tables and
    the plan read too)."""
    flags = [switch for switch in SWITCHES.values() if switch.flag]
    names = {name for switch in flags for name in (switch.name, switch.configs)}
    assert {"lars", "lars_configs", "dgc", "localsgd_configs"} <= names
    elsewhere = {
        str(path.relative_to(PACKAGE)): found
        for path in PACKAGE.rglob("*.py")
        if path.parent.name not in ("_schema", "optimizers") and (found := code_words(path) & names)
    }
    assert elsewhere == {}
