"""mkdocs hook (mkdocs.yml `hooks:`): the notebooks of notebooks/, stored with their outputs, as
pages of the site, `notebooks/<name>.md` with their plots beside them, converted by nbconvert's
`MarkdownExporter` while the site builds. Nothing is executed and nothing is written to docs/."""

from __future__ import annotations

import pathlib
from typing import Any

import nbformat
from mkdocs.structure.files import File, Files
from nbconvert import MarkdownExporter

NOTEBOOKS = pathlib.Path(__file__).parent / "notebooks"


def on_files(files: Files, config: Any) -> Files:
    exporter = MarkdownExporter()
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        resources = {"output_files_dir": f"{path.stem}_files"}
        body, resources = exporter.from_notebook_node(notebook, resources=resources)
        files.append(File.generated(config, f"notebooks/{path.stem}.md", content=body))
        for name, data in resources["outputs"].items():  # the plots, as PNG files
            files.append(File.generated(config, f"notebooks/{name}", content=data))
    return files


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """`mkdocs serve` rebuilds when a notebook changes."""
    server.watch(str(NOTEBOOKS))
    return server
