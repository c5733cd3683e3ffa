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
        node finds itself in `--ips` by the addresses it can bind (or `--host`, `--rank`); the
        launchers meet at the first node's port `--start_port - 1` before any worker starts:
            python -m fleetjax.launch --ips 10.0.0.1,10.0.0.2 --gpus 0,1,2,3 train.py
      - `--master host:port --nnodes N`: the nodes meet at `--master`, which the node that
        owns that address serves (`--rank` picks a node's rank, `--job_id` names the job):
            python -m fleetjax.launch --master 10.0.0.1:8090 --nnodes 2 train.py
    Either way the launchers stay linked (fleetjax/_rendezvous.py, fleetjax/_job.py): each
    says it is alive every second, the serving node names the job's first failure for all,
    and Gloo listens on and announces each node's own address (never the host name's).

Faults (the first failure is named, with its code, whatever the others do afterwards):
  * A worker that exits with an error or is killed: the launcher prints the end of its log
    (its traceback, unless the console showed it), then `<who> <what>; stopping all workers`
    as its last line, stops the others (SIGTERM, then SIGKILL after 3 s, Paddle's wait) and exits
    with that worker's code (128 + signal number if it was killed). The script runs under
    fleetjax/_worker.py, which records how it ended before Python's exit handlers, so a
    `sys.exit(3)` while the others wait in a collective is named at once (JAX's shutdown
    barrier would hold that worker for 5 minutes); a joined worker that leaves by
    `os._exit(0)` while the others run is a failure too (exit code 1).
  * Hangs: a worker that neither writes to its log, runs a `TrainStep`, nor calls
    `heartbeat()` for `--heartbeat_timeout` seconds (default `DEFAULT_HEARTBEAT_TIMEOUT`; 0:
    never) is taken as hung: of the silent workers, the one with the fewest steps (the others
    wait for it in a collective); exit code 124.
  * Another node: a worker of it fails (named on every node), its launcher dies, or it says
    nothing for `--peer_timeout` seconds (a lost link or node, `DEFAULT_PEER_TIMEOUT`): the
    job stops on every node with the same message and exit code (124 for a lost node). A node
    that does not come within `--join_timeout`, or nodes with different `--nproc_per_node`:
    `fleetjax-run: error: ...` and exit code 2, before anything starts.
  * Restarts: `--max_restart N` restarts the whole job (every node) after a failure, N times
    at most; default 0, or 3 (Paddle's) with `--elastic_level 1`/`2` or `--nnodes min:max`.
    With `--nnodes min:max` (and `--master`) the job goes on with the nodes left, at least
    min, waiting `--elastic_timeout` seconds for more. The script resumes from its latest
    intact checkpoint (docs/checkpoints.md); each later attempt appends to the logs.
  * Ctrl-C, SIGINT or SIGTERM to the launcher stops all workers the same way (exit code
    128 + signal number), on every node. Every process the workers started is stopped with
    them, also a detached one (its own session), and also when the launcher itself is killed
    by SIGKILL: a guard process (fleetjax/_guard.py) outlives the launcher for that.
  * A closed console (`fleetjax-run ... | head -1`, a dropped terminal) only ends the echo:
    workers write to their log files, never to the console.
  * Bad options, a busy coordinator port, a `--log_dir` that cannot be a directory: one line
    `fleetjax-run: error: ...` and exit code 2, before anything starts.

Parameter-server jobs (Paddle's `--server_num`, `--servers`, `--trainer_num` or fleetrun's
`--worker_num`, `--workers` or `--trainers`):
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
import dataclasses
import errno
import functools
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

from fleetjax import _job, _liveness, _rendezvous, _supervise, _worker
from fleetjax._supervise import say as _say
from fleetjax.fleet import _join

DEFAULT_START_PORT = 6070  # Paddle's
# A worker silent this long is hung. Each TrainStep call is progress (its first, compiling,
# too), so this covers what else a healthy worker may do without output: compiling other
# functions, loading data, a checkpoint; 30 minutes is PyTorch's default collective timeout.
DEFAULT_HEARTBEAT_TIMEOUT = 1800.0
# The launchers of a job's nodes talk every second: 4 s of silence is a lost node or link, and
# the job has stopped within 10 s (3 s of it the workers' grace period).
DEFAULT_PEER_TIMEOUT = 4.0
DEFAULT_JOIN_TIMEOUT = float(_join.JOIN_TIMEOUT_SECONDS)  # JAX's initialization timeout
DEFAULT_ELASTIC_TIMEOUT = 30.0  # Paddle's --elastic_timeout
PADDLE_MAX_RESTART = 3  # Paddle's --max_restart, which Paddle applies with --elastic_level >= 1
Worker = _supervise.Worker


class LaunchError(Exception):
    """The launch cannot go ahead (bad options, busy port); the message says why."""


def heartbeat() -> None:
    """Tell `fleetjax-run --heartbeat_timeout` that this worker makes progress.

    Output to the worker's log counts as progress already, and so does each `TrainStep` call;
    call this in other stretches without output (it touches the log,
    `FLEETJAX_HEARTBEAT_FILE`). Outside `fleetjax-run` it does nothing.
    """
    _liveness.beat()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise LaunchError(message)  # one line, as every other usage error


def _seconds(text: str) -> float:
    with contextlib.suppress(ValueError):
        if (seconds := float(text)) >= 0 and seconds != float("inf"):
            return seconds
    raise argparse.ArgumentTypeError(f"must be a number of seconds (0 or more), got {text!r}")


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
        "--selected_gpus",
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
    _add_fault_options(parser)
    add("training_script", nargs="?", help="the script each process runs")
    add("training_script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def _add_fault_options(parser: argparse.ArgumentParser) -> None:
    """The options for faults and restarts, and Paddle's parameter-server options."""
    add = parser.add_argument
    add(
        "--heartbeat_timeout",
        type=_seconds,
        default=DEFAULT_HEARTBEAT_TIMEOUT,
        metavar="SECONDS",
        help="stop the job when a worker neither writes to its log, runs a TrainStep nor calls "
        "fleetjax.launch.heartbeat() for this long; 0: never "
        f"(default: {DEFAULT_HEARTBEAT_TIMEOUT:g})",
    )
    add(
        "--peer_timeout",
        type=_seconds,
        default=DEFAULT_PEER_TIMEOUT,
        metavar="SECONDS",
        help="a node whose launcher says nothing for this long is lost (default: "
        f"{DEFAULT_PEER_TIMEOUT:g}); workers' JAX heartbeat timeout is twice this",
    )
    add(
        "--join_timeout",
        type=_seconds,
        default=DEFAULT_JOIN_TIMEOUT,
        metavar="SECONDS",
        help="how long the nodes (and the workers' JAX processes) have to meet "
        f"(default: {DEFAULT_JOIN_TIMEOUT:g})",
    )
    elastic = parser.add_argument_group("restarts and elastic nodes (Paddle's)")
    elastic.add_argument(
        "--max_restart",
        type=int,
        help="restart the whole job after a failure up to this many times (default: 0; 3, "
        "Paddle's, with --elastic_level 1 or 2 or --nnodes min:max)",
    )
    elastic.add_argument(
        "--elastic_level",
        type=int,
        default=-1,
        choices=(-1, 0, 1, 2),
        help="-1/0: no restarts (Paddle's default -1); 1 or 2: restart after a failure (3 "
        "times unless --max_restart says otherwise); fewer nodes take --nnodes min:max",
    )
    elastic.add_argument(
        "--elastic_timeout",
        type=_seconds,
        default=DEFAULT_ELASTIC_TIMEOUT,
        metavar="SECONDS",
        help="with --nnodes min:max, once min nodes are there, how long to wait for more "
        f"(default: {DEFAULT_ELASTIC_TIMEOUT:g}, Paddle's)",
    )
    ps = parser.add_argument_group("parameter-server jobs (Paddle's)")
    ps.add_argument("--server_num", type=int, help="parameter servers on this node")
    ps.add_argument("--servers", help="comma-separated ip:port of every parameter server")
    ps.add_argument(
        "--trainer_num", "--worker_num", dest="trainer_num", type=int, help="trainers on this node"
    )
    ps.add_argument(
        "--workers", "--trainers", dest="workers", help="comma-separated ip:port of every trainer"
    )


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
            f"--devices (--gpus) {devices} names GPUs, but this machine has none ({why}); "
            "without GPUs, give the processes with --nproc_per_node and each one's simulated "
            "CPU devices with --cpu_devices_per_proc"
        )
    missing = [d for d in selected if d not in visible]
    if missing:
        raise LaunchError(
            f"--devices (--gpus) {devices}: GPU {','.join(missing)} is not among this "
            f"machine's GPUs {','.join(visible)}"
        )
    return selected


def _node_count(text: str | None, master: bool) -> tuple[int, int] | None:
    """(least, most) nodes of `--nnodes N` or `--nnodes min:max` (elastic, at `--master`)."""
    if text is None:
        return None
    least, sep, most = text.partition(":")
    if not sep:
        most = least
    if not (least.isdigit() and most.isdigit()) or not 1 <= int(least) <= int(most):
        raise LaunchError(
            f"--nnodes must be a number of nodes (at least 1) or a range min:max, got {text!r}"
        )
    if sep and not master:
        raise LaunchError(
            f"--nnodes {text} (an elastic range) needs --master, where nodes can come and go; "
            "--ips lists a fixed set of nodes"
        )
    return int(least), int(most)


@dataclasses.dataclass(frozen=True)
class Nodes:
    """Where this node's job runs.

    Attributes:
      nnodes: the least and the most nodes (1, 1 for one node).
      host: this node's address for its endpoints (None: the one that reaches `master`).
      rank: the rank this node asks for (-1: any); with `--ips` its place in the list.
      master: where the nodes meet (None: one node, nothing to meet).
      ips: `--ips` (empty with `--master`).
    """

    nnodes: tuple[int, int] = (1, 1)
    host: str | None = "127.0.0.1"
    rank: int = 0
    master: tuple[str, int] | None = None
    ips: tuple[str, ...] = ()


def where(args: argparse.Namespace) -> Nodes:
    """Where the job's nodes are, from `--ips`, or `--master` and `--nnodes`.

    Raises:
      LaunchError: if the options do not fit together (the message names them).
    """
    if args.rank < -1:
        raise LaunchError(f"--rank must be a node's rank (0, 1, ...) or -1 (any), got {args.rank}")
    if args.master is not None:
        if args.ips is not None:
            raise LaunchError("give --master (the nodes meet there) or --ips, not both")
        try:
            master = _rendezvous.parse_master(args.master)
        except _rendezvous.RendezvousError as e:
            raise LaunchError(str(e)) from None
        nnodes = _node_count(args.nnodes, master=True) or (1, 1)
        if nnodes[1] == 1:  # a single node needs no rendezvous (as in Paddle)
            if args.rank > 0:
                raise LaunchError(f"--rank {args.rank} of a single node (--nnodes 1)")
            return Nodes(host=args.host or "127.0.0.1")
        return Nodes(nnodes, args.host, args.rank, master)
    ips = _split(args.ips or "127.0.0.1", "--ips")
    if len(set(ips)) != len(ips):
        raise LaunchError(f"--ips {args.ips} repeats a node")
    nnodes = _node_count(args.nnodes, master=False)
    if nnodes is not None and nnodes[0] != len(ips):
        raise LaunchError(
            f"--nnodes {nnodes[0]} but --ips lists {len(ips)} node(s); list every node in "
            "--ips, or let the nodes meet at --master"
        )
    node = node_index(ips, args.host, args.rank)
    if len(ips) == 1:
        return Nodes(host=ips[0])
    if args.start_port < 2:
        raise LaunchError(
            f"--start_port {args.start_port}: the launchers of --ips nodes meet at the first "
            "node's port start_port - 1, so it must be at least 2"
        )
    master = (ips[0], args.start_port - 1)
    return Nodes((len(ips), len(ips)), ips[node], node, master, tuple(ips))


@dataclasses.dataclass(frozen=True)
class Layout:
    """This node's processes in a collective job and what each gets besides its rank.

    Attributes:
      nproc: processes on this node (`--nproc_per_node`).
      gpus: this node's GPUs, split evenly over them (none: CPU devices).
      cpu_devices: simulated CPU devices per process, without GPUs.
      start_port: process `i`'s endpoint port is `start_port + i`.
      env: variables every trainer gets (JAX's platform, the timeouts of its join).
    """

    nproc: int
    gpus: tuple[str, ...]
    cpu_devices: int
    start_port: int
    env: dict[str, str]

    @property
    def ports(self) -> list[int]:
        return [self.start_port + i for i in range(self.nproc)]


def layout(args: argparse.Namespace, environ: Mapping[str, str]) -> Layout:
    """This node's processes and devices, checked.

    Raises:
      LaunchError: if the options do not fit together or this machine (the message names
        them).
    """
    if not 0 < args.start_port < 65536:
        raise LaunchError(f"--start_port must be a port number 1..65535, got {args.start_port}")
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
    env = {**_jax_platform(gpus, cpu_devices, environ), **_join_timeouts(args)}
    return Layout(nproc, tuple(gpus), cpu_devices, args.start_port, env)


def collective_workers(layout: Layout, nodes: list[list[str]], node: int) -> list[Worker]:
    """The processes of node `node` of a job whose nodes have the worker endpoints `nodes`,
    with the variables each gets."""
    endpoints = [e for node_endpoints in nodes for e in node_endpoints]
    common = {
        "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_NNODES": str(len(nodes)),
        "JAX_COORDINATOR_ADDRESS": endpoints[0],
        **layout.env,
    }
    first = sum(len(n) for n in nodes[:node])
    workers = []
    for local_rank in range(layout.nproc):
        rank = first + local_rank
        env = {
            **common,
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
            "PADDLE_RANK_IN_NODE": str(local_rank),
            **_gpus_of(layout.gpus, local_rank, layout.nproc),
        }
        workers.append(Worker(rank, local_rank, env))
    return workers


def plan_workers(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> list[Worker]:
    """The processes to start on this node and the variables each gets, where the nodes are
    known without meeting (one node, or `--ips`).

    Raises:
      LaunchError: if the options do not fit together (the message names them), or the
        nodes meet at `--master` (their endpoints are known once they met).
    """
    environ = os.environ if environ is None else environ
    if any(getattr(args, name) is not None for name in _PS_OPTIONS):
        return _plan_parameter_server(args, environ)
    nodes, this = where(args), layout(args, environ)
    if nodes.ips:
        table = [[_rendezvous.endpoint(ip, port) for port in this.ports] for ip in nodes.ips]
        return collective_workers(this, table, nodes.rank)
    if nodes.master is not None:
        raise LaunchError("with --master and several nodes, the nodes meet before planning")
    assert nodes.host is not None
    return collective_workers(this, [[_rendezvous.endpoint(nodes.host, p) for p in this.ports]], 0)


def _join_timeouts(args: argparse.Namespace) -> dict[str, str]:
    """The variables with which a trainer's `fleet.init()` joins JAX's runtime: how long it
    waits for the others, and JAX's heartbeat timeout (twice the launchers', so that they
    name a lost node first)."""
    return {
        _join.JOIN_TIMEOUT_VARIABLE: str(math.ceil(args.join_timeout)),
        _join.HEARTBEAT_VARIABLE: str(math.ceil(2 * args.peer_timeout)),
    }


def _jax_platform(
    gpus: Sequence[str], cpu_devices: int, environ: Mapping[str, str]
) -> dict[str, str]:
    """The JAX variables of a trainer for its devices: the CPU's, or the GPUs'."""
    if not gpus:
        return {
            "JAX_PLATFORMS": "cpu",
            "JAX_NUM_CPU_DEVICES": str(cpu_devices),
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
        }
    if not environ.get("JAX_PLATFORMS"):
        return {"JAX_PLATFORMS": "cuda"}  # a GPU that JAX cannot use fails, never the CPU
    return {}


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
    jax_env = {
        "JAX_COORDINATOR_ADDRESS": trainers[0],
        **_jax_platform(gpus, cpu_devices, environ),
        **_join_timeouts(args),
    }
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


# -- running -----------------------------------------------------------------------------------
class _Stop(Exception):
    """The launcher got SIGINT or SIGTERM."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, frame: object) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):  # once: a second ^C must not cut the stopping
        signal.signal(sig, signal.SIG_IGN)
    raise _Stop(signum)


def _options(args: argparse.Namespace, log_dir: pathlib.Path, nodes: Nodes) -> _job.Options:
    """How the job runs, from the options; restarts as Paddle allows them by default."""
    for option in ("join_timeout", "peer_timeout"):
        if getattr(args, option) < 1:
            raise LaunchError(
                f"--{option} must be at least 1 second, got {getattr(args, option):g}"
            )
    elastic = nodes.nnodes[0] < nodes.nnodes[1] or args.elastic_level >= 1
    max_restart = args.max_restart
    if max_restart is None:
        max_restart = PADDLE_MAX_RESTART if elastic else 0
    if max_restart < 0:
        raise LaunchError(f"--max_restart must be 0 or more, got {max_restart}")
    return _job.Options(
        command=[sys.executable, "-u", "-P", _worker.__file__, args.training_script,
                 *args.training_script_args],
        log_dir=log_dir,
        heartbeat_timeout=args.heartbeat_timeout or None,
        peer_timeout=args.peer_timeout,
        max_restart=max_restart,
        join_timeout=args.join_timeout,
        elastic_timeout=args.elastic_timeout,
        nnodes=nodes.nnodes,
        fixed_ranks=bool(nodes.ips),
        ips=nodes.ips,
    )  # fmt: skip


def _meet_and_run(job: _job.Job, args: argparse.Namespace, nodes: Nodes, ports: list[int]) -> int:
    """Run `job` on this node: alone, as the node that serves the rendezvous, or as another."""
    if nodes.master is None:
        assert nodes.host is not None
        return job.run_alone([[_rendezvous.endpoint(nodes.host, p) for p in ports]])
    listener = _rendezvous.serve(nodes.master, args.job_id, job.events)
    master = _rendezvous.endpoint(*nodes.master)
    if listener is None and nodes.ips and nodes.rank == 0:
        raise LaunchError(
            f"cannot serve the rendezvous of the --ips nodes at {master}: the port is in use "
            "(another job?); choose another --start_port"
        )
    if listener is None:
        link, _ = _rendezvous.register(
            nodes.master, (args.job_id, nodes.rank, ports), nodes.host, job.events,
            job.options.join_timeout,
        )  # fmt: skip
        return job.run_node(link, master)
    try:
        check_port_free(ports[0])  # worker 0's, the JAX coordinator's
        host = nodes.host or nodes.master[0]
        me = _job.Member(None, [_rendezvous.endpoint(host, p) for p in ports], nodes.rank)
        members = job.gather([me], first=True)
        if not job.options.max_restart:
            listener.close()  # no node can join later
        return job.run_hub(members)
    finally:
        listener.close()


def _prepare(
    args: argparse.Namespace, log_dir: pathlib.Path, environ: Mapping[str, str]
) -> tuple[_job.Options, _job.Planner, Callable[[_job.Job], int]]:
    """What runs and how: the job's options, the planner of this node's workers and the
    function that runs the job; checked, nothing started.

    Raises:
      LaunchError: for options that do not fit together, or a busy coordinator port.
    """
    if any(getattr(args, name) is not None for name in _PS_OPTIONS):
        workers = _plan_parameter_server(args, environ)
        options = _options(args, log_dir, Nodes())
        return options, lambda nodes, rank: workers, lambda job: job.run_alone([[]])
    nodes, this = where(args), layout(args, environ)
    options = _options(args, log_dir, nodes)
    if nodes.nnodes[0] < nodes.nnodes[1]:  # fleet.init() explains a strategy that lost nodes
        elastic = {_join.MAX_NODES_VARIABLE: str(nodes.nnodes[1])}
        this = dataclasses.replace(this, env={**this.env, **elastic})
    if nodes.master is None and this.nproc > 1:
        check_port_free(this.start_port)  # worker 0's, the JAX coordinator's
    return (
        options,
        functools.partial(collective_workers, this),
        lambda job: _meet_and_run(job, args, nodes, this.ports),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """The `fleetjax-run` command; returns the exit code."""
    try:
        if sys.platform != "linux":
            raise LaunchError("fleetjax-run runs on Linux only (it relies on /proc and prctl)")
        args = parse_args(argv)
        if args.training_script is None:
            raise LaunchError("no training script: fleetjax-run [options] train.py [its arguments]")
        options, planner, run_job = _prepare(args, pathlib.Path(args.log_dir), os.environ)
        _checked_paths(args)  # the log directory made last, once all else is right
    except LaunchError as e:
        _say(f"error: {e}")
        return 2
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="fleetjax-run-"))
    job = _job.Job(options, planner, run_dir)
    handlers = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run_job(job)
    except (LaunchError, _rendezvous.RendezvousError) as e:  # before any worker started
        _say(f"error: {e}")
        return 2
    except _Stop as stop:
        name = signal.Signals(stop.signum).name
        _say(
            f"got {name}"
            + ("; stopping all workers" if job.attempt else " before any worker started")
        )
        job.stop_from_outside(stop.signum)
        return 128 + stop.signum
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
