"""A folder that nobody can write to for a while, root included (tests run as root in CI)."""

import contextlib
import os
import pathlib
import subprocess
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def read_only(folder: pathlib.Path) -> Iterator[pathlib.Path]:
    """`folder`, unwritable until the block ends: mode 0o555, or for root (whom modes do not
    stop) the immutable attribute (`chattr +i`); skips the test where neither is possible."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield folder
        finally:
            folder.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode:
        pytest.skip("running as root without the right to set the immutable attribute")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)
