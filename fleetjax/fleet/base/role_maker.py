"""Role makers: which trainer this process is, and who the others are
(Paddle's `paddle.distributed.fleet.base.role_maker`).

In collective mode every process is a worker (trainer); the worker count is the number of
worker endpoints, as in Paddle. In parameter-server mode (`is_collective=False`) a process is a
trainer or a server, as Paddle's `TRAINING_ROLE` says; the trainers are the workers of one SPMD
job (fleetjax's tables live sharded over their devices) and the servers take part in nothing
(`fleet.run_server()` returns). Each role maker answers Paddle's role queries (`_worker_index()`,
`_worker_num()`, `_get_trainer_endpoints()`, ...; the interface a user-defined role maker
implements) and carries Paddle's collectives between workers (`_all_reduce`, `_all_gather`,
`_barrier`, which `fleet.util` uses). The plain attributes (`worker_index`, `worker_num`,
`worker_endpoints`, ...) read the same answers.
"""

from __future__ import annotations

import enum
import functools
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
_PS_ONLY = (
    "server_endpoints and role=Role.SERVER are parameter-server settings: pass is_collective=False"
)
_REDUCE: dict[str, Callable[..., np.ndarray]] = {
    "sum": np.sum,
    "mean": np.mean,
    "max": np.max,
    "min": np.min,
}


class Role(enum.IntEnum):
    """Paddle's process roles; in collective mode every process is a WORKER, in
    parameter-server mode a WORKER (trainer) or a SERVER."""

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


def _role_query(query: Callable[..., Any]) -> Callable[..., Any]:
    """A role query: the role maker reads its role first if it has not yet (Paddle reads it on
    first use, `_generate_role`, and `fleet.init` asks at once)."""

    @functools.wraps(query)
    def ask(self: RoleMakerBase, *args: Any, **kwargs: Any) -> Any:
        self._generate_role()
        return query(self, *args, **kwargs)

    return ask


class RoleMakerBase:
    """Paddle's `RoleMakerBase`: the interface of a role maker.

    `RoleMakerBase()` knows no role: its role queries raise `NotImplementedError`, and its
    collectives warn and return None, as Paddle's do. Subclass it and implement the queries
    (`_worker_index`, `_worker_num`, `_node_num`, ...) to give `fleet.init` a role of your own.
    """

    _is_collective = True  # a role maker of a parameter-server job says otherwise

    def __init__(self) -> None:
        self._worker_endpoints: list[str] = []
        self._server_endpoints: list[str] = []
        self._cur_endpoint = ""
        self._role_is_generated = False
        self._role: Role | None = None
        self._current_id = -1

    def _generate_role(self) -> None:
        """Read the role (Paddle's; each role query calls it first). A role maker given its
        role when made has nothing left to read."""

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

    @_role_query
    def _get_trainer_endpoints(self) -> list[str]:
        return self._worker_endpoints

    @_role_query
    def _get_pserver_endpoints(self) -> list[str]:
        return self._server_endpoints

    @_role_query
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
    @_role_query
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
    @_role_query
    def current_endpoint(self) -> str | None:
        """This worker's endpoint (None when unknown)."""
        return self._cur_endpoint or None

    @property
    def node_num(self) -> int:
        """The number of distinct hosts among the workers."""
        return self._node_num()

    @property
    @_role_query
    def is_distributed(self) -> bool:
        """Whether this process is a worker among several (and so joins them with
        `jax.distributed`); a parameter server joins nothing."""
        return self._role != Role.SERVER and self._worker_num() > 1

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_string()})"


def _check_world(comm_world: str) -> None:
    if comm_world not in ("worker", "all"):
        raise NotImplementedError(
            f"comm_world={comm_world!r}: collective mode has only workers ('worker', or 'all' "
            "which is the same group; 'server' is a parameter-server group)"
        )


def _like_input(value: np.ndarray, template: Any) -> Any:
    """`value` in the kind of container `template` was: a number, a list, or (for any array,
    numpy's or JAX's) a numpy array."""
    if isinstance(template, (list, tuple)):
        return value.tolist()
    if isinstance(template, (int, float, complex, np.generic)):
        return value.item()
    return value


