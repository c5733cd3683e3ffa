"""docs/knobs.md stays true: its tables are the schema's (`fleetjax.knobs`, one row per strategy
field), with the XLA flags fleetjax really maps, and what fleetjax really does when each knob is
set (warns, raises or stays silent)."""

import dataclasses
import pathlib
import re
import warnings
from typing import Any

import pytest

import fleetjax
from fleetjax import knobs
from fleetjax.plan import XLA_FUSES, read_plan

DOC = pathlib.Path(__file__).parents[2] / "docs" / "knobs.md"
KINDS = {"feature", "XLA flag", "XLA default", "no JAX meaning", "not yet"}
WHEN = {"applied", "warns", "raises", "silent"}
SPECS = {
    "DistributedStrategy": fleetjax.DistributedStrategy.SPEC,
    "Strategy": fleetjax.Strategy.SPEC,
}
_ROW = re.compile(
    r"^\| `(?P<path>[\w.]+)` \| (?P<kind>[^|]+) \| (?P<when>[^|]+) \| (?P<text>.+) \|$"
)


def doc_rows() -> dict[str, tuple[str, str, str]]:
    """{"Owner.path": (kind, when set, text)} from the knob tables under each owner heading."""
    rows, owner = {}, None
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            owner = line[3:].strip() if line[3:].strip() in SPECS else None
        elif owner and (m := _ROW.match(line)):
            key = f"{owner}.{m['path']}"
            assert key not in rows, f"{key} is listed twice"
            rows[key] = (m["kind"].strip(), m["when"].strip(), m["text"])
    return rows


ROWS = doc_rows()


def _notes(spec: Any) -> set[str | None]:
    found: set[str | None] = set()
    for f in spec.fields:
        if f.is_message and not f.repeated and not f.note:
            found |= _notes(f.type)
        else:
            found.add(f.note)
    return found


def schema_rows(spec: Any, prefix: str = "") -> dict[str, str | None]:
    """{path: note} for every field; a nested message that carries a note, or whose fields all
    share one note, is one row."""
    out = {}
    for f in spec.fields:
        if f.is_message and not f.repeated and not f.note:
            notes = _notes(f.type)
            if len(notes) == 1 and None not in notes:
                out[prefix + f.name] = notes.pop()
            else:
                out.update(schema_rows(f.type, prefix + f.name + "."))
        else:
            out[prefix + f.name] = f.note
    return out


SCHEMA = {
    f"{owner}.{path}": note
    for owner, spec in SPECS.items()
    for path, note in schema_rows(spec).items()
}


def test_the_tables_are_the_schemas():
    """Run `python -m fleetjax.knobs docs/knobs.md` after changing a knob's schema field."""
    text = DOC.read_text()
    assert knobs.render(text) == text


def test_every_field_has_exactly_one_row():
    assert sorted(set(SCHEMA) - set(ROWS)) == [], "fields missing from docs/knobs.md"
    assert sorted(set(ROWS) - set(SCHEMA)) == [], "rows for fields the schema does not have"
    made = {f"{owner}.{path}" for owner, cls in knobs.OWNERS.items() for path in knobs.knobs(cls)}
    assert made == set(SCHEMA)


def test_kinds_and_when_set_use_the_legend():
    assert set(knobs.KINDS) == KINDS and set(knobs.WHEN) == WHEN
    for key, (kind, when, _) in ROWS.items():
        assert kind in KINDS, key
        assert when in WHEN, key


def test_a_schema_field_outside_the_legend_is_refused():
    spec = fleetjax.DistributedStrategy.SPEC
    bad = dataclasses.replace(spec.field("amp"), kind="magic")
    broken = dataclasses.replace(
        spec, fields=tuple(bad if f.name == "amp" else f for f in spec.fields)
    )

    class Broken:
        SPEC = broken

    with pytest.raises(ValueError, match="schema field amp: kind 'magic'"):
        knobs.knobs(Broken)


# -- XLA flags ---------------------------------------------------------------------------------


@pytest.fixture
def strategies_asking_for_every_flag(every_flag_strategy):
    return [
        every_flag_strategy,
        fleetjax.DistributedStrategy(fuse_all_reduce_ops=False),
        fleetjax.DistributedStrategy(sharding=True, sharding_configs={"segment_broadcast_MB": 16}),
        fleetjax.Strategy(
            {
                "fused_passes": {"enable": True, "gemm_epilogue": True},
                "sharding": {"comm_buffer_size_MB": 64},
            }
        ),
    ]


