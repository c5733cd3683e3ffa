r"""`fleetjax-run`: Paddle's `fleetrun` launcher, on JAX's multi-process runtime.

    python -m fleetjax.launch [options] train.py [train.py's arguments]

It starts `--nproc_per_node` copies of the script on this node, each with Paddle's role
variables (`PADDLE_TRAINER_ID`, `PADDLE_TRAINERS_NUM`, `PADDLE_TRAINER_ENDPOINTS`,
`PADDLE_CURRENT_ENDPOINT`, `PADDLE_RANK_IN_NODE`) and `JAX_COORDINATOR_ADDRESS`; the script's
`fleet.init()` then joins all processes with `jax.distributed.initialize`. The coordinator is
the first endpoint, `<first of --ips>:<--start_port>`. Worker `N` writes to
`<--log_dir>/workerlog.N` (appended); the node's first worker is also shown on the console.

Devices:
  * CPU (no GPU found, or `JAX_PLATFORMS=cpu`): each process simulates
    `--cpu_devices_per_proc` CPU devices (`JAX_NUM_CPU_DEVICES`), and processes talk over Gloo
    (`JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo`). Two processes of four devices each:
        python -m fleetjax.launch --nproc_per_node 2 --cpu_devices_per_proc 4 train.py
  * GPU: `--devices`/`--gpus` (default every GPU that `nvidia-smi` lists, or
    `CUDA_VISIBLE_DEVICES`) are split evenly over the processes, one GPU each by default, and
    each process sees only its own (`CUDA_VISIBLE_DEVICES`; Paddle's `FLAGS_selected_gpus` and
    `PADDLE_LOCAL_DEVICE_IDS` too). Collectives use NCCL.
  * Several nodes: run the same command on every node with `--ips` listing the nodes (the
    same `--nproc_per_node` everywhere). Each node finds itself in `--ips` by the addresses
    it can bind (or pass `--host`); worker ranks are numbered node by node:
        python -m fleetjax.launch --ips 10.0.0.1,10.0.0.2 --gpus 0,1,2,3,4,5,6,7 train.py

If a worker exits with an error or is killed, the launcher stops the others (SIGTERM, then
SIGKILL after a grace period), prints the end of the failed worker's log, and exits with that
worker's code (128 + signal number if it was killed). Ctrl-C, SIGINT or SIGTERM to the
launcher stops all workers the same way. A busy coordinator port is reported before anything
starts.

Where a scheduler starts the processes (SLURM, Open MPI), there are two ways:
  * One launcher per node, as with fleetrun (worker roles and logs as above):
        srun --ntasks-per-node=1 python -m fleetjax.launch --gpus 0,1,2,3,4,5,6,7 \
            --ips "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd,)" train.py
  * Or no launcher: `srun python train.py` (or `mpirun -n 16 python train.py`), where
    train.py calls `jax.distributed.initialize()` before `fleet.init()`. JAX then finds the
    coordinator, the process count and this process's index in the scheduler's variables
    (SLURM_*, OMPI_*; on GPUs, SLURM gives each task its GPUs), and `fleet.init()` builds the
    mesh over every process's devices. Without PADDLE_* variables, `fleet.init()` takes the
    worker index and count from JAX (`fleet.JaxProcessRoleMaker`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import errno
import io
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import BinaryIO

DEFAULT_START_PORT = 6070  # Paddle's
GRACE_SECONDS = 5.0  # between SIGTERM and SIGKILL when stopping workers
LOG_TAIL_LINES = 20  # of a failed worker's log, shown on the console
_POLL_SECONDS = 0.1
# Loaded here, not in the forked child, where only the call itself should run.
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None


class LaunchError(Exception):
    """The launch cannot go ahead (bad options, busy port); the message says why."""


@dataclasses.dataclass(frozen=True)
class Worker:
    """One process to start on this node.

    Attributes:
      rank: the global worker index (`PADDLE_TRAINER_ID`).
      local_rank: the index on this node (`PADDLE_RANK_IN_NODE`).
      env: the variables this launcher sets for it (on top of its own environment).
    """

    rank: int
    local_rank: int
    env: dict[str, str]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fleetjax-run",
        description="Start a training script on several processes (Paddle's fleetrun).",
    )
    parser.add_argument(
        "--ips",
        default="127.0.0.1",
        help="comma-separated addresses of the nodes, the coordinator's first (default: "
        "127.0.0.1, this node only)",
    )
    parser.add_argument(
        "--host", help="this node's address among --ips (default: the one this node can bind)"
    )
    parser.add_argument(
        "--nproc_per_node",
        type=int,
        help="processes per node (default: one per device on GPUs, 1 on CPU)",
    )
    parser.add_argument(
        "--devices",
        "--gpus",
        dest="devices",
        help="comma-separated GPU ids of this node, split evenly over its processes "
        "(default: all visible GPUs)",
    )
    parser.add_argument(
        "--cpu_devices_per_proc",
        type=int,
        help="simulated CPU devices per process, without GPUs (default 1)",
    )
    parser.add_argument("--log_dir", default="log", help="where workerlog.N go (default: log)")
    parser.add_argument(
        "--start_port",
        type=int,
        default=DEFAULT_START_PORT,
        help=f"worker i's endpoint port is start_port + i; the first worker's is the JAX "
        f"coordinator's (default: {DEFAULT_START_PORT})",
    )
    parser.add_argument("training_script", help="the script each process runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


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


def node_index(ips: Sequence[str], host: str | None) -> int:
    """This node's position in `ips`: `host`'s, else the one address this machine owns."""
    if host is not None:
        if host not in ips:
            raise LaunchError(f"--host {host} is not one of --ips {','.join(ips)}")
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


def plan_workers(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> list[Worker]:
    """The processes to start on this node and the variables each gets.

    Raises:
      LaunchError: if the options do not fit together (the message names them).
    """
    environ = os.environ if environ is None else environ
    ips = _split(args.ips, "--ips")
    if len(set(ips)) != len(ips):
        raise LaunchError(f"--ips {args.ips} repeats a node")
    node = node_index(ips, args.host)
    if not 0 < args.start_port < 65536:
        raise LaunchError(f"--start_port must be a port number 1..65535, got {args.start_port}")
    gpus = _split(args.devices, "--devices") if args.devices else visible_gpus(environ)
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
    last_port = args.start_port + nproc - 1
    if last_port > 65535:
        raise LaunchError(f"--start_port {args.start_port} + {nproc} processes exceeds port 65535")

    endpoints = [f"{ip}:{args.start_port + i}" for ip in ips for i in range(nproc)]
    common = {
        "PADDLE_TRAINERS_NUM": str(len(endpoints)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(endpoints),
        "PADDLE_NNODES": str(len(ips)),
        "JAX_COORDINATOR_ADDRESS": endpoints[0],
    }
    if not gpus:
        common.update(
            JAX_PLATFORMS="cpu",
            JAX_NUM_CPU_DEVICES=str(cpu_devices),
            JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        )
    workers = []
    per_process = len(gpus) // nproc
    for local_rank in range(nproc):
        rank = node * nproc + local_rank
        env = {
            **common,
            "PADDLE_TRAINER_ID": str(rank),
            "PADDLE_CURRENT_ENDPOINT": endpoints[rank],
            "PADDLE_RANK_IN_NODE": str(local_rank),
        }
        if gpus:
            mine = ",".join(gpus[local_rank * per_process : (local_rank + 1) * per_process])
            env.update(
                CUDA_VISIBLE_DEVICES=mine, FLAGS_selected_gpus=mine, PADDLE_LOCAL_DEVICE_IDS=mine
            )
        workers.append(Worker(rank, local_rank, env))
    return workers


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


def _die_with_launcher() -> None:
    """In the child, before exec: get SIGKILL if the launcher dies, even by SIGKILL (Linux)."""
    pr_set_pdeathsig = 1
    assert _LIBC is not None
    _LIBC.prctl(pr_set_pdeathsig, signal.SIGKILL)


def _copy_output(source: io.BufferedReader, log: BinaryIO) -> None:
    """Tee a worker's output into its log and onto the console, as it comes."""
    for chunk in iter(lambda: source.read1(1 << 16), b""):
        for sink in (log, sys.stdout.buffer):
            sink.write(chunk)
            sink.flush()


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