def _gather(input: Any) -> np.ndarray:
    """Every process's `input`, stacked on a new leading axis in process order."""
    import jax  # here: role makers are configuration until they communicate
    from jax.experimental import multihost_utils

    value = np.asarray(input)
    if jax.process_count() == 1:
        return value[None]
    return np.asarray(multihost_utils.process_allgather(value))


class _CollectiveRoleMaker(RoleMakerBase):
    """A worker among workers that JAX's multi-process runtime connects (one per process), or
    in parameter-server mode a trainer or a server."""

    _trainers_num = 1
    _non_distributed = False

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

    @_role_query
    def _is_worker(self) -> bool:
        return self._role == Role.WORKER

    @_role_query
    def _is_server(self) -> bool:
        return self._role == Role.SERVER

    def _is_coordinator(self) -> bool:
        return False

    def _is_heter_worker(self) -> bool:
        return False

    def _heter_worker_num(self) -> int:
        return 0

    @_role_query
    def _is_first_worker(self) -> bool:
        return self._role == Role.WORKER and self._current_id == 0

    @_role_query
    def _worker_index(self) -> int:
        """The worker's index (Paddle's `current_id`: on a server, the server's index)."""
        return self._current_id

    @_role_query
    def _role_id(self) -> int:
        return self._current_id

    @_role_query
    def _worker_num(self) -> int:
        return self._trainers_num

    @_role_query
    def _server_num(self) -> int:
        return len(self._server_endpoints)

    @_role_query
    def _server_index(self) -> int:
        """Paddle's `current_id` in parameter-server mode; 0 in collective mode, which has no
        servers (Paddle answers the worker index)."""
        return 0 if self._is_collective else self._current_id

    @_role_query
    def _node_num(self) -> int:
        return len({e.rpartition(":")[0] for e in self._worker_endpoints})

    _get_node_num = _node_num

    @_role_query
    def _get_trainer_endpoint(self) -> str:
        return self._cur_endpoint

    @_role_query
    def _is_non_distributed(self) -> bool:
        """Whether no launcher described the processes (Paddle's plain `python train.py`)."""
        return self._non_distributed

    def _parameter_server(
        self,
        role: Role,
        current_id: int,
        trainers_num: int,
        server_endpoints: list[str],
        worker_endpoints: list[str],
        current_endpoint: str,
    ) -> None:
        """Take a parameter-server role: a trainer (`Role.WORKER`) or a server, with Paddle's
        `current_id` (a trainer's index, or a server's in `server_endpoints`)."""
        self._is_collective = False
        self._role, self._current_id, self._trainers_num = role, current_id, trainers_num
        self._server_endpoints, self._worker_endpoints = server_endpoints, worker_endpoints
        self._cur_endpoint, self._role_is_generated = current_endpoint, True
        self._non_distributed = False


def _checked_index(index: Any, count: int, what: str, source: str, among: str) -> int:
    """`index` of a `what` ("worker", "server") among `count` `among` ("worker endpoints")."""
    if not isinstance(index, int) or isinstance(index, bool):
        raise TypeError(f"{source}: the {what} index must be int, got {index!r}")
    if not 0 <= index < count:
        raise ValueError(
            f"{source}: {what} index {index} is outside 0..{count - 1} for {count} {among}"
        )
    return index


def _endpoints(text_or_list: str | Sequence[str] | None, what: str, source: str) -> list[str]:
    """The host:port endpoints of `what` ("worker", "server") from a comma-separated string or
    a list. Workers' must be distinct (each is a process that joins the job); servers' may
    repeat, as in Paddle, with a warning."""
    items = text_or_list.split(",") if isinstance(text_or_list, str) else text_or_list or []
    endpoints = [_parse_endpoint(e, source) for e in items if e.strip()]
    repeated = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if repeated and what != "server":
        raise ValueError(f"{source}: {what} endpoints repeat: {endpoints}")
    if repeated:
        warn_once(
            f"{source}: server endpoints repeat ({', '.join(repeated)}); accepted, as in Paddle, "
            "where those servers would collide on the port. fleetjax's servers hold no tables "
            "and bind nothing, so here it is harmless"
        )
    return endpoints