def test_xla_flag_rows_are_the_knobs_fleetjax_maps_and_name_their_flags(
    strategies_asking_for_every_flag,
):
    mapped: dict[str, set[str]] = {}
    for strategy in strategies_asking_for_every_flag:
        for flag in read_plan(strategy).xla_flags:
            for setting in flag.knob.split(", "):
                key = f"{type(strategy).__name__}.{setting.split('=')[0]}"
                mapped.setdefault(key, set()).add(flag.name)
    rows = {key for key, (kind, _, _) in ROWS.items() if kind == "XLA flag"}
    assert rows == set(mapped)
    for key, names in mapped.items():
        for name in names:
            assert f"--{name}" in ROWS[key][2], f"{key} does not name --{name}"


def test_flag_table_names_every_mapped_flag(strategies_asking_for_every_flag):
    intro = DOC.read_text().split("## DistributedStrategy")[0]
    for strategy in strategies_asking_for_every_flag:
        for flag in read_plan(strategy).xla_flags:
            assert f"--{flag.name}" in intro


def test_knobs_xla_handles_itself_are_marked_so():
    for key in XLA_FUSES:
        assert ROWS[key][0] == "XLA default", key
    for key, note in SCHEMA.items():
        if note:  # the schema's reason is the row's
            assert ROWS[key][:2] in (("no JAX meaning", "warns"), ("not yet", "warns")), key
            assert _flat(note) in _flat(ROWS[key][2]), (key, note)


def _flat(text: str) -> str:
    return " ".join(text.replace("`", "").split()).lower()


# -- what fleetjax does when a knob is set -----------------------------------------------------


def _other_value(field: Any):
    """A valid value of `field` other than its default."""
    if field.repeated:
        if field.is_message:
            return [{field.type.fields[1].name: 1}]
        return [{str: "x", int: 1, float: 0.5}[field.type]]
    if field.default is None:  # an optional field: any value is another one
        return {bool: True, int: 1, float: 1.0, str: "x"}[field.type]
    if field.type is bool:
        return not field.default
    if field.type is str:
        options = re.findall(r"'([^']*)'", field.check.allowed) if field.check else ["x"]
        return next(o for o in options if o != field.default)
    candidates = [field.default + 1, field.default + 2, field.default / 2, 2]
    if field.type is float:
        candidates = [field.default * 2 or 1.0, field.default / 2]
    return next(
        field.type(v) for v in candidates if field.check is None or field.check.test(field.type(v))
    )


def strategy_setting(key: str):
    """A strategy with the field `key` (or a message row's first field) set to another value."""
    owner, path = key.split(".", 1)
    strategy = fleetjax.DistributedStrategy() if owner == "DistributedStrategy" else None
    if strategy is None:
        strategy = fleetjax.Strategy()
    spec, target = SPECS[owner], strategy
    names = path.split(".")
    field = spec.field(names[0])
    for name in names[1:]:
        target, field = target._get(field.name), field.type.field(name)
    while field.is_message and not field.repeated:  # a whole message: its first field
        target, field = target._get(field.name), field.type.fields[0]
    target.update({field.name: _other_value(field)})
    return strategy


def outcome(strategy) -> tuple[list[str], Exception | None]:
    """The warnings, and the NotImplementedError if any, of reading the strategy's plan."""
    fleetjax.StrategyWarning.reset()
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            read_plan(strategy)
        except NotImplementedError as e:
            error = e
    return [str(w.message) for w in caught], error


def _named(messages: list[str], key: str) -> bool:
    owner, path = key.split(".", 1)
    # A performance knob's message may name only its top-level field.
    generic = f"{owner}.{path.split('.')[0]} is a performance setting"
    return any(f"{owner}.{path}" in m or generic in m for m in messages)


CHECKED = sorted(k for k, (_, when, _) in ROWS.items() if when in ("warns", "raises", "silent"))


@pytest.mark.parametrize("key", CHECKED)
def test_what_fleetjax_does_when_the_knob_is_set(key):
    _, when, _ = ROWS[key]
    messages, error = outcome(strategy_setting(key))
    if when == "raises":
        assert error is not None, f"{key} is documented to raise"
    elif when == "warns":
        assert error is None and _named(messages, key), f"{key} is documented to warn: {messages}"
    else:
        assert (error, messages) == (None, []), f"{key} is documented as silent"
