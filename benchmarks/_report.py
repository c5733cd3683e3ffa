"""A benchmark's result and how it is written: JSON for machines, a plot, a markdown section.

Every benchmark module has `run(quick: bool = False) -> Result`. `publish` writes
`<out>/results/<name>.json` (and `<name>.png` when there is a figure); `results_markdown` turns
the JSON files into `RESULTS.md`, one section per benchmark. `main` runs one module alone.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import matplotlib

matplotlib.use("Agg")  # files only, no display

from matplotlib.figure import Figure

BENCHMARKS = pathlib.Path(__file__).parent  # the default output folder
MiB = 2**20


class Result(NamedTuple):
    """What a benchmark measured.

    Attributes:
      title: the section's heading.
      rows: the table, one dict per row (a row without a column shows "-"); may be empty.
      notes: markdown saying what was measured and what the numbers show.
      figure: a matplotlib figure to save next to the JSON, or None.
      devices: the devices measured on (default: JAX's default devices).
    """

    title: str
    rows: list[dict[str, Any]]
    notes: str
    figure: Figure | None = None
    devices: Sequence[jax.Device] | None = None


def bench_devices(n: int = 8) -> list[jax.Device]:
    """`n` devices to measure on: the default backend's where it has that many, else JAX's
    simulated CPU devices (every benchmark module asks JAX for 8)."""
    default = jax.devices()
    return default[:n] if len(default) >= n else jax.devices("cpu")[:n]


def describe(devices: Sequence[jax.Device]) -> str:
    """E.g. "8 x cpu" or "1 x NVIDIA H100 80GB HBM3"."""
    return f"{len(devices)} x {devices[0].device_kind}"


def environment(devices: Sequence[jax.Device] | None = None) -> dict[str, Any]:
    """Where the numbers were measured: on `devices` (default: JAX's default devices)."""
    devices = devices or jax.devices()
    return {
        "jax": jax.__version__,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "devices": len(devices),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def publish(name: str, result: Result, out: pathlib.Path, seconds: float, quick: bool) -> dict:
    """Write `out/results/<name>.json` (and `.png`); return what the JSON holds."""
    folder = out / "results"
    folder.mkdir(parents=True, exist_ok=True)
    plot = None
    if result.figure is not None:
        plot = f"{name}.png"
        result.figure.savefig(folder / plot, dpi=110, bbox_inches="tight")
    record = {
        "name": name,
        "title": result.title,
        "notes": result.notes.strip(),
        "rows": result.rows,
        "plot": plot,
        "seconds": round(seconds, 1),
        "quick": quick,
        "measured": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "environment": environment(result.devices),
    }
    (folder / f"{name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def section(record: dict) -> str:
    """One benchmark's markdown: heading, table, plot link, notes, where it was measured."""
    env = record["environment"]
    lines = [f"## {record['title']}", ""]
    rows = record["rows"]
    if rows:
        columns = list(dict.fromkeys(c for row in rows for c in row))
        lines += [
            "| " + " | ".join(columns) + " |",
            "| " + " | ".join("---" for _ in columns) + " |",
            *("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows),
            "",
        ]
    if record["plot"]:
        lines += [f"![{record['title']}](results/{record['plot']})", ""]
    lines += [record["notes"], ""]
    quick = ", `--quick`" if record["quick"] else ""
    lines.append(
        f"*Measured {record['measured']} with jax {env['jax']} on {env['devices']} "
        f"{env['platform']} devices ({env['device_kind']}, {env['machine']}), "
        f"in {record['seconds']:.0f} s{quick}; data: `results/{record['name']}.json`.*"
    )
    return "\n".join(lines) + "\n"


def results_markdown(out: pathlib.Path, names: Sequence[str], header: str) -> str:
    """`RESULTS.md`: `header`, then a section for each of `names` that has a JSON in `out`."""
    sections = [header.strip() + "\n"]
    for name in names:
        path = out / "results" / f"{name}.json"
        if path.exists():
            sections.append(section(json.loads(path.read_text())))
    return "\n".join(sections)


def main(name: str, run: Callable[[bool], Result]) -> None:
    """Run one benchmark module alone: `python benchmarks/<name>.py [--quick] [--out DIR]`
    writes its JSON (and plot) and prints its section; `run.py` rebuilds RESULTS.md."""
    parser = argparse.ArgumentParser(description=f"Run the {name} benchmark.")
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument("--out", type=pathlib.Path, default=BENCHMARKS, help="output folder")
    args = parser.parse_args()
    start = time.perf_counter()
    result = run(args.quick)
    print(section(publish(name, result, args.out, time.perf_counter() - start, args.quick)))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)
