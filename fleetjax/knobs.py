"""Every knob of the strategies, from their schema (one source): what each field of
`DistributedStrategy` and `Strategy` is in fleetjax, what fleetjax does when it is set, and its
effect; and each optimizer switch's facts, from `fleetjax.optimizers.SWITCHES`. The docs'
tables that restate them are made from them:

    python -m fleetjax.knobs       # rewrites docs/knobs.md's and docs/paddle.md's tables

A knob table follows a marker line ``<!-- knobs Owner: selection -->``: the owner's rows whose
path is or starts with one of the selection's space-separated prefixes, in the schema's order
(``*``: the top-level rows no other table of the page selects; ``proto`` / ``python`` after a
prefix: only its fields with proto numbers below 1000, or from 1000 on: Paddle's Python-side
attributes). The switch table follows ``<!-- switches -->``. A table cell that names a knob
and its kind (`` `fleetjax.DistributedStrategy.amp`: feature, applied ``, as docs/paddle.md's
have it) gets the knob's kind and "when set" from the schema.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys
from collections.abc import Iterator
from typing import NamedTuple

from fleetjax._config import FieldSpec, MessageSpec
from fleetjax.optimizers import STEP_SWITCHES, SWITCHES, Switch
from fleetjax.strategy import DistributedStrategy, Strategy

__all__ = ["KINDS", "OWNERS", "PAGES", "WHEN", "Knob", "knobs", "render", "switch_table"]

# docs/knobs.md's legend.
KINDS = ("feature", "XLA flag", "XLA default", "no JAX meaning", "not yet")
WHEN = ("applied", "warns", "raises", "silent")
# The strategies whose knobs the page lists, by the name its markers and headings use.
OWNERS = {"DistributedStrategy": DistributedStrategy, "Strategy": Strategy}

# The pages whose tables are made here (`python -m fleetjax.knobs` rewrites them).
PAGES = ("docs/knobs.md", "docs/paddle.md")

_REFERENCE = re.compile(r"`(?P<name>fleetjax(?:\.\w+)+)`")
_MARKER = re.compile(r"^<!-- knobs (?P<owner>\w+): (?P<selection>[^>]*?) -->$")
_HEADER = "| knob | kind | when set | effect in fleetjax |\n| --- | --- | --- | --- |"
_SWITCHES_MARKER = "<!-- switches -->"
# Where each strategy class's knobs are listed: its own rows, or a field of DistributedStrategy.
_KNOB_PATHS = {
    "DistributedStrategy": ("DistributedStrategy", ""),
    "Strategy": ("Strategy", ""),
    "BuildStrategy": ("DistributedStrategy", "build_strategy."),
    "ExecutionStrategy": ("DistributedStrategy", "execution_strategy."),
}
# A cell naming a knob with its kind and "when set": `fleetjax.<class>.<path>`: kind, when
_KIND_CELL = re.compile(
    rf"`fleetjax\.(?P<owner>{'|'.join(_KNOB_PATHS)})\.(?P<path>[\w.]+)`: "
    rf"(?P<kind>[^,|;`]+), (?P<when>{'|'.join(WHEN)})\b"
)


class Knob(NamedTuple):
    """One row of docs/knobs.md.

    Attributes:
      path: the field's path in its strategy, e.g. "amp_configs.init_loss_scaling" (a nested
        message whose fields share one note is one row).
      kind: one of `KINDS`.
      when: what fleetjax does when it is set to another value than its default (`WHEN`).
      text: its effect in fleetjax.
      number: its proto field number.
    """

    path: str
    kind: str
    when: str
    text: str
    number: int

    @property
    def row(self) -> str:
        return f"| `{self.path}` | {self.kind} | {self.when} | {self.text} |"


def _notes(spec: MessageSpec) -> set[str | None]:
    found: set[str | None] = set()
    for f in spec.fields:
        found |= _notes(f.type) if f.is_message and not f.repeated and not f.note else {f.note}
    return found


def _summary(name: str) -> str:
    """The first paragraph of the docstring of the object `name` (dotted, from `fleetjax`)."""
    module, _, attribute = name.rpartition(".")
    try:
        obj = importlib.import_module(name)
    except ModuleNotFoundError:
        obj = getattr(importlib.import_module(module), attribute)
    return " ".join((inspect.getdoc(obj) or "").split("\n\n")[0].split())


def _text(path: str, f: FieldSpec, note: str | None) -> str:
    """A knob's effect: its `doc` (a doc that is only an object's name, in backticks: that name
    and the first paragraph of the object's docstring, where the behaviour is); else, for an
    optimizer switch's flag, what its row of `SWITCHES` says; else its note."""
    if reference := _REFERENCE.fullmatch(f.doc):
        return f"{f.doc}: {_summary(reference['name'])}"
    if f.doc:
        return f.doc
    if (switch := SWITCHES.get(path)) is not None and switch.flag and f.type is bool:
        return f"Optimizer switch: {switch.what} ([the switch table](#optimizer-switches))."
    return note[0].upper() + note[1:] + "." if note else ""


def _knob(path: str, f: FieldSpec, note: str | None) -> Knob:
    kind = f.kind or ("no JAX meaning" if note else "feature")
    when = f.when or ("warns" if note else "raises" if kind == "not yet" else "applied")
    text = _text(path, f, note)
    if kind not in KINDS or when not in WHEN or not text:
        raise ValueError(f"schema field {path}: kind {kind!r}, when {when!r}, doc {text!r}")
    return Knob(path, kind, when, text, f.number)


