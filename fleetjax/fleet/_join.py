"""How `fleet.init()` joins the job's processes, and how a joined process ends when it fails.

The role comes from Paddle's `PADDLE_*` variables (`fleetjax-run`, `fleetrun`), else from JAX:
a script that called `jax.distributed.initialize()` itself, or a job that JAX's own cluster
detection finds (SLURM, Open MPI, Kubernetes, Cloud TPU: what `jax.distributed.initialize()`
with no arguments uses). A scheduler's variables that promise several tasks which JAX cannot
join are an error: never N independent single-process runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import types
from collections.abc import Callable, Mapping

import jax
from jax.sharding import Mesh

from fleetjax import _worker
from fleetjax.fleet.base.role_maker import (
    JaxProcessRoleMaker,
    PaddleCloudRoleMaker,
    RoleMakerBase,
)
from fleetjax.plan import Plan, mesh_for

# A process that sends no heartbeat for this long is taken as dead by JAX's coordination
# service, which then ends every process (JAX's default, 100 s, leaves a job waiting on a lost
# node for minutes; the heartbeats come from a thread of their own, so compiling or a busy
# Python loop does not delay them).
HEARTBEAT_SECONDS = 10

# Variables by which schedulers give a job's task count, what sets them, and how JAX would
# find the job (jax._src.clusters).
_TASK_COUNTS = (
    ("SLURM_NTASKS", "SLURM", "srun gives each task SLURM_JOB_ID, SLURM_STEP_NODELIST, "
     "SLURM_PROCID and SLURM_LOCALID, which JAX reads"),
    ("SLURM_STEP_NUM_TASKS", "SLURM", "srun gives each task SLURM_JOB_ID, "
     "SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID and SLURM_LOCALID, which JAX reads"),
    ("OMPI_COMM_WORLD_SIZE", "Open MPI", "JAX reads OMPI_MCA_orte_hnp_uri, which Open MPI 4's "
     "mpirun sets; under Open MPI 5, call jax.distributed.initialize("
     "cluster_detection_method='mpi4py') before fleet.init()"),
    ("PMI_SIZE", "MPI (PMI)", "JAX does not read PMI variables; call "
     "jax.distributed.initialize(cluster_detection_method='mpi4py') before fleet.init()"),
)  # fmt: skip


def _detected_cluster() -> type | None:
    """The cluster environment `jax.distributed.initialize()` would join, as JAX picks it."""
    try:  # JAX's own detection; no public API names the environment
        from jax._src import clusters

        cluster_types = clusters.ClusterEnv._cluster_types
    except (ImportError, AttributeError):  # a JAX that moved it: schedulers' variables decide
        return None
    for env in cluster_types:
        try:
            if not env.opt_in_only_method and env.is_env_present():
                return env
        except Exception as e:  # Kubernetes without a service account, ...
            raise RuntimeError(
                f"JAX's cluster detection failed in {env.__name__}: {e}. For a single process, "
                "pass role_maker=fleet.PaddleCloudRoleMaker(is_collective=True) to fleet.init()."
            ) from e
    return None


def _refuse_undetected_tasks(environ: Mapping[str, str]) -> None:
    """Raise if the scheduler's variables promise several tasks (that JAX did not find)."""
    for variable, scheduler, how in _TASK_COUNTS:
        count = environ.get(variable, "")
        if count.isdigit() and int(count) > 1:
            raise RuntimeError(
                f"{variable}={count} says this process is one of {count} {scheduler} tasks, "
                f"but JAX's cluster detection finds no {scheduler} job to join ({how}). Start "
                "the tasks with the scheduler (srun, mpirun) or fleetjax-run, or unset "
                f"{variable} to run a single process."
            )


def _join_detected_cluster() -> bool:
    """Join the job JAX's cluster detection finds, if it has several processes; whether it
    did. A job of one process is left alone (jax.distributed.initialize() would limit it to
    one device per process)."""
    cluster = _detected_cluster()
    if cluster is None:
        _refuse_undetected_tasks(os.environ)
        return False
    try:
        count = cluster.get_process_count()
    except Exception as e:  # a Kubernetes API error, a malformed variable, ...
        raise RuntimeError(
            f"JAX detected a {cluster.__name__} job, but could not read its process count: {e}"
        ) from e
    if count <= 1:
        return False
    try:
        jax.distributed.initialize()
    except (RuntimeError, ValueError) as e:
        raise RuntimeError(
            f"this process is one of {count} processes of a {cluster.__name__} job, but "
            f"could not join them with jax.distributed.initialize(): {e}. fleet.init() must "
            "run before any JAX computation in each process."
        ) from e
    return True


def default_role_maker() -> RoleMakerBase:
    """The role `fleet.init()` takes without a role maker: `PaddleCloudRoleMaker` with
    `PADDLE_TRAINER_ENDPOINTS`, else `JaxProcessRoleMaker` when JAX's runtime spans several
    processes (joined by the script, or now through JAX's cluster detection), else a single
    `PaddleCloudRoleMaker` worker.

    Raises:
      RuntimeError: if the scheduler's variables promise several tasks that cannot be joined.
    """
    if "PADDLE_TRAINER_ENDPOINTS" in os.environ:
        return PaddleCloudRoleMaker(is_collective=True)
    if jax.distributed.is_initialized() or _join_detected_cluster():
        return JaxProcessRoleMaker()
    return PaddleCloudRoleMaker(is_collective=True)


