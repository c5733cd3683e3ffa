"""The order tests start in under pytest-xdist: the longest first."""

import collections

import pytest

# The longest tests and files, longest first (the slow part's worker-seconds under `pytest -n 2
# -m slow` on 2 cores): they start first, so that none starts last while the other worker idles.
# Everything else follows by its file's number of tests, as pytest-xdist orders files itself;
# `--no-loadscope-reorder` (pyproject.toml) tells xdist to keep this order. A file's longest test
# comes first in it: xdist hands a worker its next file when two tests of the current one are left.
LONGEST_FIRST = (
    "tests/tools/test_scale.py",  # 600 s
    "tests/tools/test_sequence_memory.py::test_a_layer_keeps_korthikantis",  # 200 s
    "tests/tools/test_sequence_memory.py::test_sequence_parallel_divides",  # 190 s
    "tests/tools/test_sequence_memory.py",  # 280 s
    "tests/tools/test_auto.py::test_gpt_pipeline_layer_adds_pipeline_candidates",  # 240 s
    "tests/tools/test_auto.py::test_gpt_search_with_a_tight_budget",  # 190 s
    "tests/tools/test_auto.py",  # 210 s
    "tests/core/test_deviceless.py::test_a_175b_gpt_layout",  # 210 s
    "tests/core/test_deviceless.py",  # 130 s
    "tests/core/test_sequence_axes.py::test_long_sequence_example",  # 150 s
    "tests/core/test_sequence_axes.py",  # 380 s
    "tests/core/test_hybrid.py",  # 520 s
    "tests/project/test_examples.py",  # 460 s
    "tests/project/test_notebooks.py",  # 300 s
)


def start_order(items: list[pytest.Item]) -> list[pytest.Item]:
    """`items` in the order they should start: `LONGEST_FIRST`, then files with more tests."""
    per_file = collections.Counter(item.nodeid.split("::")[0] for item in items)

    def rank(item: pytest.Item) -> tuple[int, int]:
        listed = (i for i, name in enumerate(LONGEST_FIRST) if item.nodeid.startswith(name))
        return next(listed, len(LONGEST_FIRST)), -per_file[item.nodeid.split("::")[0]]

    return sorted(items, key=rank)


@pytest.hookimpl(trylast=True)  # after -m has deselected: count the tests that run
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = start_order(items)
