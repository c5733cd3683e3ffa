"""Every knob of the strategies, from their schema (one source): what each field of
`DistributedStrategy` and `Strategy` is in fleetjax, what fleetjax does when it is set, and its
effect. docs/knobs.md's tables are made from it:

    python -m fleetjax.knobs docs/knobs.md     # rewrites the tables below their markers

A table follows a marker line ``<!-- knobs Owner: selection -->``: the owner's rows whose path
is or starts with one of the selection's space-separated prefixes, in the schema's order (``*``:
the top-level rows no other table of the page selects; ``proto`` / ``python`` after a prefix:
only its fields with proto numbers below 1000, or from 1000 on: Paddle's Python-side attributes).
"""

from __future__ import annotations

import pathlib
import re
import sys
from collections.abc import Iterator
from typing import NamedTuple

from fleetjax._config import FieldSpec, MessageSpec
from fleetjax.strategy import DistributedStrategy, Strategy

__all__ = ["KINDS", "OWNERS", "WHEN", "Knob", "knobs", "render"]

# docs/knobs.md's legend.
KINDS = ("feature", "XLA flag", "XLA default", "no JAX meaning", "not yet")
WHEN = ("applied", "warns", "raises", "silent")
# The strategies whose knobs the page lists, by the name its markers and headings use.
OWNERS = {"DistributedStrategy": DistributedStrategy, "Strategy": Strategy}

_MARKER = re.compile(r"^<!-- knobs (?P<owner>\w+): (?P<selection>[^>]*?) -->$")
_HEADER = "| knob | kind | when set | effect in fleetjax |\n| --- | --- | --- | --- |"


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


def _knob(path: str, f: FieldSpec, note: str | None) -> Knob:
    kind = f.kind or ("no JAX meaning" if note else "feature")
    when = f.when or ("warns" if note else "raises" if kind == "not yet" else "applied")
    text = f.doc or (note[0].upper() + note[1:] + "." if note else "")
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


def render(markdown: str) -> str:
    """`markdown` with the table below each marker made anew from the schema (see the module
    docstring).

    Raises:
      ValueError: for a marker of an unknown owner, or one that selects no row.
    """
    lines = markdown.splitlines()
    markers = [m for line in lines if (m := _MARKER.match(line))]
    claimed: dict[str, set[str]] = {}
    for m in markers:
        if m["selection"].strip() != "*":
            claimed.setdefault(m["owner"], set()).update(m["selection"].split())
    out, skip = [], 0
    for line in lines:
        if skip and line.startswith("|"):
            continue
        skip = 0
        out.append(line)
        m = _MARKER.match(line)
        if m is None:
            continue
        if m["owner"] not in OWNERS:
            raise ValueError(f"{line}: the owner must be one of {', '.join(OWNERS)}")
        rows = knobs(OWNERS[m["owner"]])
        chosen = _selected(rows, m["selection"], claimed.get(m["owner"], set()))
        if not chosen:
            raise ValueError(f"{line} selects no knob")
        out += [_HEADER, *(k.row for k in chosen)]
        skip = 1
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    page = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "docs/knobs.md")
    page.write_text(render(page.read_text()))
