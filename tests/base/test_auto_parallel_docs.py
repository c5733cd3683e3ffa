"""docs/auto_parallel.md's tables are the code's: `fleetjax.auto_parallel.tables` rewrites them
from `partition_spec` and the reshard plan, and the page holds what it writes."""

import pathlib

import pytest

from fleetjax.auto_parallel import tables

PAGE = pathlib.Path(__file__).parents[2] / "docs" / "auto_parallel.md"


def test_the_page_holds_the_tables_the_code_makes():
    text = PAGE.read_text()
    assert (
        "<!-- auto_parallel: placements -->" in text and "<!-- auto_parallel: reshard -->" in text
    )
    assert tables.render(text) == text


def test_a_changed_row_is_rewritten():
    text = PAGE.read_text()
    edited = text.replace("| `P('dp', None)` |", "| `P('mp', None)` |")
    assert edited != text and tables.render(edited) == text


def test_an_unknown_table_is_refused():
    with pytest.raises(ValueError, match="must be one of placements, reshard"):
        tables.render("<!-- auto_parallel: knobs -->\n")
