"""Paddle's parameter-server runtime calls (`init_worker`, `init_server`, `run_server`,
`stop_worker`) in fleetjax's parameter-server mode.

fleetjax's tables live sharded over the trainers' devices and a training step is one SPMD
program over the trainers (`fleetjax.layers.SparseEmbedding`, docs/parameter_server.md): the
trainers have nothing to pull or push, and the servers hold and serve nothing. So a trainer's
calls and a server's calls each log one line and return, and a Paddle PS script runs with its
branches as they are:

    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()        # returns at once: the server process ends
    else:
        fleet.init_worker()
        ...train...
        fleet.stop_worker()
"""

from __future__ import annotations

import logging
import warnings

from fleetjax._warnings import user_stacklevel, warn_once
from fleetjax.fleet._roles import RoleQueries
from fleetjax.fleet.base.role_maker import Role, RoleMakerBase

__all__ = ["ParameterServerCallError", "ParameterServerCalls", "non_distributed", "runtime_call"]

logger = logging.getLogger("fleetjax")

_TABLES = "fleetjax's sparse tables live sharded over the trainers' devices"
# The role each call is for, and what it does in fleetjax.
_CALLS = {
    "init_worker": (Role.WORKER, f"{_TABLES}, so there is nothing to pull"),
    "stop_worker": (Role.WORKER, "the trainers' step has no communicator to stop"),
    "init_server": (Role.SERVER, f"{_TABLES}, so this server holds none"),
    "run_server": (Role.SERVER, f"{_TABLES}, so this server has nothing to serve and ends"),
}


class ParameterServerCallError(NotImplementedError, ValueError):
    """A parameter-server call in collective mode: Paddle's ValueError ("Fleet can not find
    suitable runtime handler"), also a NotImplementedError."""


def non_distributed(role: RoleMakerBase, name: str) -> bool:
    """Paddle's `is_non_distributed_check`: whether this process is alone (no launcher
    described a job), in which case Paddle's runtime and saving call `name` warns and does
    nothing, in either mode."""
    if not getattr(role, "_is_non_distributed", lambda: False)():
        return False
    message = f"{name}() function doesn't work when use non_distributed fleet."
    warnings.warn(message, stacklevel=user_stacklevel())
    return True


def runtime_call(role: RoleMakerBase, name: str, has_args: bool = False) -> None:
    """Paddle's parameter-server call `name` for this process's `role`: one log line (a warning
    for a process alone, as in Paddle).

    Raises:
      ParameterServerCallError: in collective mode, as Paddle (no runtime handler).
      ValueError: for a trainer's call on a server or a server's call on a trainer.
    """
    if non_distributed(role, name):
        return
    if role.is_collective:
        raise ParameterServerCallError(
            f"{name}() is a parameter-server call, but the fleet is in collective mode: Fleet "
            "can not find suitable runtime handler (fleet.init(is_collective=False) starts "
            "parameter-server mode)"
        )
    expected, what = _CALLS[name]
    if role.role != expected:
        wanted, this = ("trainer", "server") if expected == Role.WORKER else ("server", "trainer")
        raise ValueError(
            f"{name}() is a parameter-server {wanted}'s call, but this process is {this} "
            f"{role._worker_index()} (TRAINING_ROLE); branch on fleet.is_server()"
        )
    if name == "init_server" and has_args:
        warn_once(
            "fleet.init_server(dirname, ...) loads saved tables into Paddle's servers; fleetjax's "
            "tables live on the trainers, which load them with fleet.load_persistables"
        )
    logger.info("fleet.%s(): %s", name, what)


class ParameterServerCalls(RoleQueries):
    """Paddle's parameter-server runtime calls on the fleet (a part of `Fleet`)."""

    def init_worker(self, scopes: object = None) -> None:
        """A trainer's start in parameter-server mode: logs and returns (the tables live on
        the trainers' devices; nothing to pull). `scopes` are Paddle's static-graph scopes."""
        del scopes  # JAX has no scopes
        runtime_call(self._checked_role(), "init_worker")

    def init_server(self, *args: object, **kwargs: object) -> None:
        """A server's start in parameter-server mode: logs and returns (it holds no table)."""
        runtime_call(self._checked_role(), "init_server", bool(args or kwargs))

    def run_server(self) -> None:
        """A server's loop in parameter-server mode: logs and returns (nothing to serve)."""
        runtime_call(self._checked_role(), "run_server")

    def stop_worker(self) -> None:
        """A trainer's end in parameter-server mode: logs and returns."""
        runtime_call(self._checked_role(), "stop_worker")
