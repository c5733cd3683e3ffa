"""What this machine has and gives a worker: its addresses, GPUs and ports, and the JAX
variables a trainer starts with."""

from __future__ import annotations

import argparse
import errno
import math
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence

from fleetjax import _worker
from fleetjax.launch._arguments import LaunchError, split_list


def is_local_address(host: str) -> bool:
    """Whether this machine owns `host`: only a local address can be bound."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
    except OSError:
        return False
    return True


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


def selected_gpus(devices: str | None, environ: Mapping[str, str]) -> list[str]:
    """The GPUs this node trains on: `--devices` (each one this machine has), else all."""
    visible = visible_gpus(environ)
    if devices is None:
        return visible
    selected = split_list(devices, "--devices (--gpus)")
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


def join_timeouts(args: argparse.Namespace) -> dict[str, str]:
    """The variables with which a trainer's `fleet.init()` joins JAX's runtime: how long it
    waits for the others, and JAX's heartbeat timeout (twice the launchers', so that they
    name a lost node first)."""
    return {
        _worker.JOIN_TIMEOUT: str(math.ceil(args.join_timeout)),
        _worker.JAX_HEARTBEAT_TIMEOUT: str(math.ceil(2 * args.peer_timeout)),
    }


def jax_platform(
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


def gpus_of(gpus: Sequence[str], local_rank: int, nproc: int) -> dict[str, str]:
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
