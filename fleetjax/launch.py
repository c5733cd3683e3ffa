r"""`fleetjax-run`: Paddle's `fleetrun` launcher, on JAX's multi-process runtime.

    python -m fleetjax.launch [options] train.py [train.py's arguments]

It starts `--nproc_per_node` copies of the script on this node, each with Paddle's role
variables (`PADDLE_TRAINER_ID`, `PADDLE_TRAINERS_NUM`, `PADDLE_TRAINER_ENDPOINTS`,
`PADDLE_CURRENT_ENDPOINT`, `PADDLE_RANK_IN_NODE`) and `JAX_COORDINATOR_ADDRESS`; the script's
`fleet.init()` then joins all processes with `jax.distributed.initialize`. The coordinator is
the first worker's endpoint, and it listens on that address only. Worker `N` writes to
`<--log_dir>/workerlog.N` (a new file each run); the node's first worker is also shown on the
console.

Devices:
  * CPU (no GPU found, or `JAX_PLATFORMS=cpu`): each process simulates
    `--cpu_devices_per_proc` CPU devices (`JAX_NUM_CPU_DEVICES`), and processes talk over Gloo
    (`JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`). Two processes of four devices each:
        python -m fleetjax.launch --nproc_per_node 2 --cpu_devices_per_proc 4 train.py
  * GPU: `--devices`/`--gpus` (default every GPU that `nvidia-smi` lists, or
    `CUDA_VISIBLE_DEVICES`) are split evenly over the processes, one GPU each by default, and
    each process sees only its own (`CUDA_VISIBLE_DEVICES`; Paddle's `FLAGS_selected_gpus` and
    `PADDLE_LOCAL_DEVICE_IDS` too). Collectives use NCCL. GPUs that this machine does not
    have are an error.
  * Several nodes, either way Paddle offers:
      - `--ips` lists the nodes (the same command on each; the same `--nproc_per_node`). Each
        node finds itself in `--ips` by the addresses it can bind (or `--host`, `--rank`):
            python -m fleetjax.launch --ips 10.0.0.1,10.0.0.2 --gpus 0,1,2,3 train.py
      - `--master host:port --nnodes N`: the nodes meet at `--master`, which the node that
        owns that address serves (`--rank` picks a node's rank, `--job_id` names the job):
            python -m fleetjax.launch --master 10.0.0.1:8090 --nnodes 2 train.py

Faults:
  * A worker that exits with an error or is killed: the launcher prints the end of its log
    (its traceback), stops the others (SIGTERM, then SIGKILL after `GRACE_SECONDS`) and exits
    with that worker's code (128 + signal number if it was killed). A worker whose
    `fleet.init()` joined other processes exits right after printing an uncaught exception,
    instead of waiting in JAX's shutdown barrier for the others.
  * `--heartbeat_timeout S`: a worker that neither writes to its log nor calls `heartbeat()`
    for S seconds is taken as hung; the job is stopped the same way, exit code 124.
  * Ctrl-C, SIGINT or SIGTERM to the launcher stops all workers the same way (exit code
    128 + signal number). Every process the workers started is stopped with them, also a
    detached one (its own session), and also when the launcher itself is killed by SIGKILL:
    a guard process (fleetjax/_guard.py) outlives the launcher for that.
  * A closed console (`fleetjax-run ... | head -1`, a dropped terminal) only ends the echo:
    workers write to their log files, never to the console.
  * Bad options, a busy coordinator port, a `--log_dir` that cannot be a directory: one line
    `fleetjax-run: error: ...` and exit code 2, before anything starts.

Parameter-server jobs (Paddle's `--server_num`, `--servers`, `--trainer_num`, `--workers`):
the processes are trainers and servers with Paddle's parameter-server variables
(`TRAINING_ROLE`, `PADDLE_PSERVERS_IP_PORT_LIST`, `PADDLE_TRAINERS_NUM`, `PADDLE_TRAINER_ID`,
`POD_IP`, `PADDLE_PORT`, `PADDLE_TRAINER_ENDPOINTS`), which `fleet.init(is_collective=False)`
reads. The trainers join as one SPMD job (fleetjax's tables live sharded over their devices)
and log to `workerlog.N`; a server logs to `serverlog.N` and, in fleetjax, ends at once
(`fleet.run_server()` returns). `--server_num`/`--trainer_num` put them on this node, at ports
from `--start_port` on (servers first); `--servers`/`--workers` list their endpoints, and
each node starts those at its own addresses:
    python -m fleetjax.launch --server_num 1 --trainer_num 2 --cpu_devices_per_proc 4 train.py

Where a scheduler starts the processes (SLURM, Open MPI, Kubernetes), no launcher is needed:
`srun python train.py`, whose `fleet.init()` finds the job through JAX's cluster detection.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import errno
import os
import pathlib
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import NoReturn

from fleetjax import _guard, _rendezvous

DEFAULT_START_PORT = 6070  # Paddle's
GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL when stopping workers (Paddle's)
LOG_TAIL_LINES = 20  # of a failed worker's log, shown on the console
HEARTBEAT_EXIT_CODE = 124  # the launcher's, when a worker made no progress (as timeout(1))
HEARTBEAT_FILE_VARIABLE = "FLEETJAX_HEARTBEAT_FILE"
_POLL_SECONDS = 0.1
# Loaded here, not in the forked child, where only the call itself should run.
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None


class LaunchError(Exception):
    """The launch cannot go ahead (bad options, busy port); the message says why."""


@dataclasses.dataclass(frozen=True)
class Worker:
    """One process to start on this node.

    Attributes:
      rank: the global worker index (`PADDLE_TRAINER_ID`; a parameter server's index).
      local_rank: the index on this node (`PADDLE_RANK_IN_NODE`).
      env: the variables this launcher sets for it (on top of its own environment).
      role: "worker", or "server" (a parameter server).
    """

    rank: int
    local_rank: int
    env: dict[str, str]
    role: str = "worker"

    @property
    def log_name(self) -> str:
        """Its log's file name: Paddle's `workerlog.N` or `serverlog.N`."""
        return f"{self.role}log.{self.rank}"


def heartbeat() -> None:
    """Tell `fleetjax-run --heartbeat_timeout` that this worker makes progress.

    Output to the worker's log counts as progress already; call this in stretches without
    output (it touches the log, `FLEETJAX_HEARTBEAT_FILE`). Outside `fleetjax-run` it does
    nothing.
    """
    path = os.environ.get(HEARTBEAT_FILE_VARIABLE)
    if path:
        with contextlib.suppress(OSError):  # the log removed: nothing to tell
            os.utime(path)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise LaunchError(message)  # one line, as every other usage error


def _positive_seconds(text: str) -> float:
    with contextlib.suppress(ValueError):
        if (seconds := float(text)) > 0 and seconds != float("inf"):
            return seconds
    raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The options of `fleetjax-run` (Paddle's `fleetrun`).

    Raises:
      LaunchError: for options argparse refuses (the message names them).
    """
    parser = _Parser(
        prog="fleetjax-run",
        description="Start a training script on several processes (Paddle's fleetrun).",
    )
    add = parser.add_argument
    add(
        "--ips",
        help="comma-separated addresses of the nodes, the coordinator's first "
        "(default: 127.0.0.1, this node only)",
    )
    add(
        "--master",
        help="host:port where the nodes meet (the node owning it serves), instead of --ips",
    )
    add("--nnodes", help="the number of nodes (default: 1, or as many as --ips lists)")
    add(
        "--rank",
        type=int,
        default=-1,
        help="this node's rank (default: its place in --ips, or any free one at --master)",
    )
    add("--job_id", default="default", help="the job's name at --master (default: default)")
    add(
        "--host",
        help="this node's address (default: the one among --ips this node can bind, or the "
        "one that reaches --master)",
    )
    add(
        "--nproc_per_node",
        type=int,
        help="processes per node (default: one per device on GPUs, 1 on CPU)",
    )
    add(
        "--devices",
        "--gpus",
        dest="devices",
        help="comma-separated GPU ids of this node, split evenly over its processes "
        "(default: all visible GPUs)",
    )
    add(
        "--cpu_devices_per_proc",
        type=int,
        help="simulated CPU devices per process, without GPUs (default 1)",
    )
    add("--log_dir", default="log", help="where workerlog.N go (default: log)")
    add(
        "--start_port",
        type=int,
        default=DEFAULT_START_PORT,
        help="worker i's endpoint port is start_port + i; the first worker's is the JAX "
        f"coordinator's (default: {DEFAULT_START_PORT})",
    )
    add(
        "--heartbeat_timeout",
        type=_positive_seconds,
        metavar="SECONDS",
        help="stop the job when a worker neither writes to its log nor calls "
        "fleetjax.launch.heartbeat() for this long (default: never)",
    )
    ps = parser.add_argument_group("parameter-server jobs (Paddle's)")
    ps.add_argument("--server_num", type=int, help="parameter servers on this node")
    ps.add_argument("--servers", help="comma-separated ip:port of every parameter server")
    ps.add_argument("--trainer_num", type=int, help="trainers on this node")
    ps.add_argument("--workers", help="comma-separated ip:port of every trainer")
    add("training_script", nargs="?", help="the script each process runs")
    add("training_script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


# -- what to start -----------------------------------------------------------------------------
def _split(text: str, option: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise LaunchError(f"{option}={text!r} has an empty entry; give a comma-separated list")
    return items


def _is_local_address(host: str) -> bool:
    """Whether this machine owns `host`: only a local address can be bound."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


def node_index(ips: Sequence[str], host: str | None, rank: int = -1) -> int:
    """This node's position in `ips`: `rank`'s, `host`'s, else the one address this machine
    owns."""
    if host is not None and host not in ips:
        raise LaunchError(f"--host {host} is not one of --ips {','.join(ips)}")
    if rank >= len(ips):
        raise LaunchError(f"--rank {rank} is outside --ips {','.join(ips)} (0..{len(ips) - 1})")
    if rank >= 0 and host is not None and ips.index(host) != rank:
        raise LaunchError(f"--rank {rank} is not --host {host}'s place in --ips {','.join(ips)}")
    if rank >= 0:
        return rank
    if host is not None:
        return ips.index(host)
    if len(ips) == 1:
        return 0
    mine = [i for i, ip in enumerate(ips) if _is_local_address(ip)]
    if len(mine) != 1:
        found = "none" if not mine else ", ".join(ips[i] for i in mine)
        raise LaunchError(
            f"cannot tell which of --ips {','.join(ips)} is this node (local addresses among "
            f"them: {found}); pass --host"
        )
    return mine[0]


def visible_gpus(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this node can use: `CUDA_VISIBLE_DEVICES` if set, else what `nvidia-smi`
    lists; none if `JAX_PLATFORMS` names no GPU platform."""
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.split(",")):
        return []
    if "CUDA_VISIBLE_DEVICES" in environ:
        return [d for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    query = ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split()


def _selected_gpus(devices: str | None, environ: Mapping[str, str]) -> list[str]:
    """The GPUs this node trains on: `--devices` (each one this machine has), else all."""
    visible = visible_gpus(environ)
    if devices is None:
        return visible
    selected = _split(devices, "--devices (--gpus)")
    if not visible:
        if environ.get("JAX_PLATFORMS"):
            why = f"JAX_PLATFORMS={environ['JAX_PLATFORMS']}"
        elif "CUDA_VISIBLE_DEVICES" in environ:
            why = f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
        else:
            why = "nvidia-smi lists none" if shutil.which("nvidia-smi") else "no nvidia-smi"
        raise LaunchError(
            f"--devices (--gpus) {devices} names GPUs, but this machine has none ({why})"
        )
    missing = [d for d in selected if d not in visible]
    if missing:
        raise LaunchError(
            f"--devices (--gpus) {devices}: GPU {','.join(missing)} is not among this "
            f"machine's GPUs {','.join(visible)}"
        )
    return selected


def _node_count(text: str | None) -> int | None:
    if text is None:
        return None
    if not text.isdigit() or int(text) < 1:
        raise LaunchError(
            f"--nnodes must be a number of nodes (at least 1), got {text!r}; fleetjax-run "
            "starts a fixed number of nodes (no elastic min:max range)"
        )
    return int(text)


def _node_endpoints(args: argparse.Namespace, nproc: int) -> tuple[list[list[str]], int]:
    """Every node's worker endpoints, in node order, and this node's index among them."""
    nnodes = _node_count(args.nnodes)
    if args.rank < -1:
        raise LaunchError(f"--rank must be a node's rank (0, 1, ...) or -1 (any), got {args.rank}")
    ports = [args.start_port + i for i in range(nproc)]
    if args.master is not None:
        if args.ips is not None:
            raise LaunchError("give --master (the nodes meet there) or --ips, not both")
        try:
            master = _rendezvous.parse_master(args.master)
            if nnodes is None or nnodes == 1:
                if args.rank > 0:
                    raise LaunchError(f"--rank {args.rank} of a single node (--nnodes 1)")
                host = args.host or "127.0.0.1"
                return [[_rendezvous.endpoint(host, p) for p in ports]], 0
            return _rendezvous.rendezvous(master, args.job_id, nnodes, args.rank, args.host, ports)
        except _rendezvous.RendezvousError as e:
            raise LaunchError(str(e)) from None
    ips = _split(args.ips or "127.0.0.1", "--ips")
    if len(set(ips)) != len(ips):
        raise LaunchError(f"--ips {args.ips} repeats a node")
    if nnodes is not None and nnodes != len(ips):
        raise LaunchError(
            f"--nnodes {nnodes} but --ips lists {len(ips)} node(s); list every node in --ips, "
            "or let the nodes meet at --master"
        )
    return [[f"{ip}:{p}" for p in ports] for ip in ips], node_index(ips, args.host, args.rank)


def plan_workers(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> list[Worker]:
    """The processes to start on this node and the variables each gets (with `--master`,
    after the nodes met there).

    Raises:
      LaunchError: if the options do not fit together (the message names them).
    """
    environ = os.environ if environ is None else environ
    if not 0 < args.start_port < 65536:
        raise LaunchError(f"--start_port must be a port number 1..65535, got {args.start_port}")
    if any(getattr(args, name) is not None for name in _PS_OPTIONS):
        return _plan_parameter_server(args, environ)
    gpus = _selected_gpus(args.devices, environ)
    if gpus and args.cpu_devices_per_proc is not None:
        raise LaunchError(
            f"--cpu_devices_per_proc applies without GPUs, but this node uses GPUs {gpus}; "
            "set JAX_PLATFORMS=cpu to train on the CPU"
        )
    nproc = args.nproc_per_node if args.nproc_per_node is not None else (len(gpus) or 1)
    if nproc < 1:
        raise LaunchError(f"--nproc_per_node must be at least 1, got {nproc}")
    if gpus and len(gpus) % nproc:
        raise LaunchError(
            f"{len(gpus)} GPUs ({','.join(gpus)}) do not split evenly over "
            f"--nproc_per_node {nproc} processes"
        )
    cpu_devices = args.cpu_devices_per_proc if args.cpu_devices_per_proc is not None else 1
    if cpu_devices < 1:
        raise LaunchError(f"--cpu_devices_per_proc must be at least 1, got {cpu_devices}")
    if args.start_port + nproc - 1 > 65535:
        raise LaunchError(f"--start_port {args.start_port} + {nproc} processes exceeds port 65535")

    nodes, node = _node_endpoints(args, nproc)
    endpoints = [e for node_endpoints in nodes for e in node_endpoints]
    common = {
        "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_NNODES": str(len(nodes)),
        **_jax_devices(gpus, cpu_devices, endpoints[0], environ),
    }
    first = sum(len(n) for n in nodes[:node])
    workers = []
    for local_rank in range(nproc):
        rank = first + local_rank
        env = {
            **common,
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
            "PADDLE_RANK_IN_NODE": str(local_rank),
            **_gpus_of(gpus, local_rank, nproc),
        }
        workers.append(Worker(rank, local_rank, env))
    return workers


def _jax_devices(
    gpus: Sequence[str], cpu_devices: int, coordinator: str, environ: Mapping[str, str]
) -> dict[str, str]:
    """The JAX variables of a trainer: the coordinator, and the CPU devices or the GPUs."""
    env = {"JAX_COORDINATOR_ADDRESS": coordinator}
    if not gpus:
        env.update(
            JAX_PLATFORMS="cpu",
            JAX_NUM_CPU_DEVICES=str(cpu_devices),
            JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        )
    elif not environ.get("JAX_PLATFORMS"):
        env["JAX_PLATFORMS"] = "cuda"  # a GPU that JAX cannot use fails, never the CPU
    return env


def _gpus_of(gpus: Sequence[str], local_rank: int, nproc: int) -> dict[str, str]:
    """The GPU variables of this node's process `local_rank` of `nproc` (none without GPUs)."""
    if not gpus:
        return {}
    per_process = len(gpus) // nproc
    mine = ",".join(gpus[local_rank * per_process : (local_rank + 1) * per_process])
    return {
        "CUDA_VISIBLE_DEVICES": mine,
        "FLAGS_selected_gpus": mine,
        "PADDLE_LOCAL_DEVICE_IDS": mine,
    }


# -- parameter-server jobs ---------------------------------------------------------------------
_PS_OPTIONS = ("server_num", "servers", "trainer_num", "workers")


def _ps_endpoint(text: str, option: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"{option}: {text!r} is not an endpoint of the form ip:port")
    return f"{host}:{int(port)}"


def _ps_endpoints(listed: str | None, count: int | None, what: str, first_port: int) -> list[str]:
    """Every server's or trainer's endpoint: `--servers`/`--workers`, else `count` on this
    node from `first_port`."""
    option, count_option = (
        ("--servers", "--server_num") if what == "server" else ("--workers", "--trainer_num")
    )
    if listed is not None:
        endpoints = [_ps_endpoint(e, option) for e in _split(listed, option)]
        if count is not None and count != len(endpoints):
            raise LaunchError(f"{count_option} {count} but {option} lists {len(endpoints)}")
        if len(set(endpoints)) != len(endpoints):
            raise LaunchError(f"{option} {listed} repeats an endpoint")
        return endpoints
    if count is None or count < 1:
        raise LaunchError(
            f"a parameter-server job needs {count_option} (at least 1) or {option}; got "
            f"{count_option} {count}"
        )
    return [f"127.0.0.1:{first_port + i}" for i in range(count)]


def _plan_parameter_server(args: argparse.Namespace, environ: Mapping[str, str]) -> list[Worker]:
    """This node's trainers (first) and servers of a parameter-server job: those of
    `--workers`/`--servers` at an address this machine owns, or all with the counts."""
    for option in ("ips", "master", "nproc_per_node"):
        if getattr(args, option) is not None:
            raise LaunchError(
                f"--{option} is for collective jobs; a parameter-server job's processes are "
                "given by --server_num/--servers and --trainer_num/--workers"
            )
    servers = _ps_endpoints(args.servers, args.server_num, "server", args.start_port)
    trainers = _ps_endpoints(
        args.workers, args.trainer_num, "trainer", args.start_port + len(servers)
    )
    if len(set(servers) | set(trainers)) != len(servers) + len(trainers):
        raise LaunchError("a server and a trainer have the same endpoint")
    gpus = _selected_gpus(args.devices, environ)
    mine = [i for i, e in enumerate(trainers) if _is_local_address(e.rpartition(":")[0])]
    local_servers = [i for i, e in enumerate(servers) if _is_local_address(e.rpartition(":")[0])]
    if not mine and not local_servers:
        raise LaunchError("none of --servers/--workers is at an address of this machine")
    if gpus and mine and len(gpus) % len(mine):
        raise LaunchError(f"{len(gpus)} GPUs do not split evenly over {len(mine)} trainers")
    common = {
        "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(servers),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(trainers),
        "PADDLE_TRAINERS_NUM": str(len(trainers)),
    }
    cpu_devices = args.cpu_devices_per_proc if args.cpu_devices_per_proc is not None else 1
    jax_env = _jax_devices(gpus, cpu_devices, trainers[0], environ)
    planned = []
    for local_rank, rank in enumerate(mine):
        host, _, port = trainers[rank].rpartition(":")
        env = {**common, **jax_env, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(rank)}
        env.update(POD_IP=host, PADDLE_PORT=port, **_gpus_of(gpus, local_rank, len(mine)))
        planned.append(Worker(rank, local_rank, env))
    for local_rank, index in enumerate(local_servers):
        host, _, port = servers[index].rpartition(":")
        env = {**common, "TRAINING_ROLE": "PSERVER", "POD_IP": host, "PADDLE_PORT": port}
        env["JAX_PLATFORMS"] = "cpu"  # a server never takes an accelerator
        planned.append(Worker(index, len(mine) + local_rank, env, role="server"))
    return planned


def check_port_free(port: int) -> None:
    """Raise `LaunchError` if a server already listens on `port` on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # A port in TIME_WAIT after an earlier run is free for the coordinator's server too.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise LaunchError(
                f"the coordinator port {port} is already in use on this machine (another "
                "job?); choose a free one with --start_port"
            ) from None


def _checked_paths(args: argparse.Namespace) -> pathlib.Path:
    """The log directory (made if missing), after checking it and the training script."""
    if args.training_script is None:
        raise LaunchError("no training script: fleetjax-run [options] train.py [its arguments]")
    if not os.path.isfile(args.training_script):
        raise LaunchError(f"the training script {args.training_script} is not a file")
    log_dir = pathlib.Path(args.log_dir)
    if log_dir.exists() and not log_dir.is_dir():
        raise LaunchError(f"--log_dir {log_dir} is a file, not a directory")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LaunchError(f"--log_dir {log_dir} cannot be made: {e.strerror}") from None
    if not os.access(log_dir, os.W_OK | os.X_OK):
        raise LaunchError(f"--log_dir {log_dir} is not writable")
    return log_dir


# -- running them ------------------------------------------------------------------------------
def _die_with_launcher() -> None:
    """In the child, before exec: get SIGKILL if the launcher dies, even by SIGKILL (Linux)."""
    pr_set_pdeathsig = 1
    assert _LIBC is not None
    _LIBC.prctl(pr_set_pdeathsig, signal.SIGKILL)


def _say(message: str) -> None:
    with contextlib.suppress(OSError):  # a closed stderr must not stop the stopping
        print(f"fleetjax-run: {message}", file=sys.stderr, flush=True)


class _Echo:
    """Copies a worker's log onto the console as it grows (Paddle shows the node's first
    worker). A closed console ends the copying, never the worker or its log."""

    def __init__(self, log: pathlib.Path) -> None:
        self._log = log
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._copy, daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        with open(self._log, "rb") as source:
            while True:
                finishing = self._done.is_set()  # then copy what is left, and stop
                chunk = source.read(1 << 16)
                if chunk:
                    try:
                        sys.stdout.buffer.write(chunk)
                        sys.stdout.buffer.flush()
                    except OSError:
                        self._console_closed()
                        return
                elif finishing:
                    return
                else:
                    self._done.wait(_POLL_SECONDS)

    def _console_closed(self) -> None:
        _say(f"the console is closed; the workers go on, worker output is in {self._log}")
        # Python's own flush of stdout at exit must not fail on the closed pipe either.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)

    def close(self) -> None:
        self._done.set()
        self._thread.join()


class _Stop(Exception):
    """The launcher got SIGINT or SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, frame: object) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # once: a second ^C must not cut the stopping
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop(signum)


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _tail(path: pathlib.Path, lines: int) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _last_progress(log: pathlib.Path) -> float:
    """When the worker last wrote to its log or called `heartbeat()` (time.time())."""
    try:
        return log.stat().st_mtime
    except OSError:
        return time.time()  # the log removed: no sign of a hang


def _report(worker: Worker, what: str, log: pathlib.Path) -> None:
    _say(f"{worker.role} {worker.rank} {what}; stopping all workers")
    _say(f"the end of {log}:\n{_tail(log, LOG_TAIL_LINES)}")


def _wait(proc: subprocess.Popen, index: int, exits: queue.Queue[int]) -> None:
    proc.wait()
    exits.put(index)


def _stale(
    running: set[int], logs: Sequence[pathlib.Path], timeout: float
) -> tuple[int, str] | None:
    """(index, description) of the running worker without progress for the longest, if that
    is over `timeout` seconds (workers waiting for a hung one stop progressing later)."""
    if not running:
        return None
    index = min(running, key=lambda i: _last_progress(logs[i]))
    idle = time.time() - _last_progress(logs[index])
    if idle <= timeout:
        return None
    return index, (
        f"made no progress for {idle:.0f} s (no output, no heartbeat; "
        f"--heartbeat_timeout {timeout:g})"
    )


def _watch(
    workers: Sequence[Worker],
    procs: Sequence[subprocess.Popen],
    logs: Sequence[pathlib.Path],
    heartbeat_timeout: float | None,
) -> int:
    """Wait until all workers succeed (0), one fails (its code) or one hangs (124).

    Of several failed workers, the first to exit is the one reported: the others may have
    failed because it did (a collective with a dead peer)."""
    exits: queue.Queue[int] = queue.Queue()  # worker indices, in the order they exit
    for index, proc in enumerate(procs):
        threading.Thread(target=_wait, args=(proc, index, exits), daemon=True).start()
    running = set(range(len(procs)))
    while running:
        try:
            index = exits.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            hung = heartbeat_timeout and _stale(running, logs, heartbeat_timeout)
            if hung:
                _report(workers[hung[0]], hung[1], logs[hung[0]])
                return HEARTBEAT_EXIT_CODE
            continue
        running.discard(index)
        code = procs[index].returncode
        if code != 0:
            _report(workers[index], _describe(code), logs[index])
            return code if code > 0 else 128 - code
    return 0


def _start(
    command: Sequence[str], worker: Worker, log: pathlib.Path, run_id: str
) -> subprocess.Popen:
    env = {
        **os.environ,
        **worker.env,
        _guard.RUN_ID_VARIABLE: run_id,
        HEARTBEAT_FILE_VARIABLE: str(log.absolute()),
    }
    with open(log, "wb") as out:  # a new log each run
        return subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: stopped as one, not by the tty's ^C
            preexec_fn=_die_with_launcher,
        )


def _stop_job(run_id: str, procs: Sequence[subprocess.Popen]) -> None:
    """Stop every process of the run and reap the workers."""
    _guard.stop(run_id, [proc.pid for proc in procs], GRACE_SECONDS)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):  # unkillable (in the kernel)
            proc.wait(timeout=GRACE_SECONDS)


