"""Role makers: which trainer this process is, and who the others are
(Paddle's `paddle.distributed.fleet.base.role_maker`).

Collective mode only: every process is a worker (trainer). The worker count is the number of
worker endpoints, as in Paddle. Each role maker answers Paddle's role queries (`_worker_index()`,
`_worker_num()`, `_get_trainer_endpoints()`, ...; the interface a user-defined role maker
implements) and carries Paddle's collectives between workers (`_all_reduce`, `_all_gather`,
`_barrier`, which `fleet.util` uses). The plain attributes (`worker_index`, `worker_num`,
`worker_endpoints`, ...) read the same answers.
"""

from __future__ import annotations

import enum
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fleetjax._warnings import warn_once

__all__ = [
    "JaxProcessRoleMaker",
    "PaddleCloudRoleMaker",
    "Role",
    "RoleMakerBase",
    "UserDefinedRoleMaker",
]

_LOCAL_ENDPOINT = "127.0.0.1:6170"  # Paddle's endpoint for a single, non-distributed trainer
_PS_ERROR = (
    "parameter-server mode is not supported yet: fleetjax trains in collective mode "
    "(is_collective=True)"
)
_REDUCE: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.sum,
    "mean": np.mean,
    "max": np.max,
    "min": np.min,
}


class Role(enum.IntEnum):
    """Paddle's process roles; in collective mode every process is a WORKER."""

    WORKER = 1
    SERVER = 2
    HETER_WORKER = 3
    ALL = 4
    COORDINATOR = 5


def _parse_endpoint(endpoint: str, source: str) -> str:
    host, sep, port = endpoint.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{source}: {endpoint!r} is not an endpoint of the form host:port")
    return f"{host}:{port}"


class RoleMakerBase:
    """Paddle's `RoleMakerBase`: the interface of a role maker.

    `RoleMakerBase()` knows no role: its role queries raise `NotImplementedError`, and its
    collectives warn and return None, as Paddle's do. Subclass it and implement the queries
    (`_worker_index`, `_worker_num`, `_node_num`, ...) to give `fleet.init` a role of your own.
    """

    _is_collective = True  # fleetjax has collective mode only

    def __init__(self) -> None:
        self._worker_endpoints: list[str] = []
        self._server_endpoints: list[str] = []
        self._cur_endpoint = ""
        self._role_is_generated = False
        self._role: Role | None = None
        self._current_id = -1

    # -- Paddle's role queries: a subclass answers them --------------------------------------
    def _unknown(self, query: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} knows no role: {query}() is answered by a role maker such as"
            " PaddleCloudRoleMaker or UserDefinedRoleMaker, or by a subclass that implements it"
        )

    def _is_worker(self) -> bool:
        raise self._unknown("_is_worker")

    def _is_server(self) -> bool:
        raise self._unknown("_is_server")

    def _is_first_worker(self) -> bool:
        raise self._unknown("_is_first_worker")

    def _worker_num(self) -> int:
        raise self._unknown("_worker_num")

    def _server_num(self) -> int:
        raise self._unknown("_server_num")

    def _worker_index(self) -> int:
        raise self._unknown("_worker_index")

    def _server_index(self) -> int:
        raise self._unknown("_server_index")

    def _role_id(self) -> int:
        raise self._unknown("_role_id")

    def _node_num(self) -> int:
        raise self._unknown("_node_num")

    def _get_trainer_endpoints(self) -> list[str]:
        return self._worker_endpoints

    def _get_pserver_endpoints(self) -> list[str]:
        return self._server_endpoints

    def to_string(self) -> str:
        return (
            f"role: {self._role}, current_id: {self._current_id}, worker_endpoints: "
            f"{self._worker_endpoints}, server_endpoints: {self._server_endpoints}"
        )

    # -- Paddle's collectives between workers ----------------------------------------------
    def _no_workers(self, what: str) -> None:
        warnings.warn(
            f"{type(self).__name__} has no workers to {what}: it knows no role", stacklevel=3
        )

    def _all_gather(self, input: Any, comm_world: str = "worker") -> list[Any] | None:
        self._no_workers("gather from")
        return None

    def _all_reduce(self, input: Any, mode: str = "sum", comm_world: str = "worker") -> Any:
        self._no_workers("reduce over")
        return None

    def _barrier(self, comm_world: str) -> None:
        self._no_workers("wait for")

    # -- the same answers as attributes ------------------------------------------------------
    @property
    def is_collective(self) -> bool:
        return self._is_collective

    @property
    def role(self) -> Role | None:
        return self._role

    @property
    def worker_index(self) -> int:
        """This worker's index, 0 .. worker_num - 1."""
        return self._worker_index()

    @property
    def worker_num(self) -> int:
        return self._worker_num()

    @property
    def worker_endpoints(self) -> list[str]:
        """Every worker's `host:port`, in index order."""
        return list(self._get_trainer_endpoints())

    @property
    def current_endpoint(self) -> str | None:
        """This worker's endpoint (None when unknown)."""
        return self._cur_endpoint or None

    @property
    def node_num(self) -> int:
        """The number of distinct hosts among the workers."""
        return self._node_num()

    @property
    def is_distributed(self) -> bool:
        """Whether there are several worker processes (and so `jax.distributed` is used)."""
        return self._worker_num() > 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_string()})"


