"""File-system clients (Paddle's `paddle.distributed.fleet.utils.fs`): the `FS` interface and
`LocalFS`, the local file system behind it."""

from __future__ import annotations

import os
import shutil

__all__ = ["FS", "FSFileExistsError", "FSFileNotExistsError", "LocalFS"]


class FSFileExistsError(FileExistsError):
    """The destination path exists (and the call does not overwrite it)."""


class FSFileNotExistsError(FileNotFoundError):
    """The source path does not exist."""


class FS:
    """Paddle's file-system interface; every method raises `NotImplementedError` until a client
    (such as `LocalFS`) implements it. `fleet.util._set_file_system` takes an `FS`."""

    def ls_dir(self, fs_path: str) -> tuple[list[str], list[str]]:
        raise NotImplementedError

    def is_file(self, fs_path: str) -> bool:
        raise NotImplementedError

    def is_dir(self, fs_path: str) -> bool:
        raise NotImplementedError

    def is_exist(self, fs_path: str) -> bool:
        raise NotImplementedError

    def upload(self, local_path: str, fs_path: str) -> None:
        raise NotImplementedError

    def download(self, fs_path: str, local_path: str) -> None:
        raise NotImplementedError

    def mkdirs(self, fs_path: str) -> None:
        raise NotImplementedError

    def delete(self, fs_path: str) -> None:
        raise NotImplementedError

    def need_upload_download(self) -> bool:
        raise NotImplementedError

    def rename(self, fs_src_path: str, fs_dst_path: str) -> None:
        raise NotImplementedError

    def mv(
        self, fs_src_path: str, fs_dst_path: str, overwrite: bool = False, test_exists: bool = False
    ) -> None:
        raise NotImplementedError

    def upload_dir(self, local_dir: str, dest_dir: str) -> None:
        raise NotImplementedError

    def list_dirs(self, fs_path: str) -> list[str]:
        raise NotImplementedError

    def touch(self, fs_path: str, exist_ok: bool = True) -> None:
        raise NotImplementedError

    def cat(self, fs_path: str | None = None) -> str:
        raise NotImplementedError


class LocalFS(FS):
    """Paddle's `LocalFS`: the local file system through the `FS` interface.

    Listings are sorted by name, so that every worker sees the same order (Paddle's follow
    `os.listdir`). `upload`, `download` and `upload_dir` copy (Paddle's `LocalFS` leaves them
    unimplemented; `need_upload_download()` is False: a local path needs no copying).

    Example:
      >>> fs = LocalFS()
      >>> fs.mkdirs("ckpt/step_10"); fs.touch("ckpt/step_10/done")
      >>> fs.ls_dir("ckpt")
      (['step_10'], [])
    """

    def ls_dir(self, fs_path: str) -> tuple[list[str], list[str]]:
        """(subdirectories, files) directly under `fs_path`; ([], []) if it does not exist."""
        if not self.is_exist(fs_path):
            return [], []
        names = sorted(os.listdir(fs_path))
        dirs = [n for n in names if os.path.isdir(os.path.join(fs_path, n))]
        return dirs, [n for n in names if n not in dirs]

    def list_dirs(self, fs_path: str) -> list[str]:
        """The subdirectories directly under `fs_path`; [] if it does not exist."""
        return self.ls_dir(fs_path)[0]

    def is_file(self, fs_path: str) -> bool:
        return os.path.isfile(fs_path)

    def is_dir(self, fs_path: str) -> bool:
        return os.path.isdir(fs_path)

    def is_exist(self, fs_path: str) -> bool:
        return os.path.exists(fs_path)

    def mkdirs(self, fs_path: str) -> None:
        """Create the directory `fs_path` and its parents (nothing if it exists)."""
        if os.path.isfile(fs_path):
            raise FSFileExistsError(f"{fs_path} is already a file")
        os.makedirs(fs_path, exist_ok=True)

    def delete(self, fs_path: str) -> None:
        """Remove the file or directory tree `fs_path` (nothing if it does not exist)."""
        if os.path.isdir(fs_path) and not os.path.islink(fs_path):
            shutil.rmtree(fs_path)
        elif os.path.lexists(fs_path):
            os.remove(fs_path)

    def rename(self, fs_src_path: str, fs_dst_path: str) -> None:
        os.rename(fs_src_path, fs_dst_path)

    def mv(
        self, src_path: str, dst_path: str, overwrite: bool = False, test_exists: bool = False
    ) -> None:
        """Move `src_path` to `dst_path`, replacing it only with `overwrite`.

        Raises:
          FSFileNotExistsError: `src_path` does not exist.
          FSFileExistsError: `dst_path` exists and `overwrite` is False.
        """
        if not self.is_exist(src_path):
            raise FSFileNotExistsError(f"{src_path} does not exist")
        if overwrite:
            self.delete(dst_path)
        if self.is_exist(dst_path):
            raise FSFileExistsError(f"{dst_path} exists")
        self.rename(src_path, dst_path)

    def touch(self, fs_path: str, exist_ok: bool = True) -> None:
        """Create the empty file `fs_path`; if it exists, nothing, or an error without
        `exist_ok`."""
        if self.is_exist(fs_path):
            if exist_ok:
                return
            raise FSFileExistsError(f"{fs_path} exists")
        with open(fs_path, "a"):
            pass

    def need_upload_download(self) -> bool:
        """False: a local path is read and written where it is."""
        return False

    def upload(self, local_path: str, fs_path: str, overwrite: bool = False) -> None:
        """Copy the file or directory `local_path` to `fs_path`.

        Raises:
          FSFileNotExistsError: `local_path` does not exist.
          FSFileExistsError: `fs_path` exists and `overwrite` is False.
        """
        _copy(local_path, fs_path, overwrite)

    def download(self, fs_path: str, local_path: str, overwrite: bool = False) -> None:
        """Copy the file or directory `fs_path` to `local_path` (errors as `upload`)."""
        _copy(fs_path, local_path, overwrite)

    def upload_dir(self, local_dir: str, dest_dir: str, overwrite: bool = False) -> None:
        """Copy the directory `local_dir` into `dest_dir` (created if missing), as
        `dest_dir/<name of local_dir>`."""
        self.mkdirs(dest_dir)
        target = os.path.join(dest_dir, os.path.basename(os.path.normpath(local_dir)))
        _copy(local_dir, target, overwrite)

    def cat(self, fs_path: str | None = None) -> str:
        """The text of the file `fs_path`, its lines joined by newlines; "" if it is not a
        file."""
        if fs_path is None or not self.is_file(fs_path):
            return ""
        with open(fs_path) as f:
            return "\n".join(f.read().splitlines())


def _copy(src: str, dst: str, overwrite: bool) -> None:
    if not os.path.exists(src):
        raise FSFileNotExistsError(f"{src} does not exist")
    if os.path.lexists(dst):
        if not overwrite:
            raise FSFileExistsError(f"{dst} exists")
        LocalFS().delete(dst)
    if os.path.isdir(src):
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)
