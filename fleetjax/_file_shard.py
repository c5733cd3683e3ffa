"""Paddle's split of a file list over the workers (`fleet.util.get_file_shard`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def file_shard(files: Sequence[T], index: int, count: int) -> list[T]:
    """Worker `index` of `count`'s contiguous block of `files`, as Paddle splits them: blocks of
    `len(files) // count`, the first `len(files) % count` workers one file more.

    Example: five files over two workers: worker 0 reads files 0-2, worker 1 files 3-4.
    """
    size, extra = divmod(len(files), count)
    start = index * size + min(index, extra)
    return list(files[start : start + size + (index < extra)])
