"""Writing a benchmark's results: JSON for machines, a markdown table for people."""

from __future__ import annotations

import json
import pathlib
import platform
from collections.abc import Sequence
from typing import Any

import jax

RESULTS = pathlib.Path(__file__).parent / "results"


def environment() -> dict[str, Any]:
    """Where the numbers were measured."""
    devices = jax.devices()
    return {
        "jax": jax.__version__,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "python": platform.python_version(),
    }


def write(name: str, title: str, rows: Sequence[dict[str, Any]], notes: str = "") -> pathlib.Path:
    """Write `results/<name>.json` and `results/<name>.md` (a table of `rows`); return the .md."""
    RESULTS.mkdir(exist_ok=True)
    env = environment()
    (RESULTS / f"{name}.json").write_text(
        json.dumps({"title": title, "environment": env, "rows": list(rows)}, indent=2) + "\n"
    )
    columns = list(rows[0])
    lines = [
        f"# {title}",
        "",
        f"Measured with jax {env['jax']} on {env['devices']} {env['platform']} devices "
        f"({env['device_kind']}).",
        "",
        "| " + " | ".join(columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
        *("| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows),
    ]
    if notes:
        lines += ["", notes.strip()]
    path = RESULTS / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)
