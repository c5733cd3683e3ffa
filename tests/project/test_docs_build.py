"""The documentation site builds without a warning, and its API reference covers the public API."""

import html
import importlib
import inspect
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import griffe
import pytest

import fleetjax
from fleetjax.transforms import amp

ROOT = pathlib.Path(__file__).parents[2]
# The public API: these modules' `__all__`, or, without one, the functions and classes they
# define under public names.
PUBLIC_MODULES = (
    "fleetjax",
    "fleetjax.fleet",
    "fleetjax.fleet.role_maker",
    "fleetjax.fleet.auto",
    "fleetjax.fleet.utils",
    "fleetjax.optimizers",
    "fleetjax.optimizers.sparse_rules",
    "fleetjax.mesh",
    "fleetjax.vocabulary",
    "fleetjax.checkpoint",
    "fleetjax.data",
    "fleetjax.export",
    "fleetjax.plan",
    "fleetjax.placement",
    "fleetjax.hlo",
    "fleetjax.transforms.grad_fn",
    "fleetjax.transforms.amp",
    "fleetjax.transforms.loss_scale",
    "fleetjax.transforms.recompute",
    "fleetjax.transforms.gradient_merge",
    "fleetjax.transforms.grad_allreduce",
    "fleetjax.transforms.per_replica",
    "fleetjax.transforms.pipeline",
    "fleetjax.transforms.pipeline.schedules",
    "fleetjax.layers",
    "fleetjax.layers.moe",
    "fleetjax.incubate.distributed.models.moe",
    "fleetjax.xla_flags",
    "fleetjax.auto",
    "fleetjax.targets",
    "fleetjax.cost",
    "fleetjax.knobs",
    "fleetjax.auto_parallel",
    "fleetjax.auto_parallel.tables",
    "fleetjax.distributed",
    "fleetjax.amp",
)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built in strict mode, and the build's output."""
    site_dir = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # mkdocs-material's banner
        timeout=300,
    )
    return site_dir, build


def test_docs_build_in_strict_mode(site):
    _, build = site
    assert build.returncode == 0, build.stdout + build.stderr


def _public_names(module: types.ModuleType) -> list[str]:
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    ]


def _public_api() -> list[tuple[str, object]]:
    """(public path, object) of every public name."""
    api = []
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        api += [(f"{module_name}.{name}", getattr(module, name)) for name in _public_names(module)]
    return api


def _anchors(site_dir: pathlib.Path) -> set[str]:
    anchors = set()
    for page in (site_dir / "api").rglob("*.html"):
        anchors.update(re.findall(r'id="(fleetjax[\w.]*)"', page.read_text()))
    return anchors


def test_api_reference_covers_the_public_api(site):
    site_dir, build = site
    assert build.returncode == 0, "the site did not build; see test_docs_build_in_strict_mode"
    api = _public_api()
    paths_of: dict[int, set[str]] = {}  # an object's public paths (it may have several)
    for path, obj in api:
        paths_of.setdefault(id(obj), set()).add(path)

    def paths(obj: object, path: str) -> set[str]:
        if isinstance(obj, types.ModuleType):
            return {obj.__name__}
        if inspect.ismethod(obj):  # fleet.init: documented as a method of the Fleet class
            owner = type(obj.__self__)
            return {f"{p}.{obj.__name__}" for p in paths(owner, "")}
        if inspect.isclass(obj) or inspect.isfunction(obj):
            return paths_of.get(id(obj), set()) | {f"{obj.__module__}.{obj.__qualname__}"}
        if isinstance(obj, (fleetjax.fleet.Fleet, fleetjax.fleet.UtilBase)):  # the instances
            return paths(type(obj), "")
        return {path}  # a constant: documented where it is exported

    anchors = _anchors(site_dir)
    missing = [path for path, obj in api if not paths(obj, path) & anchors]
    assert not missing, f"not in the API reference (docs/api/*.md): {missing}"


def _grouped_names(section: griffe.DocstringSection) -> list[str]:
    """The names a Google-style section documents; "a, b: ..." documents a and b."""
    return [name.strip() for item in section.value for name in item.name.split(",")]


def test_documented_arguments_are_in_the_signature():
    # mkdocs.yml turns off griffe's own check, which does not know "a, b: ..." items.
    package = griffe.load("fleetjax", docstring_parser="google", resolve_aliases=False)
    problems = []

    def visit(obj: griffe.Object) -> None:
        for member in obj.members.values():
            if member.is_alias:
                continue
            if member.is_function and member.docstring is not None:
                params = {p.name for p in member.parameters}
                for section in member.docstring.parse(
                    "google", warn_unknown_params=False, warn_missing_types=False
                ):
                    if section.kind is griffe.DocstringSectionKind.parameters:
                        unknown = [n for n in _grouped_names(section) if n not in params]
                        if unknown:
                            problems.append(f"{member.path}: {unknown}")
            if member.is_module or member.is_class:
                visit(member)

    visit(package)
    assert not problems, f"documented arguments that the signature does not have: {problems}"


def test_amp_page_lists_every_paddle_operator():
    text = (ROOT / "docs" / "amp.md").read_text()
    table = text[text.index("<!-- PADDLE_OPS") :].splitlines()[3:]
    documented = {}
    for row in table:
        if not row.startswith("|"):
            break
        operators, primitives = (re.findall(r"`([^`]+)`", cell) for cell in row.split("|")[1:3])
        documented.update(dict.fromkeys(operators, tuple(primitives)))
    assert documented == amp.PADDLE_OPS


def test_the_notebooks_are_pages_with_their_outputs_and_plots(site):
    site_dir, build = site
    assert build.returncode == 0, "the site did not build; see test_docs_build_in_strict_mode"
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks, "no notebooks found"  # each one must have its page, with its plots
    for path in notebooks:
        page = site_dir / "notebooks" / path.stem / "index.html"
        page_html = page.read_text()
        cells = json.loads(path.read_text())["cells"]
        plots = sum(
            "image/png" in output.get("data", {})
            for cell in cells
            if cell["cell_type"] == "code"
            for output in cell["outputs"]
        )
        images = re.findall(r'<img alt="png" src="([^"]+)"', page_html)
        assert len(images) == plots, path.name
        assert all((page.parent / src).resolve().is_file() for src in images), images
        printed = [  # the first line of each printed output is on the page
            "".join(output["text"]).splitlines()[0]
            for cell in cells
            if cell["cell_type"] == "code"
            for output in cell["outputs"]
            if output["output_type"] == "stream" and output["name"] == "stdout"
        ]
        text = html.unescape(re.sub(r"<[^>]+>", "", page_html))
        missing = [line for line in printed if line.strip() not in text]
        assert not missing, f"{path.name}: printed outputs not on its page: {missing}"
