"""The processes of a parameter-server job (Paddle's `--server_num`, `--servers`,
`--trainer_num`, `--workers`) and the variables each gets."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from fleetjax.launch._arguments import LaunchError, split_list
from fleetjax.launch._machine import (
    gpus_of,
    is_local_address,
    jax_platform,
    join_timeouts,
    selected_gpus,
)
from fleetjax.launch._supervise import Worker

PS_OPTIONS = ("server_num", "servers", "trainer_num", "workers")


def is_parameter_server(args: argparse.Namespace) -> bool:
    """Whether the job is a parameter-server one: Paddle's `--run_mode ps`, or any of its
    options (`PS_OPTIONS`) without a `--run_mode`.

    Raises:
      LaunchError: for a `--run_mode` the options contradict.
    """
    given = [f"--{name}" for name in PS_OPTIONS if getattr(args, name) is not None]
    if args.run_mode == "collective" and given:
        raise LaunchError(
            f"--run_mode collective, but {', '.join(given)} "
            + ("is an option" if len(given) == 1 else "are options")
            + " of a parameter-server job (Paddle's --run_mode ps); leave them out, or give "
            "--run_mode ps"
        )
    if args.run_mode == "ps" and not given:
        raise LaunchError(
            "--run_mode ps needs the job's servers and trainers: --server_num N and "
            "--trainer_num M on this node (or --servers and --workers, lists of ip:port)"
        )
    return bool(given)


def _ps_endpoint(text: str, option: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise LaunchError(f"{option}: {text!r} is not an endpoint of the form ip:port")
    return f"{host}:{int(port)}"


def ps_endpoints(listed: str | None, count: int | None, what: str, first_port: int) -> list[str]:
    """Every server's or trainer's endpoint: `--servers`/`--workers`, else `count` on this
    node from `first_port`."""
    option, count_option = (
        ("--servers", "--server_num") if what == "server" else ("--workers", "--trainer_num")
    )
    if listed is not None:
        endpoints = [_ps_endpoint(e, option) for e in split_list(listed, option)]
        if count is not None and count != len(endpoints):
            raise LaunchError(f"{count_option} {count} but {option} lists {len(endpoints)}")
        if len(set(endpoints)) != len(endpoints):
            raise LaunchError(f"{option} {listed} repeats an endpoint")
        return endpoints
    if count is None or count < 1:
        got = f"; got {count_option} {count}" if count is not None else ""
        raise LaunchError(
            f"a parameter-server job needs {count_option} (at least 1) or {option}{got}"
        )
    return [f"127.0.0.1:{first_port + i}" for i in range(count)]


def plan_parameter_server(args: argparse.Namespace, environ: Mapping[str, str]) -> list[Worker]:
    """This node's trainers (first) and servers of a parameter-server job: those of
    `--workers`/`--servers` at an address this machine owns, or all with the counts."""
    for option in ("ips", "master", "nproc_per_node"):
        if getattr(args, option) is not None:
            raise LaunchError(
                f"--{option} is for collective jobs; a parameter-server job's processes are "
                "given by --server_num/--servers and --trainer_num/--workers"
            )
    if args.servers is None and args.server_num is None:
        raise LaunchError(_trainers_alone(args))
    servers = ps_endpoints(args.servers, args.server_num, "server", args.start_port)
    trainers = ps_endpoints(
        args.workers, args.trainer_num, "trainer", args.start_port + len(servers)
    )
    if len(set(servers) | set(trainers)) != len(servers) + len(trainers):
        raise LaunchError("a server and a trainer have the same endpoint")
    gpus = selected_gpus(args.devices, environ)
    mine = [i for i, e in enumerate(trainers) if is_local_address(e.rpartition(":")[0])]
    local_servers = [i for i, e in enumerate(servers) if is_local_address(e.rpartition(":")[0])]
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
        **jax_platform(gpus, cpu_devices, environ),
        **join_timeouts(args),
    }
    planned = []
    for local_rank, rank in enumerate(mine):
        host, _, port = trainers[rank].rpartition(":")
        env = {**common, **jax_env, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(rank)}
        env.update(POD_IP=host, PADDLE_PORT=port, **gpus_of(gpus, local_rank, len(mine)))
        planned.append(Worker(rank, local_rank, env))
    for local_rank, index in enumerate(local_servers):
        host, _, port = servers[index].rpartition(":")
        env = {**common, "TRAINING_ROLE": "PSERVER", "POD_IP": host, "PADDLE_PORT": port}
        env["JAX_PLATFORMS"] = "cpu"  # a server never takes an accelerator
        planned.append(Worker(index, len(mine) + local_rank, env, role="server"))
    return planned


def _trainers_alone(args: argparse.Namespace) -> str:
    """Trainers without servers: what the user probably meant, collective or parameter-server."""
    if args.trainer_num is not None:
        given, count = f"--trainer_num (--worker_num) {args.trainer_num}", args.trainer_num
    else:
        given, count = f"--workers {args.workers}", len(split_list(args.workers, "--workers"))
    return (
        f"{given} without servers: a parameter-server job (Paddle's --run_mode ps) also needs "
        "its servers, --server_num N on this node or --servers ip:port,...; for a collective "
        f"job of {count} processes on this node, give --nproc_per_node {count} instead"
    )
