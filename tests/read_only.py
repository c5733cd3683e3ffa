"""Folders that nobody can write to, and files that nobody can read, for a while: root included
(tests run as root in CI)."""

import contextlib
import os
import pathlib
import shutil
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


def unreadable_by(command: list[str]) -> list[str]:
    """`command` run so that file modes stop it from reading: as is for a user, for root
    (whom modes do not stop) without the capabilities that override them (`setpriv`); skips
    the test where that is not possible."""
    if os.geteuid() != 0:
        return command
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv to drop the right to read any file")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *command]


@contextlib.contextmanager
def unreadable(paths: list[pathlib.Path]) -> Iterator[None]:
    """`paths` (files) with mode 0 until the block ends: unreadable to a process that
    `unreadable_by` started."""
    modes = {path: path.stat().st_mode for path in paths}
    for path in paths:
        path.chmod(0)
    try:
        yield
    finally:
        for path, mode in modes.items():
            path.chmod(mode)