def _check_world(comm_world: str) -> None:
    if comm_world not in ("worker", "all"):
        raise NotImplementedError(
            f"comm_world={comm_world!r}: collective mode has only workers ('worker', or 'all' "
            "which is the same group; 'server' is a parameter-server group)"
        )


def _like_input(value: np.ndarray, template: Any) -> Any:
    """`value` in the kind of container `template` was: scalar, list or numpy array."""
    if isinstance(template, np.ndarray):
        return value
    if isinstance(template, (list, tuple)):
        return value.tolist()
    return value.item()


def _gather(input: Any) -> np.ndarray:
    """Every process's `input`, stacked on a new leading axis in process order."""
    import jax  # here: role makers are configuration until they communicate
    from jax.experimental import multihost_utils

    value = np.asarray(input)
    if jax.process_count() == 1:
        return value[None]
    return np.asarray(multihost_utils.process_allgather(value))


class _CollectiveRoleMaker(RoleMakerBase):
    """A worker among workers that JAX's multi-process runtime connects (one per process)."""

    def _all_gather(self, input: Any, comm_world: str = "worker") -> list[Any]:
        """Every worker's `input`, as a list in worker order."""
        _check_world(comm_world)
        return [_like_input(row, input) for row in _gather(input)]

    def _all_reduce(self, input: Any, mode: str = "sum", comm_world: str = "worker") -> Any:
        """`input` (a number, list or numpy array) reduced element-wise over the workers with
        `mode` ("sum", "mean", "max" or "min"); the same kind of value as `input`."""
        _check_world(comm_world)
        if mode not in _REDUCE:
            raise ValueError(f"mode must be one of {', '.join(_REDUCE)}, got {mode!r}")
        return _like_input(_REDUCE[mode](_gather(input), axis=0), input)

    def _barrier(self, comm_world: str = "worker") -> None:
        """Wait until every worker reaches this call."""
        _check_world(comm_world)
        import jax
        from jax.experimental import multihost_utils

        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("fleetjax.barrier_worker")

    def _generate_role(self) -> None:
        """Paddle reads the role on first use; fleetjax reads and checks it when the role maker
        is made, so that a bad environment fails before anything runs. Nothing is left to do."""

    def _is_worker(self) -> bool:
        return self._role == Role.WORKER

    def _is_server(self) -> bool:
        return False

    def _is_coordinator(self) -> bool:
        return False

    def _is_heter_worker(self) -> bool:
        return False

    def _heter_worker_num(self) -> int:
        return 0

    def _is_first_worker(self) -> bool:
        return self._current_id == 0

    def _worker_index(self) -> int:
        return self._current_id

    def _role_id(self) -> int:
        return self._current_id

    def _server_num(self) -> int:
        return 0

    def _server_index(self) -> int:
        """0: there are no parameter servers (Paddle answers the worker index)."""
        return 0


