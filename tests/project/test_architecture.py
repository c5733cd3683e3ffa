"""The import graph, built from the source with `ast`: no cycle, no import from a lower layer to
a higher one as docs/architecture.md defines the layers, and no private module imported by the
tests, examples, benchmarks or notebooks. The size goals: no function over 80 lines (its
docstring aside), `fleetjax/step.py` (the host's part of the step) at most 350 lines."""

import ast
import fnmatch
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[2]
PACKAGE = ROOT / "fleetjax"


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _imported(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The fleetjax modules an import statement in `module` loads (lazy ones included)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module.split(".")
        if node.level:
            is_package = MODULES[module].name == "__init__.py"
            base = base[: len(base) - node.level + is_package]
            target = ".".join([*base, *([node.module] if node.module else [])])
        else:
            target = node.module or ""
        names = [target, *(f"{target}.{alias.name}" for alias in node.names)]
    return {n for n in names if n in MODULES}


def import_graph() -> dict[str, set[str]]:
    """module -> the fleetjax modules it imports (not its own package's __init__)."""
    graph = {}
    for module, path in MODULES.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _imported(module, node)
        graph[module] = {t for t in edges if t != module and not module.startswith(t + ".")}
    return graph


GRAPH = import_graph()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layers() -> list[tuple[int, str, list[str]]]:
    """(rank, name, module patterns) of each layer in docs/architecture.md's table."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text.split("<!-- layers: the test reads this table -->")[1]
    rows = []
    for line in table.strip().splitlines()[2:]:
        if not line.startswith("|"):
            break
        layer, modules = (cell.strip() for cell in line.strip("|").split("|")[:2])
        rank, name = layer.split(" ", 1)
        rows.append((int(rank), name, re.findall(r"`([\w.*]+)`", modules)))
    return rows


def layer_of(module: str) -> tuple[int, str]:
    for rank, name, patterns in layers():
        for pattern in patterns:
            if (
                module == pattern
                or fnmatch.fnmatch(module, pattern)
                or (pattern.endswith(".*") and module == pattern[:-2])
            ):
                return rank, name
    raise AssertionError(f"{module} is in no layer of docs/architecture.md")


def test_the_import_graph_has_no_cycle():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_is_in_one_layer():
    for module in MODULES:
        layer_of(module)


def test_no_import_goes_up_a_layer():
    upward = [
        f"{module} ({layer_of(module)[1]}) imports {target} ({layer_of(target)[1]})"
        for module, targets in GRAPH.items()
        for target in targets
        if layer_of(target)[0] > layer_of(module)[0]
    ]
    assert upward == []


def test_the_layers_are_ordered_from_config_to_facade():
    ranks = [rank for rank, _, _ in layers()]
    assert ranks == sorted(ranks) and layer_of("fleetjax.strategy") == (1, "config")
    assert layer_of("fleetjax.fleet.base.role_maker")[1] == "facade"


def test_the_tests_sit_in_folders_that_mirror_the_layers():
    """tests/<layer>/ for each layer of the table (what it tests), tests/project/ for the
    project as a whole (docs, notebooks, examples, benchmarks, this file); shared helpers and
    worker scripts stay at the top of tests/, test files never."""
    tests = ROOT / "tests"
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    assert folders == {name for _, name, _ in layers()} | {"project"}
    assert sorted(p.name for p in tests.glob("test_*.py")) == []


def test_the_module_map_names_every_module():
    """docs/architecture.md's module map has a row naming each of fleetjax's top-level modules
    and packages."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = text.split("## Module map")[1].split("\n## ")[0]
    named = set(re.findall(r"`([\w]+)(?:\.py|/)`", rows))
    top = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    top |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert sorted(top - named) == []


# -- sizes --------------------------------------------------------------------------------------

FUNCTION_LINES, STEP_LINES = 80, 350


def _long_functions(source: str, limit: int = FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function over `limit` lines, its docstring not counted."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if docstring and isinstance(first.value.value, str):
                lines -= first.end_lineno - first.lineno + 1
            if lines > limit:
                found.append((node.name, lines))
    return found


def test_no_function_is_over_80_lines():
    long = {
        f"{module}.{name}": lines
        for module, path in MODULES.items()
        for name, lines in _long_functions(path.read_text())
    }
    assert long == {}


def test_the_long_function_finder_finds_them():
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    documented = f'def short():\n    """Say\n    what."""\n{body.split(chr(10), 1)[1]}\n'
    source = f"{documented}\ndef long():\n{body}\n    return 0\n"
    assert _long_functions(source) == [("long", 82)]  # short: 80 lines and its docstring


def test_the_step_module_keeps_to_the_hosts_part():
    assert len((PACKAGE / "step.py").read_text().splitlines()) <= STEP_LINES


# -- private modules in the tests, examples, benchmarks and notebooks ----------------------------


def _sources() -> list[tuple[pathlib.Path, str]]:
    found = []
    for folder in ("tests", "examples", "benchmarks", "notebooks"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix == ".py":
                found.append((path, path.read_text()))
            elif path.suffix == ".ipynb":
                cells = json.loads(path.read_text())["cells"]
                code = [c["source"] for c in cells if c["cell_type"] == "code"]
                lines = ["".join(s) if isinstance(s, list) else s for s in code]
                # IPython magics are not Python.
                found.append((path, "\n".join(re.sub(r"(?m)^\s*[%!].*$", "", c) for c in lines)))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _private_uses(source: str) -> set[str]:
    """Imported private fleetjax modules, and private names read from a fleetjax module."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fleetjax"):
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Attribute) and re.fullmatch(r"[\w.]+", ast.unparse(node)):
            names = [ast.unparse(node)]  # a dotted path (Paddle's own _methods on objects pass)
        found |= {
            n
            for n in names
            if n.split(".")[0] == "fleetjax" and any(_private(p) for p in n.split("."))
        }
    return found


@pytest.mark.parametrize("path_source", _sources(), ids=lambda ps: str(ps[0].relative_to(ROOT)))
def test_no_private_fleetjax_name_outside_the_package(path_source):
    assert _private_uses(path_source[1]) == set()


def test_the_private_use_finder_finds_them():
    hidden, read = "fleetjax." + "_hlo", "fleetjax.plan." + "_read"  # not to be found here
    assert _private_uses(f"from {hidden} import x\nimport {read}") == {
        hidden,
        f"{hidden}.x",
        read,
    }
    assert _private_uses("fleetjax.StrategyWarning.reset()\nfrom fleetjax import hlo") == set()
