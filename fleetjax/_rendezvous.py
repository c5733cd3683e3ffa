"""`fleetjax-run --master`: the nodes of a job find each other (Paddle's HTTP master).

The node that owns the `--master` address serves: it takes one registration from each other
node (a line of JSON: the job id, the node rank asked for or -1, its worker endpoints), numbers
the nodes and answers each with every node's endpoints, in node order. Nothing else is
exchanged, and the server closes once every node has its answer (docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import time
from typing import Any

TIMEOUT_SECONDS = 300.0  # for every node to arrive; as long as JAX waits for its processes
_READ_SECONDS = 10.0  # for a connected node to send its registration
_MAX_MESSAGE = 1 << 20
_RETRY_SECONDS = 0.5


class RendezvousError(Exception):
    """The nodes could not agree; the message says why."""


def endpoint(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_master(text: str) -> tuple[str, int]:
    """(host, port) of `--master`: `host:port`, optionally `http://host:port`."""
    address = text.removeprefix("http://")
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if "://" in address or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RendezvousError(
            f"--master {text!r} is not an address of the form host:port (or http://host:port)"
        )
    return host, int(port)


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    conn.sendall(json.dumps(message).encode() + b"\n")


def _receive(conn: socket.socket, deadline: float) -> Any:
    """One line of JSON from `conn` (None if it is not one, too long or not done in time)."""
    data = b""
    with contextlib.suppress(OSError, ValueError):
        while not data.endswith(b"\n") and len(data) < _MAX_MESSAGE:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = conn.recv(1 << 16)
            if not chunk:
                return None
            data += chunk
        return json.loads(data)
    return None


def _registration(message: Any) -> tuple[str, int, list[str]] | None:
    """(job id, rank, endpoints) of a node's registration, or None if it is not one."""
    if not isinstance(message, dict):
        return None
    job_id, rank, endpoints = message.get("job_id"), message.get("rank"), message.get("endpoints")
    if not isinstance(job_id, str) or type(rank) is not int or not isinstance(endpoints, list):
        return None
    if not endpoints or not all(isinstance(e, str) and ":" in e for e in endpoints):
        return None
    return job_id, rank, endpoints


def _number(requested: list[int], nnodes: int) -> list[int]:
    """Node ranks: the ones asked for, then the free ones in arrival order (this node first)."""
    asked = [r for r in requested if r >= 0]
    if any(r >= nnodes for r in asked) or len(set(asked)) != len(asked):
        raise RendezvousError(
            f"the nodes ask for ranks {sorted(asked)}, which are not distinct ranks "
            f"0..{nnodes - 1} of --nnodes {nnodes}"
        )
    free = iter(sorted(set(range(nnodes)) - set(asked)))
    return [r if r >= 0 else next(free) for r in requested]


def _serve(
    listener: socket.socket, job_id: str, rank: int, endpoints: list[str], nnodes: int
) -> tuple[list[list[str]], int]:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    peers: list[tuple[socket.socket, int, list[str]]] = []
    try:
        while len(peers) < nnodes - 1:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                raise RendezvousError(
                    f"{len(peers) + 1} of --nnodes {nnodes} nodes came to the rendezvous "
                    f"within {TIMEOUT_SECONDS:g} s"
                ) from None
            node = _registration(_receive(conn, min(deadline, time.monotonic() + _READ_SECONDS)))
            if node is None or node[0] != job_id:
                # Not a node of this job: refuse it and wait on.
                with contextlib.suppress(OSError):
                    _send(conn, {"error": f"this is the rendezvous of job {job_id!r}"})
                conn.close()
                continue
            peers.append((conn, node[1], node[2]))
        ranks = _number([rank] + [r for _, r, _ in peers], nnodes)
        arrived = [endpoints] + [e for *_, e in peers]
        table = [arrived[ranks.index(r)] for r in range(nnodes)]
        everyone = [e for node in table for e in node]
        if len(set(everyone)) != len(everyone):
            raise RendezvousError(f"the nodes' worker endpoints repeat: {everyone}")
        for (conn, *_), node_rank in zip(peers, ranks[1:], strict=True):
            _send(conn, {"rank": node_rank, "nodes": table})
        return table, ranks[0]
    except RendezvousError as e:
        for conn, *_ in peers:
            with contextlib.suppress(OSError):
                _send(conn, {"error": str(e)})
        raise
    finally:
        for conn, *_ in peers:
            conn.close()


def _register(
    master: tuple[str, int], job_id: str, rank: int, host: str | None, ports: list[int]
) -> tuple[list[list[str]], int]:
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while True:
        try:
            conn = socket.create_connection(master, timeout=_RETRY_SECONDS)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"no rendezvous at --master {endpoint(*master)} within {TIMEOUT_SECONDS:g} "
                    "s: start fleetjax-run on the node that owns that address too"
                ) from None
            time.sleep(_RETRY_SECONDS)
    with conn:
        host = host or conn.getsockname()[0]  # the address that reaches the master
        _send(
            conn, {"job_id": job_id, "rank": rank, "endpoints": [endpoint(host, p) for p in ports]}
        )
        reply = _receive(conn, deadline)
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        raise RendezvousError(f"the rendezvous at {endpoint(*master)} refused: {reply['error']}")
    if not isinstance(reply, dict) or type(reply.get("rank")) is not int:
        raise RendezvousError(f"no answer from the rendezvous at {endpoint(*master)}")
    return reply["nodes"], reply["rank"]


def _listen(master: tuple[str, int]) -> socket.socket | None:
    """A server socket on `master` if this node owns that address and nobody serves there."""
    family = socket.AF_INET6 if ":" in master[0] else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(master)
        listener.listen()
    except OSError as e:
        listener.close()
        if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None  # another node serves, or the master is another machine
        raise RendezvousError(f"cannot serve the rendezvous at {endpoint(*master)}: {e}") from e
    return listener


def rendezvous(
    master: tuple[str, int],
    job_id: str,
    nnodes: int,
    rank: int,
    host: str | None,
    ports: list[int],
) -> tuple[list[list[str]], int]:
    """Every node's worker endpoints, in node order, and this node's rank among them.

    Args:
      master: the rendezvous address; the node that owns it serves.
      job_id: nodes of another job are refused.
      nnodes: how many nodes to wait for.
      rank: the rank this node asks for, or -1 for any (the serving node comes first).
      host: this node's address for its endpoints (default: the one that reaches `master`).
      ports: this node's worker ports.

    Raises:
      RendezvousError: if not every node came in time, or their ranks or endpoints clash.
    """
    listener = _listen(master)
    if listener is None:
        return _register(master, job_id, rank, host, ports)
    with listener:
        endpoints = [endpoint(host or master[0], p) for p in ports]
        return _serve(listener, job_id, rank, endpoints, nnodes)
