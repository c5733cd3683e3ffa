"""Paddle's role queries on the fleet (`fleet.worker_index()`, `fleet.is_server()`, ...): the
answers of the role maker that `fleet.init` set up."""

from __future__ import annotations

from fleetjax.fleet.base.role_maker import RoleMakerBase

__all__ = ["RoleQueries"]


class RoleQueries:
    """The fleet's role, and Paddle's queries of it (a part of `Fleet`)."""

    _role: RoleMakerBase | None = None

    def _checked_role(self) -> RoleMakerBase:
        if self._role is None:
            raise RuntimeError("call fleet.init() first")
        return self._role

    def worker_index(self) -> int:
        return self._checked_role()._worker_index()

    def worker_num(self) -> int:
        return self._checked_role()._worker_num()

    def is_first_worker(self) -> bool:
        return self._checked_role()._is_first_worker()

    def is_worker(self) -> bool:
        return self._checked_role()._is_worker()

    def worker_endpoints(self, to_string: bool = False) -> list[str] | str:
        endpoints = self._checked_role()._get_trainer_endpoints()
        return ",".join(endpoints) if to_string else list(endpoints)

    def node_num(self) -> int:
        return self._checked_role()._node_num()

    def server_num(self) -> int:
        """The parameter servers' count (0 in collective mode)."""
        return self._checked_role()._server_num()

    def server_index(self) -> int:
        """This process's index (Paddle's `current_id`; 0 in collective mode)."""
        return self._checked_role()._server_index()

    def server_endpoints(self, to_string: bool = False) -> list[str] | str:
        """The parameter servers' endpoints (empty in collective mode)."""
        endpoints = self._checked_role()._get_pserver_endpoints()
        return ",".join(endpoints) if to_string else list(endpoints)

    def is_server(self) -> bool:
        return self._checked_role()._is_server()

    def barrier_worker(self) -> None:
        """Wait until every worker process reaches this call (a real cross-process barrier)."""
        self._checked_role()._barrier("worker")