class _EndpointRoleMaker(_CollectiveRoleMaker):
    """A collective worker whose role is its index among the listed worker endpoints, or a
    parameter-server trainer or server (`_parameter_server`)."""

    def _collective(
        self,
        worker_index: int,
        worker_endpoints: Sequence[str],
        current_endpoint: str | None,
        source: str,
    ) -> None:
        endpoints = _endpoints(worker_endpoints, "worker", source)
        if not endpoints:
            raise ValueError(f"{source}: worker endpoints must be a non-empty list of host:port")
        count = len(endpoints)
        worker_index = _checked_index(worker_index, count, "worker", source, "worker endpoints")
        expected = endpoints[worker_index]
        if current_endpoint is not None and _parse_endpoint(current_endpoint, source) != expected:
            raise ValueError(
                f"{source}: the current endpoint {current_endpoint!r} is not worker "
                f"{worker_index}'s endpoint {expected!r}"
            )
        self._role = Role.WORKER
        self._current_id = worker_index
        self._worker_endpoints = endpoints
        self._trainers_num = len(endpoints)
        self._cur_endpoint = expected
        self._role_is_generated = True
        self._non_distributed = False


def _check_mode(is_collective: Any) -> bool:
    if not isinstance(is_collective, bool):
        raise TypeError(f"is_collective must be bool, got {type(is_collective).__name__}")
    return is_collective


class PaddleCloudRoleMaker(_EndpointRoleMaker):
    """The role from the environment that `fleetrun` (or `fleetjax-run`) sets, read as Paddle
    reads it: on first use (`_generate_role()`, which every role query and `fleet.init` call),
    not when the role maker is made.

    Collective mode reads `PADDLE_TRAINER_ID` (default 0), `PADDLE_TRAINER_ENDPOINTS`
    (comma-separated host:port; unset means a single, non-distributed worker),
    `PADDLE_CURRENT_ENDPOINT`, and Paddle's per-node `PADDLE_RANK_IN_NODE`,
    `PADDLE_LOCAL_DEVICE_IDS`, `PADDLE_WORLD_DEVICE_IDS`. The worker count is the endpoint
    count; a `PADDLE_TRAINERS_NUM` that differs warns once and is ignored, as Paddle ignores it.

    Parameter-server mode (`is_collective=False`) reads Paddle's `TRAINING_ROLE` (TRAINER or
    PSERVER), `PADDLE_PSERVERS_IP_PORT_LIST`, `PADDLE_TRAINERS_NUM`, `PADDLE_TRAINER_ID` (a
    trainer's), `POD_IP` and `PADDLE_PORT` (this process's endpoint; a server's index is its
    place in the server list) and `PADDLE_TRAINER_ENDPOINTS` (where the trainers join; required
    for several, unless `JAX_COORDINATOR_ADDRESS` is set). Without
    `PADDLE_PSERVERS_IP_PORT_LIST` the process is one non-distributed trainer, as in Paddle.

    Args:
      is_collective: collective (True) or parameter-server (False, Paddle's default) mode.
      environ: the environment to read; default `os.environ` when the role is read.
      init_gloo: Paddle's switch for its Gloo collectives; JAX brings its own CPU collectives
        (Gloo), so there is nothing to set up.

    Raises (from `_generate_role()`, so from the first role query or `fleet.init`):
      ValueError: for a variable that is missing or malformed, with Paddle's message
        ("Can not find TRAINING_ROLE, please check your environment.") or naming it.
    """

    def __init__(
        self,
        is_collective: bool = False,
        environ: Mapping[str, str] | None = None,
        *,
        init_gloo: bool = False,
    ) -> None:
        del init_gloo  # JAX's CPU collectives need no set-up
        super().__init__()
        self._is_collective = _check_mode(is_collective)
        self._environ = environ
        self._local_rank = self._local_device_ids = self._world_device_ids = None

    def _generate_role(self) -> None:
        """Read the role from the environment, once (Paddle's)."""
        if self._role_is_generated:
            return
        env = os.environ if self._environ is None else self._environ
        self._local_rank = env.get("PADDLE_RANK_IN_NODE")
        self._local_device_ids = env.get("PADDLE_LOCAL_DEVICE_IDS")
        self._world_device_ids = env.get("PADDLE_WORLD_DEVICE_IDS")
        if not self._is_collective:
            self._parameter_server(*_ps_role(env))
            self._non_distributed = "PADDLE_PSERVERS_IP_PORT_LIST" not in env
            return
        worker_index = _integer(env, "PADDLE_TRAINER_ID", "0")
        source = "PADDLE_TRAINER_ENDPOINTS"
        endpoints = _endpoints(env.get(source, ""), "worker", source)
        _check_trainers_num(env.get("PADDLE_TRAINERS_NUM"), endpoints or [_LOCAL_ENDPOINT])
        self._collective(
            worker_index,
            endpoints or [_LOCAL_ENDPOINT],
            env.get("PADDLE_CURRENT_ENDPOINT"),
            source="PADDLE_TRAINER_ENDPOINTS/PADDLE_TRAINER_ID",
        )
        self._non_distributed = not endpoints

    @_role_query
    def _get_local_rank(self) -> str | None:
        return self._local_rank

    @_role_query
    def _get_local_device_ids(self) -> str | None:
        return self._local_device_ids

    @_role_query
    def _get_world_device_ids(self) -> str | None:
        return self._world_device_ids