class _EndpointRoleMaker(_CollectiveRoleMaker):
    """A worker whose role is its index among the listed worker endpoints."""

    def __init__(
        self,
        is_collective: bool,
        worker_index: int,
        worker_endpoints: Sequence[str],
        current_endpoint: str | None,
        source: str,
    ) -> None:
        super().__init__()
        if not isinstance(is_collective, bool):
            raise TypeError(f"is_collective must be bool, got {type(is_collective).__name__}")
        if not is_collective:
            raise NotImplementedError(_PS_ERROR)
        if isinstance(worker_endpoints, str) or not worker_endpoints:
            raise ValueError(f"{source}: worker endpoints must be a non-empty list of host:port")
        endpoints = [_parse_endpoint(e, source) for e in worker_endpoints]
        if len(set(endpoints)) != len(endpoints):
            raise ValueError(f"{source}: worker endpoints repeat: {endpoints}")
        if not isinstance(worker_index, int) or isinstance(worker_index, bool):
            raise TypeError(f"{source}: the worker index must be int, got {worker_index!r}")
        if not 0 <= worker_index < len(endpoints):
            raise ValueError(
                f"{source}: worker index {worker_index} is outside 0..{len(endpoints) - 1} "
                f"for {len(endpoints)} worker endpoints"
            )
        expected = endpoints[worker_index]
        if current_endpoint is not None and _parse_endpoint(current_endpoint, source) != expected:
            raise ValueError(
                f"{source}: the current endpoint {current_endpoint!r} is not worker "
                f"{worker_index}'s endpoint {expected!r}"
            )
        self._role = Role.WORKER
        self._current_id = worker_index
        self._worker_endpoints = endpoints
        self._cur_endpoint = expected
        self._role_is_generated = True
        self._non_distributed = False

    def _worker_num(self) -> int:
        return len(self._worker_endpoints)

    def _node_num(self) -> int:
        return len({e.rpartition(":")[0] for e in self._worker_endpoints})

    _get_node_num = _node_num

    def _get_trainer_endpoint(self) -> str:
        return self._cur_endpoint

    def _is_non_distributed(self) -> bool:
        """Whether no launcher described the workers (Paddle's plain `python train.py`)."""
        return self._non_distributed


class PaddleCloudRoleMaker(_EndpointRoleMaker):
    """The role from the environment that `fleetrun` (or `fleetjax-run`) sets.

    Reads `PADDLE_TRAINER_ID` (default 0), `PADDLE_TRAINER_ENDPOINTS` (comma-separated
    host:port; unset means a single, non-distributed worker), `PADDLE_CURRENT_ENDPOINT`, and
    Paddle's per-node `PADDLE_RANK_IN_NODE`, `PADDLE_LOCAL_DEVICE_IDS`,
    `PADDLE_WORLD_DEVICE_IDS`. The worker count is the endpoint count; a `PADDLE_TRAINERS_NUM`
    that differs warns once and is ignored, as Paddle ignores it. Unlike Paddle,
    `is_collective` defaults to True: parameter-server mode is not supported.

    Args:
      is_collective: must be True.
      environ: the environment to read; default `os.environ` at construction time.
      init_gloo: Paddle's switch for its Gloo collectives; JAX brings its own CPU collectives
        (Gloo), so there is nothing to set up.
    """

    def __init__(
        self,
        is_collective: bool = True,
        environ: Mapping[str, str] | None = None,
        *,
        init_gloo: bool = False,
    ) -> None:
        del init_gloo  # JAX's CPU collectives need no set-up
        env = os.environ if environ is None else environ
        raw_id = env.get("PADDLE_TRAINER_ID", "0")
        try:
            worker_index = int(raw_id)
        except ValueError:
            raise ValueError(f"PADDLE_TRAINER_ID must be an integer, got {raw_id!r}") from None
        endpoints_text = env.get("PADDLE_TRAINER_ENDPOINTS", "")
        endpoints = [e for e in endpoints_text.split(",") if e.strip()]
        _check_trainers_num(env.get("PADDLE_TRAINERS_NUM"), endpoints or [_LOCAL_ENDPOINT])
        super().__init__(
            is_collective,
            worker_index,
            endpoints or [_LOCAL_ENDPOINT],
            env.get("PADDLE_CURRENT_ENDPOINT"),
            source="PADDLE_TRAINER_ENDPOINTS/PADDLE_TRAINER_ID",
        )
        self._non_distributed = not endpoints
        self._local_rank = env.get("PADDLE_RANK_IN_NODE")
        self._local_device_ids = env.get("PADDLE_LOCAL_DEVICE_IDS")
        self._world_device_ids = env.get("PADDLE_WORLD_DEVICE_IDS")

    def _get_local_rank(self) -> str | None:
        return self._local_rank

    def _get_local_device_ids(self) -> str | None:
        return self._local_device_ids

    def _get_world_device_ids(self) -> str | None:
        return self._world_device_ids


