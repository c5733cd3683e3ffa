"""How the launchers of a job's nodes meet, and the connections that keep them in touch.

One node serves: the one that owns the `--master` address (with `--ips`, the first node, at
port `--start_port - 1`). Every other node connects to it and registers with one line of
JSON: the job id, the node rank it asks for (-1: any) and its worker endpoints. The connection
then stays open for the whole job, one JSON message a line each way (`Link`): each side says
`{"alive": true}` every second, and the job's messages (fleetjax/launch/_job.py) go over it. Nothing
else is exchanged (docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import queue
import socket
import threading
import time
from typing import Any, BinaryIO

READ_SECONDS = 10.0  # for a connected node to send its registration
ALIVE_SECONDS = 1.0  # between two "alive" messages on a link
_MAX_MESSAGE = 1 << 20
_RETRY_SECONDS = 0.5


class RendezvousError(Exception):
    """The nodes could not meet or agree; the message says why."""


def endpoint(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_master(text: str) -> tuple[str, int]:
    """(host, port) of `--master`: `host:port`, optionally `http://host:port`."""
    address = text.removeprefix("http://")
    host, sep, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if (
        "://" in address
        or not sep
        or not host
        or not (port.isascii() and port.isdigit())
        or not 0 < int(port) < 65536
    ):
        raise RendezvousError(
            f"--master {text!r} is not an address of the form host:port (or http://host:port)"
        )
    return host, int(port)


class Link:
    """A connection to another node's launcher: one JSON message a line each way.

    A reader thread puts `("message", link, message)` on `events` for each message but the
    "alive" ones, and `("closed", link, time.time())` when the connection ends; a second
    thread sends `{"alive": true}` every `ALIVE_SECONDS`. `silent_for()` says how long the
    other side has sent nothing.
    """

    def __init__(self, sock: socket.socket, reader: BinaryIO, events: queue.Queue) -> None:
        self.sock, self._reader, self._events = sock, reader, events
        self._lock = threading.Lock()
        self._heard = time.monotonic()
        self._closed = threading.Event()
        sock.settimeout(None)
        with contextlib.suppress(OSError):  # keepalive: a dead peer's socket ends one day
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.peer = endpoint(*sock.getpeername()[:2])
        threading.Thread(target=self._read, name="fleetjax-link-read", daemon=True).start()
        threading.Thread(target=self._keep_alive, name="fleetjax-link-alive", daemon=True).start()

    def _read(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            for line in self._reader:
                self._heard = time.monotonic()
                message = json.loads(line)
                if isinstance(message, dict) and not message.get("alive"):
                    self._events.put(("message", self, message))
        self._events.put(("closed", self, time.time()))

    def _keep_alive(self) -> None:
        while not self._closed.wait(ALIVE_SECONDS):
            self.send({"alive": True})

    def send(self, message: dict[str, Any]) -> None:
        """Send `message`; a connection that is gone already is left to the reader to report."""
        data = json.dumps(message).encode() + b"\n"
        with self._lock, contextlib.suppress(OSError):
            self.sock.sendall(data)

    def silent_for(self) -> float:
        """Seconds since the other side last sent anything."""
        return time.monotonic() - self._heard

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _receive(reader: BinaryIO) -> Any:
    """One line of JSON (None if it is not one, or too long)."""
    with contextlib.suppress(OSError, ValueError):
        line = reader.readline(_MAX_MESSAGE)
        if line.endswith(b"\n"):
            return json.loads(line)
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


class Listener:
    """The serving node's side: takes registrations until closed.

    Each node of job `job_id` that registers becomes `("arrived", link, (rank, endpoints))`
    on `events`; anything else is refused and the listener waits on.
    """

    def __init__(self, master: tuple[str, int], job_id: str, events: queue.Queue) -> None:
        self.job_id, self._events = job_id, events
        family = socket.AF_INET6 if ":" in master[0] else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(master)  # OSError: another node serves, or not this node's address
        self._socket.listen()
        threading.Thread(target=self._accept, name="fleetjax-rendezvous", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._socket.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._admit, args=(conn,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> None:
        conn.settimeout(READ_SECONDS)
        reader = conn.makefile("rb")
        node = _registration(_receive(reader))
        if node is None or node[0] != self.job_id:
            with contextlib.suppress(OSError):  # not a node of this job: refused
                conn.sendall(
                    json.dumps({"error": f"this is the rendezvous of job {self.job_id!r}"}).encode()
                    + b"\n"
                )
            conn.close()
            return
        self._events.put(("arrived", Link(conn, reader, self._events), node[1:]))

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the thread in accept(), which holds it open
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def serve(master: tuple[str, int], job_id: str, events: queue.Queue) -> Listener | None:
    """A `Listener` on `master` if this node owns that address and nobody serves there yet,
    else None (this node registers instead)."""
    try:
        return Listener(master, job_id, events)
    except OSError as e:
        if e.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
            return None
        raise RendezvousError(f"cannot serve the rendezvous at {endpoint(*master)}: {e}") from e


def register(
    master: tuple[str, int],
    registration: tuple[str, int, list[int]],
    host: str | None,
    events: queue.Queue,
    timeout: float,
) -> tuple[Link, list[str]]:
    """Connect to the serving node at `master` (retrying for `timeout` seconds) and register:
    `registration` is (job id, the rank asked for or -1, this node's worker ports), on `host`
    (default: this node's address that reaches `master`). Returns the link and the endpoints
    registered."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = socket.create_connection(master, timeout=_RETRY_SECONDS)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"no rendezvous at {endpoint(*master)} within {timeout:g} s (--join_timeout):"
                    " start fleetjax-run on the node that owns that address too"
                ) from None
            time.sleep(_RETRY_SECONDS)
    job_id, rank, ports = registration
    endpoints = [endpoint(host or conn.getsockname()[0], port) for port in ports]
    message = {"job_id": job_id, "rank": rank, "endpoints": endpoints}
    conn.sendall(json.dumps(message).encode() + b"\n")
    return Link(conn, conn.makefile("rb"), events), endpoints
