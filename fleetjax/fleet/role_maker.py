"""Role makers: which trainer this process is, and who the others are (Paddle's `role_maker`).

Collective mode only: every process is a worker (trainer). The process count is the number of
worker endpoints, as in Paddle.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence

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
    """This process's place among the workers.

    Attributes:
      worker_index: this worker's index, 0 .. worker_num - 1.
      worker_endpoints: every worker's `host:port`, in index order.
      current_endpoint: this worker's endpoint.
    """

    def __init__(
        self,
        is_collective: bool,
        worker_index: int,
        worker_endpoints: Sequence[str],
        current_endpoint: str | None,
        source: str,
    ) -> None:
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
        self.is_collective = True
        self.role = Role.WORKER
        self.worker_index = worker_index
        self.worker_endpoints = endpoints
        self.current_endpoint = expected

    @property
    def worker_num(self) -> int:
        return len(self.worker_endpoints)

    @property
    def is_distributed(self) -> bool:
        """Whether there are several worker processes (and so `jax.distributed` is used)."""
        return self.worker_num > 1

    @property
    def node_num(self) -> int:
        """The number of distinct hosts among the workers."""
        return len({e.rpartition(":")[0] for e in self.worker_endpoints})

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(worker_index={self.worker_index}, "
            f"worker_endpoints={self.worker_endpoints})"
        )


class PaddleCloudRoleMaker(RoleMakerBase):
    """The role from the environment that `fleetrun` (or `fleetjax-run`) sets.

    Reads `PADDLE_TRAINER_ID` (default 0), `PADDLE_TRAINER_ENDPOINTS` (comma-separated
    host:port; unset means a single, non-distributed worker), `PADDLE_CURRENT_ENDPOINT` and
    `PADDLE_TRAINERS_NUM` (checked against the endpoint count; Paddle ignores it). Unlike
    Paddle, `is_collective` defaults to True: parameter-server mode is not supported.

    Args:
      is_collective: must be True.
      environ: the environment to read; default `os.environ` at construction time.
    """

    def __init__(
        self, is_collective: bool = True, environ: Mapping[str, str] | None = None
    ) -> None:
        env = os.environ if environ is None else environ
        raw_id = env.get("PADDLE_TRAINER_ID", "0")
        try:
            worker_index = int(raw_id)
        except ValueError:
            raise ValueError(f"PADDLE_TRAINER_ID must be an integer, got {raw_id!r}") from None
        endpoints_text = env.get("PADDLE_TRAINER_ENDPOINTS", "")
        endpoints = [e for e in endpoints_text.split(",") if e.strip()] or [_LOCAL_ENDPOINT]
        trainers = env.get("PADDLE_TRAINERS_NUM")
        if trainers is not None and trainers.strip() != str(len(endpoints)):
            raise ValueError(
                f"PADDLE_TRAINERS_NUM={trainers} but PADDLE_TRAINER_ENDPOINTS lists "
                f"{len(endpoints)} endpoints ({endpoints_text!r})"
            )
        super().__init__(
            is_collective,
            worker_index,
            endpoints,
            env.get("PADDLE_CURRENT_ENDPOINT"),
            source="PADDLE_TRAINER_ENDPOINTS/PADDLE_TRAINER_ID",
        )


class UserDefinedRoleMaker(RoleMakerBase):
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


class JaxProcessRoleMaker(RoleMakerBase):
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
        self.is_collective = True
        self.role = Role.WORKER
        self.worker_index = jax.process_index()
        self.worker_endpoints = []
        self.current_endpoint = None
        self._worker_num = jax.process_count()

    @property
    def worker_num(self) -> int:
        return self._worker_num

    @property
    def node_num(self) -> int:
        raise RuntimeError(
            "the node count is unknown when the cluster set up jax.distributed itself; "
            "jax.process_count() is the process count"
        )
