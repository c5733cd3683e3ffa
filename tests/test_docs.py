"""The documentation states what the code does."""

import pathlib

import fleetjax

ROOT = pathlib.Path(__file__).parents[1]


def test_every_seed_default_difference_is_documented():
    table = (ROOT / "docs" / "differences.md").read_text()
    for path, ours, paddle in fleetjax.seed_default_differences():
        row = next((line for line in table.splitlines() if line.startswith(f"| `{path}` |")), None)
        assert row is not None, f"{path} is missing from docs/differences.md"
        assert str(ours) in row and str(paddle) in row, row


def test_readme_has_exactly_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    assert readme.count("<!-- main-command -->") == 1
    assert readme.count("<!-- test-command -->") == 1
    assert "examples/train_digits.py" in readme