def _report_and_exit(
    previous: Callable[..., object],
    kind: type[BaseException],
    value: BaseException,
    traceback: types.TracebackType | None,
) -> None:
    try:
        previous(kind, value, traceback)
    finally:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed
                stream.flush()
        os._exit(1)


def exit_on_uncaught_exception() -> None:
    """After an uncaught exception, print it as usual and exit at once with code 1.

    Python's normal exit would run JAX's exit handler, which waits in the job's shutdown
    barrier (up to 5 minutes) for the other processes, which go on computing or wait for this
    one: the failure would surface late, and blamed on another process. Exiting at once skips
    the `atexit` handlers; logging is flushed.
    """
    hook = sys.excepthook
    if isinstance(hook, functools.partial) and hook.func is _report_and_exit:
        return  # fleet.init() ran before
    sys.excepthook = functools.partial(_report_and_exit, hook)


def join_processes(role: RoleMakerBase) -> None:
    """Join this worker's processes with `jax.distributed.initialize`, unless joined already.

    The coordinator is worker 0's endpoint unless `JAX_COORDINATOR_ADDRESS` names another, and
    it listens on that address only (`JAX_COORDINATOR_BIND_ADDRESS` overrides). Afterwards an
    uncaught exception ends this process at once (`exit_on_uncaught_exception`).

    Raises:
      RuntimeError: if JAX already joined another number of processes, or joining failed.
      ValueError: if no coordinator is known: parameter-server trainers whose endpoints are
        not listed (Paddle's role makers do not need them; the join does).
    """
    if jax.distributed.is_initialized():
        if jax.process_count() != role.worker_num:
            raise RuntimeError(
                f"jax.distributed already joined {jax.process_count()} processes, but the "
                f"role lists {role.worker_num} workers"
            )
        exit_on_uncaught_exception()
        return
    if not (os.environ.get("JAX_COORDINATOR_ADDRESS") or role.worker_endpoints):
        raise ValueError(
            f"{role.worker_num} parameter-server trainers join as one SPMD job (the tables live "
            "sharded over their devices), which needs the trainers' endpoints: set "
            "PADDLE_TRAINER_ENDPOINTS (fleetrun and fleetjax-run do; UserDefinedRoleMaker's "
            "worker_endpoints) or JAX_COORDINATOR_ADDRESS"
        )
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS") or role.worker_endpoints[0]
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or coordinator
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=role.worker_num,
            process_id=role.worker_index,
            coordinator_bind_address=bind,
            initialization_timeout=_seconds(_worker.JOIN_TIMEOUT, _worker.JOIN_TIMEOUT_SECONDS),
            heartbeat_timeout_seconds=_seconds(_worker.JAX_HEARTBEAT_TIMEOUT, HEARTBEAT_SECONDS),
        )
    except RuntimeError as e:
        raise RuntimeError(
            f"could not join {role.worker_num} processes through {coordinator} (the "
            f"coordinator listens on {bind}): {e}. fleet.init() must run before any JAX "
            "computation in each process."
        ) from e
    if address := own_address(os.environ):
        bind_gloo(address)
    _worker.note_joined()
    exit_on_uncaught_exception()


def _seconds(variable: str, default: int) -> int:
    text = os.environ.get(variable, "")
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{variable}={text!r} must be a positive whole number of seconds")
    return int(text)


def own_address(environ: Mapping[str, str]) -> str | None:
    """This worker's address on the network the job uses: the host of
    `PADDLE_CURRENT_ENDPOINT` (fleetjax-run's `--ips`, `--host` or the address that reaches
    `--master`), else `POD_IP`; None if neither is set."""
    endpoint = environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = endpoint.rpartition(":")[0].removeprefix("[").removesuffix("]")
    return host or environ.get("POD_IP") or None


def bind_gloo(address: str) -> None:
    """Make Gloo (JAX's CPU collectives) listen on and announce `address`.

    Without it Gloo takes the address the host name resolves to: on Debian 127.0.1.1, which
    the other nodes cannot reach. JAX accepts the address
    (`make_gloo_tcp_collectives(hostname=...)`) but offers no option for it, so the CPU
    backend's factory is registered again, before the backend starts, with it.
    """
    if jax.config.jax_cpu_collectives_implementation != "gloo":
        return
    from jax._src import distributed, xla_bridge  # no public API takes Gloo's address
    from jax._src.lib import _jax

    def cpu_client() -> object:
        collectives = _jax.make_gloo_tcp_collectives(
            distributed_client=distributed.global_state.client, hostname=address
        )
        return xla_bridge.make_cpu_client(collectives)

    # jax.distributed.initialize refused to run after a backend started: none has.
    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)


def job_mesh(plan: Plan) -> Mesh:
    """`mesh_for(plan)`: the job's mesh over all its devices.

    Raises:
      ValueError: if the strategy's degrees do not fit the devices; for an elastic
        `fleetjax-run` job restarted on fewer nodes, the message says so.
    """
    try:
        return mesh_for(plan)
    except ValueError as e:
        nodes, most = os.environ.get("PADDLE_NNODES", ""), os.environ.get(_worker.MAX_NODES, "")
        if not (nodes.isdigit() and most.isdigit() and int(nodes) < int(most)):
            raise
        fits = str(e).partition(". To simulate")[0]  # more simulated devices are no answer here
        raise ValueError(
            f"{fits}: fleetjax-run restarted this job on {nodes} of its up to {most} nodes "
            "(--nnodes min:max) after it lost some, and the strategy's degrees must fit the "
            "devices left (dp_degree -1 takes whatever the other degrees leave; the global "
            "batch stays, each device's share grows)"
        ) from None
