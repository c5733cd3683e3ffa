"""The order tests start in under pytest-xdist: the longest first."""

import collections

import pytest

# The longest tests and files, longest first, with their worker-seconds in the slow part (`pytest
# -n 2 -m slow` on 2 cores, a fresh clone at d60e2a5: 77 worker-minutes in 39 minutes): they start
# first, so that none starts last while the other worker idles. Everything else follows by its
# file's number of tests, as pytest-xdist orders files itself; `--no-loadscope-reorder`
# (pyproject.toml) tells xdist to keep this order. A file's longest test comes first in it: xdist
# hands a worker its next file when two tests of the current one are left.
LONGEST_FIRST = (
    "tests/tools/test_scale.py",  # 259 s, 6 tests
    "tests/tools/test_sequence_memory.py::test_a_layer_keeps_korthikantis",  # 148 s
    "tests/tools/test_sequence_memory.py::test_sequence_parallel_divides",  # 121 s
    "tests/tools/test_sequence_memory.py",  # 206 s more, 3 tests
    "tests/tools/test_auto.py::test_gpt_pipeline_layer_adds_pipeline_candidates",  # 146 s
    "tests/tools/test_auto.py::test_gpt_search_with_a_tight_budget",
    "tests/tools/test_auto.py",  # 338 s with the two above, 10 tests
    "tests/core/test_deviceless.py::test_a_175b_gpt_layout",  # 165 s
    "tests/core/test_deviceless.py",  # 98 s more, 10 tests
    "tests/core/test_sequence_axes.py::test_long_sequence_example",  # 114 s
    "tests/core/test_sequence_axes.py",  # 205 s more, 21 tests
    "tests/core/test_hybrid.py",  # 215 s, 31 tests
    "tests/project/test_examples.py",  # 330 s, 11 tests
    "tests/project/test_notebooks.py",  # 257 s, 7 tests
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