def _say(message: str) -> None:
    print(f"fleetjax-run: {message}", file=sys.stderr, flush=True)


def _tail(path: pathlib.Path, lines: int) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


def _stop_all(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every worker's process group, then SIGKILL what is left after the grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for proc in procs:
            # A worker's own children share its group; they are stopped with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
        deadline = time.monotonic() + GRACE_SECONDS
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        if all(proc.poll() is not None for proc in procs):
            return


def run(workers: Sequence[Worker], command: Sequence[str], log_dir: pathlib.Path) -> int:
    """Start `command` once per worker and watch them; 0 if all succeed, else the failed
    worker's code (128 + signal if killed by a signal, or if the launcher was stopped)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    handlers = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    procs: list[subprocess.Popen] = []
    logs, copiers = [], []
    try:
        for worker in workers:
            logs.append(open(log_dir / f"workerlog.{worker.rank}", "ab"))  # noqa: SIM115
            console = worker.local_rank == 0
            procs.append(
                subprocess.Popen(
                    command,
                    env={**os.environ, **worker.env},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE if console else logs[-1],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group: stopped as one, not by the tty's ^C
                    preexec_fn=_die_with_launcher if _LIBC is not None else None,
                )
            )
        # Threads only after every fork: a child must not inherit a lock held by one.
        for proc, log in zip(procs, logs, strict=True):
            if proc.stdout is not None:
                copiers.append(threading.Thread(target=_copy_output, args=(proc.stdout, log)))
                copiers[-1].start()
        while True:
            codes = [proc.poll() for proc in procs]
            failed = [(w, c) for w, c in zip(workers, codes, strict=True) if c not in (None, 0)]
            if failed:
                worker, code = failed[0]
                log_path = log_dir / f"workerlog.{worker.rank}"
                _say(f"worker {worker.rank} {_describe(code)}; stopping all workers")
                _stop_all(procs)
                _say(f"the end of {log_path}:\n{_tail(log_path, LOG_TAIL_LINES)}")
                return code if code > 0 else 128 - code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(_POLL_SECONDS)
    except _Stop as stop:
        _say(f"got {signal.Signals(stop.signum).name}; stopping all workers")
        _stop_all(procs)
        return 128 + stop.signum
    finally:
        _stop_all(procs)  # also what a finished worker left running in its group
        for copier in copiers:
            copier.join()
        for log in logs:
            log.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """The `fleetjax-run` command; returns the exit code."""
    args = parse_args(argv)
    try:
        workers = plan_workers(args)
        world = int(workers[0].env["PADDLE_TRAINERS_NUM"])
        if world > 1 and workers[0].rank == 0:
            check_port_free(args.start_port)
    except LaunchError as e:
        _say(f"error: {e}")
        return 2
    _say(
        f"starting workers {workers[0].rank}..{workers[-1].rank} of {world}; "
        f"logs in {args.log_dir}/workerlog.N"
    )
    command = [sys.executable, "-u", args.training_script, *args.training_script_args]
    return run(workers, command, pathlib.Path(args.log_dir))


if __name__ == "__main__":
    sys.exit(main())