def _check_trainers_num(trainers: str | None, endpoints: list[str]) -> None:
    """Paddle's collective role maker counts the endpoints and ignores PADDLE_TRAINERS_NUM
    (Paddle's own test set-ups rely on that); a different value warns once."""
    if trainers is not None and trainers.strip() != str(len(endpoints)):
        warn_once(
            f"PADDLE_TRAINERS_NUM={trainers} but PADDLE_TRAINER_ENDPOINTS lists {len(endpoints)} "
            f"endpoint(s) ({','.join(endpoints)}): the worker count is the endpoint count, "
            f"{len(endpoints)}, as in Paddle"
        )


class UserDefinedRoleMaker(_EndpointRoleMaker):
    """A role given in code, e.g. `UserDefinedRoleMaker(current_id=1,
    worker_endpoints=["10.0.0.1:6170", "10.0.0.2:6170"])`.

    Paddle's parameter-server arguments (`server_endpoints`, a `role` other than WORKER) are
    refused; `worker_num`, if given, must match the endpoints.
    """

    def __init__(
        self,
        is_collective: bool = True,
        init_gloo: bool = False,
        *,
        current_id: int = 0,
        worker_endpoints: Sequence[str] | None = None,
        role: Role = Role.WORKER,
        worker_num: int | None = None,
        server_endpoints: Sequence[str] | None = None,
    ) -> None:
        del init_gloo  # JAX brings its own CPU collectives (gloo); nothing to set up
        if role != Role.WORKER or server_endpoints:
            raise NotImplementedError(_PS_ERROR)
        endpoints = list(worker_endpoints or [_LOCAL_ENDPOINT])
        if worker_num is not None and worker_num != len(endpoints):
            raise ValueError(
                f"worker_num={worker_num} but worker_endpoints lists {len(endpoints)} endpoints"
            )
        super().__init__(is_collective, current_id, endpoints, None, source="UserDefinedRoleMaker")


class JaxProcessRoleMaker(_CollectiveRoleMaker):
    """The role of a process in JAX's multi-process runtime, joined by the script
    (`jax.distributed.initialize()`) or by `fleet.init()` through JAX's cluster detection
    (SLURM, Open MPI, Kubernetes, ...).

    The worker index and count are JAX's process index and count. Other processes' endpoints
    are not known, so `worker_endpoints` is empty.
    """

    def __init__(self) -> None:
        import jax  # here: only this role maker needs the JAX runtime

        if not jax.distributed.is_initialized():
            raise RuntimeError(
                "JaxProcessRoleMaker needs jax.distributed.initialize() to have been called"
            )
        super().__init__()
        self._role = Role.WORKER
        self._current_id = jax.process_index()
        self._trainers_num = jax.process_count()
        self._role_is_generated = True

    def _worker_num(self) -> int:
        return self._trainers_num

    def _node_num(self) -> int:
        raise RuntimeError(
            "the node count is unknown when the cluster set up jax.distributed itself; "
            "jax.process_count() is the process count"
        )
