"""`paddle.distributed.fleet.utils`: file-system clients (`LocalFS`, the `FS` interface), also
at Paddle's module path `fleetjax.fleet.utils.fs`."""

from fleetjax.fleet.utils.fs import FS, FSFileExistsError, FSFileNotExistsError, LocalFS

__all__ = ["FS", "FSFileExistsError", "FSFileNotExistsError", "LocalFS"]
