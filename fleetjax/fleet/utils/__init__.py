"""`paddle.distributed.fleet.utils`: file-system clients (`LocalFS`, the `FS` interface), also
at Paddle's module path `fleetjax.fleet.utils.fs`, and Megatron's sequence parallelism at
`fleetjax.fleet.utils.sequence_parallel_utils`."""

from fleetjax.fleet.utils import sequence_parallel_utils
from fleetjax.fleet.utils.fs import FS, FSFileExistsError, FSFileNotExistsError, LocalFS

__all__ = ["FS", "FSFileExistsError", "FSFileNotExistsError", "LocalFS", "sequence_parallel_utils"]