def _required(env: Mapping[str, str], name: str) -> str:
    """`env[name]`, or Paddle's error for a missing variable."""
    value = env.get(name)
    if value is None or not value.strip():
        raise ValueError(f"Can not find {name}, please check your environment.")
    return value.strip()


def _integer(env: Mapping[str, str], name: str, default: str | None = None) -> int:
    text = env.get(name, default) if default is not None else _required(env, name)
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {text!r}") from None


def _ps_role(env: Mapping[str, str]) -> tuple[Role, int, int, list[str], list[str], str]:
    """Paddle's parameter-server role (`PaddleCloudRoleMaker._ps_env`): (role, current_id,
    trainer count, server endpoints, trainer endpoints, this process's endpoint), reading the
    variables in Paddle's order, so that the first one missing is the one Paddle names."""
    source = "PADDLE_PSERVERS_IP_PORT_LIST"
    if source not in env:
        return _lone_trainer(env)
    servers = _endpoints(env[source], "server", source)
    if not servers:
        raise ValueError("PADDLE_PSERVERS_IP_PORT_LIST is empty: list the servers' ip:port")
    workers = _endpoints(
        env.get("PADDLE_TRAINER_ENDPOINTS", ""), "worker", "PADDLE_TRAINER_ENDPOINTS"
    )
    trainers = _integer(env, "PADDLE_TRAINERS_NUM")
    if trainers < 1:
        raise ValueError(f"PADDLE_TRAINERS_NUM must be at least 1, got {trainers}")
    training_role = _required(env, "TRAINING_ROLE")
    if training_role not in ("TRAINER", "PSERVER"):
        raise ValueError(
            f"TRAINING_ROLE must be PSERVER or TRAINER, but get {training_role}, please check "
            "your environment (heterogeneous trainers and coordinators are not in fleetjax)"
        )
    trainer_id = _integer(env, "PADDLE_TRAINER_ID") if training_role == "TRAINER" else 0
    port = _required(env, "PADDLE_PORT")
    endpoint = _parse_endpoint(f"{_required(env, 'POD_IP')}:{port}", "POD_IP:PADDLE_PORT")
    if training_role == "PSERVER":
        if endpoint not in servers:
            raise ValueError(
                f"this server's POD_IP:PADDLE_PORT, {endpoint}, is not in "
                f"PADDLE_PSERVERS_IP_PORT_LIST ({','.join(servers)})"
            )
        return Role.SERVER, servers.index(endpoint), trainers, servers, workers, endpoint
    index = _checked_index(trainer_id, trainers, "trainer", "PADDLE_TRAINER_ID", "trainers")
    _check_trainer_endpoints(workers, trainers, "PADDLE_TRAINER_ENDPOINTS")
    return Role.WORKER, index, trainers, servers, workers, endpoint