def run(
    workers: Sequence[Worker],
    command: Sequence[str],
    log_dir: pathlib.Path,
    heartbeat_timeout: float | None = None,
) -> int:
    """Start `command` once per worker and watch them; 0 if all succeed, else the failed
    worker's code (128 + signal if killed by a signal, or if the launcher was stopped; 124 if
    one made no progress for `heartbeat_timeout` seconds). Nothing of the run is left after."""
    run_id = uuid.uuid4().hex
    # The guard ends the run if this process ends without doing so (SIGKILL).
    guard = subprocess.Popen(
        [sys.executable, "-I", _guard.__file__, run_id, str(GRACE_SECONDS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
        text=True,
    )
    assert guard.stdin is not None
    logs = [log_dir / worker.log_name for worker in workers]
    handlers = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    procs: list[subprocess.Popen] = []
    echo = None
    try:
        for worker, log in zip(workers, logs, strict=True):
            procs.append(_start(command, worker, log, run_id))
            guard.stdin.write(f"{procs[-1].pid}\n")  # the worker's process group
            guard.stdin.flush()
        echo = _Echo(logs[0])  # a thread only after every fork
        return _watch(workers, procs, logs, heartbeat_timeout)
    except _Stop as stop:
        _say(f"got {signal.Signals(stop.signum).name}; stopping all workers")
        return 128 + stop.signum
    finally:
        for sig in handlers:
            signal.signal(sig, signal.SIG_IGN)  # the stopping below runs to its end
        _stop_job(run_id, procs)
        if echo is not None:
            echo.close()
        guard.stdin.close()
        guard.wait()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """The `fleetjax-run` command; returns the exit code."""
    try:
        if _LIBC is None:
            raise LaunchError("fleetjax-run runs on Linux only (it relies on /proc and prctl)")
        args = parse_args(argv)
        log_dir = _checked_paths(args)
        workers = plan_workers(args)
        world = int(workers[0].env["PADDLE_TRAINERS_NUM"])
        coordinator = workers[0].env.get("JAX_COORDINATOR_ADDRESS", "")
        if world > 1 and workers[0].rank == 0 and workers[0].role == "worker":
            check_port_free(int(coordinator.rpartition(":")[2]))
    except LaunchError as e:
        _say(f"error: {e}")
        return 2
    except KeyboardInterrupt:  # waiting for the other nodes at --master
        _say("got SIGINT before any worker started")
        return 128 + signal.SIGINT
    servers = sum(worker.role == "server" for worker in workers)
    trainers = [worker.rank for worker in workers if worker.role == "worker"]
    started = f"workers {trainers[0]}..{trainers[-1]} of {world}" if trainers else "no workers"
    _say(
        f"starting {started}{f' and {servers} parameter server(s)' if servers else ''}; "
        f"logs in {log_dir}/workerlog.N{', serverlog.N' if servers else ''}"
    )
    command = [sys.executable, "-u", args.training_script, *args.training_script_args]
    return run(workers, command, log_dir, args.heartbeat_timeout)


if __name__ == "__main__":
    sys.exit(main())
