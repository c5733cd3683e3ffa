"""`fleet.util`: small helpers across the worker processes (Paddle's
`paddle.distributed.fleet.base.util_factory`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fleetjax._file_shard import file_shard
from fleetjax.fleet.utils.fs import FS

if TYPE_CHECKING:
    from fleetjax.fleet.base.role_maker import RoleMakerBase
    from fleetjax.strategy import DistributedStrategy, Strategy

__all__ = ["UtilBase", "UtilFactory"]


class UtilFactory:
    """Paddle's `UtilFactory`: makes a `UtilBase` from a fleet context."""

    def _create_util(self, context: Mapping[str, Any] | None = None) -> UtilBase:
        """A `UtilBase` with the context's "valid_strategy" and "role_maker", where given."""
        util = UtilBase()
        if context is not None and "valid_strategy" in context:
            util._set_strategy(context["valid_strategy"])
        if context is not None and "role_maker" in context:
            util._set_role_maker(context["role_maker"])
        return util


class UtilBase:
    """Paddle's `fleet.util`: reductions, gathers and barriers over the worker processes (one per
    `jax.process_index()`), file sharding and rank-0 printing.

    `fleet.init` gives `fleet.util` its role maker; a `UtilBase()` of your own (or a subclass,
    Paddle's way to add helpers) gets one with `_set_role_maker`.

    Attributes:
      role_maker: the role maker that says which worker this is (None until set).
      dist_strategy: the strategy in effect (None until set).
      fs_client: the file system set with `_set_file_system` (e.g. a `fleet.utils.LocalFS`).
    """

    def __init__(self) -> None:
        self.role_maker: RoleMakerBase | None = None
        self.dist_strategy: DistributedStrategy | Strategy | None = None
        self.fs_client: FS | None = None

    def _set_strategy(self, dist_strategy: DistributedStrategy | Strategy | None) -> None:
        self.dist_strategy = dist_strategy

    def _set_role_maker(self, role_maker: RoleMakerBase | None) -> None:
        self.role_maker = role_maker

    def _set_file_system(self, fs_client: FS) -> None:
        if not isinstance(fs_client, FS):
            raise TypeError(
                "fs_client must be a fleetjax.fleet.utils.FS (such as LocalFS), "
                f"got {type(fs_client).__name__}"
            )
        self.fs_client = fs_client

    def _role(self) -> RoleMakerBase:
        if self.role_maker is None:
            raise RuntimeError(
                "fleet.util has no role maker yet: call fleet.init() first "
                "(or util._set_role_maker(role_maker))"
            )
        return self.role_maker

    def all_reduce(self, input: Any, mode: str = "sum", comm_world: str = "worker") -> Any:
        """Reduce `input` (a number, list, tuple or numpy array) element-wise over the workers.

        `mode` is "sum", "mean", "max" or "min". Returns the same kind of value as `input`
        (a list for a tuple); Paddle returns a numpy array.
        """
        if isinstance(input, tuple):
            input = list(input)
        return self._role()._all_reduce(input, mode, comm_world)

    def all_gather(self, input: Any, comm_world: str = "worker") -> list[Any]:
        """Every worker's `input`, as a list in worker order."""
        return self._role()._all_gather(input, comm_world)

    def barrier(self, comm_world: str = "worker") -> None:
        """Wait until every worker reaches this call."""
        self._role()._barrier(comm_world)

    def get_file_shard(self, files: list[str]) -> list[str]:
        """This worker's contiguous block of `files`, as Paddle splits them: blocks of
        `len(files) // workers`, the first `len(files) % workers` workers one file more.

        Example: five files over two workers: worker 0 reads files 0-2, worker 1 files 3-4.
        """
        if not isinstance(files, list):
            raise TypeError("files should be a list of file need to be read.")
        role = self._role()
        return file_shard(files, role._worker_index(), role._worker_num())

    def print_on_rank(self, message: Any, rank_id: int) -> None:
        """Print `message` on worker `rank_id` only."""
        if self._role()._worker_index() == rank_id:
            print(message, flush=True)
