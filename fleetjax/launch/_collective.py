"""The processes of a collective job on this node: where the nodes are (`--ips`, or `--master`
and `--nnodes`), this node's processes and devices, and the variables each worker gets."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence

from fleetjax.launch import _rendezvous
from fleetjax.launch._arguments import LaunchError, split_list
from fleetjax.launch._machine import (
    gpus_of,
    is_local_address,
    jax_platform,
    join_timeouts,
    selected_gpus,
)
from fleetjax.launch._parameter_server import is_parameter_server, plan_parameter_server
from fleetjax.launch._supervise import Worker


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
    mine = [i for i, ip in enumerate(ips) if is_local_address(ip)]
    if len(mine) != 1:
        found = "none" if not mine else ", ".join(ips[i] for i in mine)
        raise LaunchError(
            f"cannot tell which of --ips {','.join(ips)} is this node (local addresses among "
            f"them: {found}); pass --host"
        )
    return mine[0]


def node_count(text: str | None, master: bool) -> tuple[int, int] | None:
    """(least, most) nodes of `--nnodes N` or `--nnodes min:max` (elastic, at `--master`)."""
    if text is None:
        return None
    least, sep, most = text.partition(":")
    if not sep:
        most = least
    numbers = f"{least}{most}".isascii() and least.isdigit() and most.isdigit()  # not '²'
    if not numbers or not 1 <= int(least) <= int(most):
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
        nnodes = node_count(args.nnodes, master=True) or (1, 1)
        if nnodes[1] == 1:  # a single node needs no rendezvous (as in Paddle)
            if args.rank > 0:
                raise LaunchError(f"--rank {args.rank} of a single node (--nnodes 1)")
            return Nodes(host=args.host or "127.0.0.1")
        return Nodes(nnodes, args.host, args.rank, master)
    ips = split_list(args.ips or "127.0.0.1", "--ips")
    if len(set(ips)) != len(ips):
        raise LaunchError(f"--ips {args.ips} repeats a node")
    nnodes = node_count(args.nnodes, master=False)
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
    gpus = selected_gpus(args.devices, environ)
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
    env = {**jax_platform(gpus, cpu_devices, environ), **join_timeouts(args)}
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
            **gpus_of(layout.gpus, local_rank, layout.nproc),
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
    if is_parameter_server(args):
        return plan_parameter_server(args, environ)
    nodes, this = where(args), layout(args, environ)
    if nodes.ips:
        table = [[_rendezvous.endpoint(ip, port) for port in this.ports] for ip in nodes.ips]
        return collective_workers(this, table, nodes.rank)
    if nodes.master is not None:
        raise LaunchError("with --master and several nodes, the nodes meet before planning")
    assert nodes.host is not None
    return collective_workers(this, [[_rendezvous.endpoint(nodes.host, p) for p in this.ports]], 0)