def _lone_trainer(env: Mapping[str, str]) -> tuple[Role, int, int, list[str], list[str], str]:
    """Paddle's parameter-server role without `PADDLE_PSERVERS_IP_PORT_LIST`: one
    non-distributed trainer, whatever the trainer variables say."""
    if env.get("TRAINING_ROLE") == "PSERVER":
        raise ValueError(
            "TRAINING_ROLE=PSERVER but PADDLE_PSERVERS_IP_PORT_LIST is not set: a "
            "parameter server needs every server's ip:port (Paddle would run this process "
            "as a lone trainer)"
        )
    lone = {"PADDLE_TRAINER_ID": "0", "PADDLE_TRAINERS_NUM": "1", "PADDLE_TRAINER_ENDPOINTS": ""}
    ignored = [
        f"{name}={env[name]}" for name, value in lone.items() if env.get(name, value) != value
    ]
    if ignored:
        warn_once(
            f"{', '.join(ignored)} ignored: without PADDLE_PSERVERS_IP_PORT_LIST this process "
            "is one non-distributed parameter-server trainer (index 0), as in Paddle"
        )
    return Role.WORKER, 0, 1, [], [], ""


def _check_trainer_endpoints(workers: list[str], trainers: int, source: str) -> None:
    """The trainers' endpoints, if listed (Paddle reads them only to join the trainers, which
    `fleet.init` does at the first one), are one per trainer."""
    if workers and len(workers) != trainers:
        raise ValueError(f"{source} lists {len(workers)} trainers, but there are {trainers}")


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
    worker_endpoints=["10.0.0.1:6170", "10.0.0.2:6170"])`; `worker_num`, if given, must match
    the endpoints.

    In parameter-server mode (`is_collective=False`, Paddle's arguments): `server_endpoints`
    (required), `role` (`Role.WORKER` or `Role.SERVER`), `current_id` (the trainer's or the
    server's index), `worker_num` (default: the count of `worker_endpoints`).
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
        super().__init__()
        source = "UserDefinedRoleMaker"
        if not _check_mode(is_collective):
            self._parameter_server(
                *_user_ps_role(role, current_id, worker_num, worker_endpoints, server_endpoints)
            )
            return
        if role != Role.WORKER or server_endpoints:
            raise ValueError(f"{source}: {_PS_ONLY}")
        endpoints = list(worker_endpoints or [_LOCAL_ENDPOINT])
        if worker_num is not None and worker_num != len(endpoints):
            raise ValueError(
                f"worker_num={worker_num} but worker_endpoints lists {len(endpoints)} endpoints"
            )
        self._collective(current_id, endpoints, None, source=source)


def _user_ps_role(
    role: Role,
    current_id: int,
    worker_num: int | None,
    worker_endpoints: Sequence[str] | None,
    server_endpoints: Sequence[str] | None,
) -> tuple[Role, int, int, list[str], list[str], str]:
    """A parameter-server role given in code (Paddle's `_user_defined_ps_env`)."""
    source = "UserDefinedRoleMaker(is_collective=False)"
    servers = _endpoints(server_endpoints, "server", f"{source}: server_endpoints")
    if not servers:
        raise ValueError(f"{source} needs server_endpoints, the servers' ip:port")
    workers = _endpoints(worker_endpoints, "worker", f"{source}: worker_endpoints")
    trainers = worker_num or len(workers)
    if not trainers:
        raise ValueError(f"{source} needs worker_num or worker_endpoints")
    if role == Role.SERVER:
        index = _checked_index(current_id, len(servers), "server", source, "servers")
        return role, index, trainers, servers, workers, servers[index]
    if role != Role.WORKER:
        raise ValueError(f"{source}: role must be Role.WORKER or Role.SERVER, got {role!r}")
    index = _checked_index(current_id, trainers, "trainer", source, "trainers")
    _check_trainer_endpoints(workers, trainers, f"{source}: worker_endpoints")
    return role, index, trainers, servers, workers, workers[index] if workers else ""


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