def _rows(spec: MessageSpec, prefix: str = "") -> Iterator[Knob]:
    for f in spec.fields:
        path = prefix + f.name
        if f.is_message and not f.repeated and not f.note:
            notes = _notes(f.type)
            if len(notes) == 1 and None not in notes:
                yield _knob(path, f, next(iter(notes)))
            else:
                yield from _rows(f.type, path + ".")
        else:
            yield _knob(path, f, f.note)


def knobs(strategy: type[DistributedStrategy] | type[Strategy]) -> dict[str, Knob]:
    """Every knob of `strategy` (the class) by path, in the schema's order.

    Raises:
      ValueError: for a field whose kind or "when set" is not in the legend, or without a
        text (no `doc` and no note).
    """
    return {knob.path: knob for knob in _rows(strategy.SPEC)}


def _selected(rows: dict[str, Knob], selection: str, claimed: set[str]) -> list[Knob]:
    words = selection.split()
    if words == ["*"]:
        return [k for path, k in rows.items() if "." not in path and path not in claimed]
    prefixes = [w for w in words if w not in ("proto", "python")]
    numbers = "proto" if "proto" in words else "python" if "python" in words else None
    return [
        k
        for path, k in rows.items()
        if any(path == p or path.startswith(p + ".") for p in prefixes)
        and (numbers is None or (k.number < 1000) == (numbers == "proto"))
    ]


def _needs(switch: Switch) -> str:
    """What the switch takes of the user's optimizer (`Switch.needs`, `Switch.hyperparams`)."""
    kinds = " or ".join(f"`{kind}`" for kind in switch.needs)
    if switch.hyperparams:
        return f"{kinds} of `fleetjax.optimizers`, rebuilt from its hyper-parameters"
    if switch.needs:
        return f"{kinds} of `fleetjax.optimizers`, or any optax transformation, wrapped"
    return "any optax transformation, wrapped"


def _switch_row(switch: Switch) -> str:
    on = f"`{switch.name}`" if switch.flag else switch.label.format_map(_Unknown())
    replicas = "yes" if switch.per_replica else "no"
    if switch.replicas > 1:
        replicas += f", on {switch.replicas} replicas or more"
    clashes = ", ".join(STEP_SWITCHES[name] for name in switch.clashes) or "-"
    configs = f"[`{switch.configs}`](#{switch.configs})"
    return f"| {on} | {_needs(switch)} | {switch.what} | {replicas} | {clashes} | {configs} |"


class _Unknown(dict):
    """Formats a switch's label with its configs unknown: each one as `k`."""

    def __missing__(self, key: str) -> str:
        return "k"


def switch_table() -> list[str]:
    """docs/knobs.md's table of the optimizer switches, one row per `SWITCHES` entry."""
    header = (
        "| switch | the user's optimizer | trains with | per replica | does not combine with "
        "| configs |"
    )
    return [header, "| --- | --- | --- | --- | --- | --- |", *map(_switch_row, SWITCHES.values())]


def _knob_for(owner: str, path: str) -> Knob:
    """The knob of `fleetjax.<owner>.<path>` (a field of a message listed whole: that row)."""
    strategy, prefix = _KNOB_PATHS[owner]
    rows, full = knobs(OWNERS[strategy]), prefix + path
    while full not in rows and "." in full:
        full = full.rpartition(".")[0]
    if full not in rows:
        raise ValueError(f"`fleetjax.{owner}.{path}` names no knob of {strategy}")
    return rows[full]


def _kinds(line: str) -> str:
    """`line` with every cell that names a knob and its kind made anew from the schema."""

    def kind(m: re.Match[str]) -> str:
        knob = _knob_for(m["owner"], m["path"])
        return f"`fleetjax.{m['owner']}.{m['path']}`: {knob.kind}, {knob.when}"

    return _KIND_CELL.sub(kind, line) if line.startswith("|") else line


def _tables(lines: list[str]) -> list[str]:
    """`lines` with the table below each marker made anew."""
    markers = [m for line in lines if (m := _MARKER.match(line))]
    claimed: dict[str, set[str]] = {}
    for m in markers:
        if m["selection"].strip() != "*":
            claimed.setdefault(m["owner"], set()).update(m["selection"].split())
    out, skip = [], False
    for line in lines:
        if skip and line.startswith("|"):
            continue
        skip = False
        out.append(line)
        if line == _SWITCHES_MARKER:
            out += switch_table()
            skip = True
        if (m := _MARKER.match(line)) is None:
            continue
        if m["owner"] not in OWNERS:
            raise ValueError(f"{line}: the owner must be one of {', '.join(OWNERS)}")
        rows = knobs(OWNERS[m["owner"]])
        chosen = _selected(rows, m["selection"], claimed.get(m["owner"], set()))
        if not chosen:
            raise ValueError(f"{line} selects no knob")
        out += [_HEADER, *(k.row for k in chosen)]
        skip = True
    return out


def render(markdown: str) -> str:
    """`markdown` with its generated parts made anew (see the module docstring): the tables
    below its markers from the schema and `SWITCHES`, and the kind of each knob a cell names.

    Raises:
      ValueError: for a marker of an unknown owner, one that selects no row, or a cell that
        names a knob the schema does not have.
    """
    return "\n".join(_kinds(line) for line in _tables(markdown.splitlines())) + "\n"


if __name__ == "__main__":
    for page in map(pathlib.Path, sys.argv[1:] or PAGES):
        page.write_text(render(page.read_text()))
