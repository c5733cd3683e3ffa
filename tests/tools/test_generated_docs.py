"""The docs' tables that restate the schema or the switch table are made from them
(`python -m fleetjax.knobs`), and the pages that mention the switches link that table instead of
copying it: docs/paddle.md's kind of each knob, docs/knobs.md's switch table (its knob tables:
tests/config/test_knobs_doc.py), and the README's, docs/optimizers.md's and docs/auto.md's words."""

import pathlib
import re

import pytest

from fleetjax import knobs
from fleetjax.optimizers import STEP_SWITCHES, SWITCHES
from fleetjax.plan import PLANNED_SWITCHES

ROOT = pathlib.Path(__file__).parents[2]
DOCS = ROOT / "docs"
SWITCH_TABLE = "knobs.md#optimizer-switches"


def test_paddle_md_kinds_are_the_schemas():
    """Run `python -m fleetjax.knobs` after changing a knob's kind."""
    text = (DOCS / "paddle.md").read_text()
    assert knobs.render(text) == text
    cells = re.findall(r"`fleetjax\.\w+\.[\w.]+`: [^,|;`]+, (?:applied|warns|raises|silent)", text)
    assert len(cells) > 80


def test_a_copied_kind_is_made_anew_and_an_unknown_knob_refused():
    page = (
        "| a | `fleetjax.BuildStrategy.enable_inplace`: feature, applied; Paddle's words |\n"
        "| b | `fleetjax.Strategy.sharding.stage`: not yet, silent |\n"
        "| c | `fleetjax.DistributedStrategy.build_strategy`, its fields below |\n"
    )
    assert knobs.render(page) == (
        "| a | `fleetjax.BuildStrategy.enable_inplace`: no JAX meaning, warns; Paddle's words |\n"
        "| b | `fleetjax.Strategy.sharding.stage`: feature, applied |\n"
        "| c | `fleetjax.DistributedStrategy.build_strategy`, its fields below |\n"
    )
    with pytest.raises(ValueError, match="`fleetjax.Strategy.no_such` names no knob of Strategy"):
        knobs.render("| x | `fleetjax.Strategy.no_such`: feature, applied |")


def switch_rows() -> list[list[str]]:
    text = (DOCS / "knobs.md").read_text()
    lines = text[text.index("<!-- switches -->") :].splitlines()[3:]
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def test_the_switch_table_has_a_row_per_switch_with_its_facts():
    rows = switch_rows()
    assert len(rows) == len(SWITCHES)
    for switch, (on, _, trains_with, per_replica, clashes, configs) in zip(
        SWITCHES.values(), rows, strict=True
    ):
        assert (f"`{switch.name}`" == on) == switch.flag
        assert trains_with == switch.what
        assert per_replica.startswith("yes" if switch.per_replica else "no")
        assert (f"on {switch.replicas} replicas" in per_replica) == (switch.replicas > 1)
        assert clashes == (", ".join(STEP_SWITCHES[name] for name in switch.clashes) or "-")
        assert configs == f"[`{switch.configs}`](#{switch.configs})"
        assert f"### `{switch.configs}`" in (DOCS / "knobs.md").read_text()


def test_a_changed_switch_changes_the_table(monkeypatch):
    row = SWITCHES["lars"]
    changed = {**SWITCHES, "lars": type(row)(**{**vars(row), "what": "something else"})}
    monkeypatch.setattr(knobs, "SWITCHES", changed)
    assert any("| something else |" in line for line in knobs.switch_table())


@pytest.mark.parametrize("page", ["README.md", "docs/optimizers.md", "docs/auto.md"])
def test_pages_link_the_switch_table_and_copy_no_row_of_it(page):
    text = (ROOT / page).read_text()
    assert SWITCH_TABLE in text
    names = "|".join(SWITCHES)
    copied = [line for line in text.splitlines() if re.match(rf"\| `({names})`", line)]
    assert copied == []


def test_auto_md_names_the_planned_switches_the_switch_table_does_not():
    text = " ".join((DOCS / "auto.md").read_text().split())
    sentence = text[text.index("(`fleetjax.plan.PLANNED_SWITCHES`:") :].split(")")[0]
    per_replica = {name for name, switch in SWITCHES.items() if switch.per_replica}
    named = set(re.findall(r"`(\w+)`", sentence))
    assert named == set(PLANNED_SWITCHES) - per_replica
    assert set(PLANNED_SWITCHES) & per_replica  # the table's per-replica rows complete it
