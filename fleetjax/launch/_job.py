"""A job's attempts on this node, its restarts, and how the nodes' launchers agree on them.

One node alone runs an attempt (fleetjax/launch/_supervise.py), stops it at its first failure and
restarts it while `--max_restart` allows. With several nodes, the serving node (the hub, see
fleetjax/launch/_rendezvous.py) decides for all, over the links to the others:

    hub  -> node  {"start": {"rank", "nodes", "attempt"}}   run this node's workers
    node -> hub   {"failed": Failure}                       this node's first failure
    node -> hub   {"done": true}                            this node's workers all succeeded
    hub  -> node  {"stop": Failure}                         the job's first failure: stop
    node -> hub   {"stopped": true}                         this node's workers are gone
    hub  -> node  {"exit": code}                            the job is over
    either        {"alive": true} every second; silence for `--peer_timeout` s is a lost node

The hub names the earliest failure it hears of within `SETTLE_SECONDS` of the first (of its
workers', a node's report, a lost link; a lost node before any other, as what fails because
of it may be seen first), so every node names the same worker and exits with the same code. On
a restart the hub meets the nodes again: with `--nnodes min:max`, the ones still there (at least
`min`) and any that come within `--elastic_timeout`, numbered anew.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import queue
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from fleetjax.launch._rendezvous import Link, RendezvousError
from fleetjax.launch._supervise import (
    GRACE_SECONDS,
    HANG_EXIT_CODE,
    Attempt,
    Failure,
    Worker,
    say,
    tail,
)

# After a first failure, how long to gather others (a peer's, another node's) before naming
# the earliest: a worker killed may be seen after the one that failed because of it.
SETTLE_SECONDS = 0.5
_POLL_SECONDS = 0.1

# (every node's worker endpoints, this node's rank) -> this node's workers
Planner = Callable[[list[list[str]], int], list[Worker]]


@dataclasses.dataclass(frozen=True)
class Options:
    """How the job runs (fleetjax-run's options).

    Attributes:
      command: what each worker runs.
      log_dir: where the workers' logs go.
      heartbeat_timeout: seconds without progress before a worker is taken as hung (None:
        never).
      peer_timeout: seconds of silence before another node is taken as lost.
      max_restart: how many times the job is restarted after a failure.
      join_timeout: seconds the nodes have to meet.
      elastic_timeout: seconds to wait for more nodes once `nnodes[0]` are there.
      nnodes: the least and the most nodes the job runs on.
      fixed_ranks: whether a node's rank is the one it asks for (`--ips`).
      ips: the nodes' addresses with `--ips` (named when one does not come).
    """

    command: Sequence[str]
    log_dir: pathlib.Path
    heartbeat_timeout: float | None = None
    peer_timeout: float = 4.0
    max_restart: int = 0
    join_timeout: float = 300.0
    elastic_timeout: float = 30.0
    nnodes: tuple[int, int] = (1, 1)
    fixed_ranks: bool = False
    ips: tuple[str, ...] = ()


@dataclasses.dataclass
class Member:
    """A node of the job as the hub knows it: its link (None: the hub itself), its worker
    endpoints and the rank it asked for (-1: any)."""

    link: Link | None
    endpoints: list[str]
    asked: int = -1


def _number(requested: list[int], nnodes: int) -> list[int]:
    """Node ranks: the ones asked for, then the free ones in arrival order (the hub first)."""
    asked = [r for r in requested if r >= 0]
    if any(r >= nnodes for r in asked) or len(set(asked)) != len(asked):
        raise RendezvousError(
            f"the nodes ask for ranks {sorted(asked)}, which are not distinct ranks "
            f"0..{nnodes - 1} of --nnodes {nnodes}"
        )
    free = iter(sorted(set(range(nnodes)) - set(asked)))
    return [r if r >= 0 else next(free) for r in requested]


def node_name(nodes: Sequence[Sequence[str]], rank: int) -> str:
    """'node 1 (10.0.0.2, workers 2..3)'."""
    first = sum(len(n) for n in nodes[:rank])
    host = nodes[rank][0].rpartition(":")[0]
    return f"node {rank} ({host}, workers {first}..{first + len(nodes[rank]) - 1})"


def _remote(failure: Failure) -> dict[str, Any]:
    """`failure` as sent to other nodes: its log is on this one."""
    return dataclasses.asdict(dataclasses.replace(failure, log=""))


class Job:
    """The job on this node: `run_alone`, `run_hub` or `run_node`, each returning the exit
    code. `events` gets the workers' exits and the links' messages (see `Attempt`, `Link`)."""

    def __init__(self, options: Options, plan: Planner, run_dir: pathlib.Path) -> None:
        self.options, self._plan, self._run_dir = options, plan, run_dir
        self.events: queue.Queue = queue.Queue()
        self.number = 0  # of the attempt
        self.attempt: Attempt | None = None  # the one running, for a stop from outside
        self._waiting: list[Member] = []  # nodes that came while the job ran
        self._links: list[Link] = []  # to the other nodes (the hub's) or to the hub
        self._serving = True  # whether this node is the hub
        self._name = ""  # this node's name in a job of several nodes

    # -- this node's attempt -----------------------------------------------------------------
    def _next(self) -> tuple | None:
        try:
            return self.events.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            return None

    def _start(self, nodes: list[list[str]], rank: int) -> Attempt:
        options, workers = self.options, self._plan(nodes, rank)
        self._name = node_name(nodes, rank) if len(nodes) > 1 else ""
        trainers = [w.rank for w in workers if w.role == "worker"]
        servers = len(workers) - len(trainers)
        world = workers[0].env["PADDLE_TRAINERS_NUM"]
        started = f"workers {trainers[0]}..{trainers[-1]} of {world}" if trainers else "no workers"
        say(
            f"starting {started}{f' and {servers} parameter server(s)' if servers else ''}; "
            f"logs in {options.log_dir}/workerlog.N{', serverlog.N' if servers else ''}",
            logging.INFO,
        )
        self.attempt = Attempt(
            workers,
            options.command,
            options.log_dir,
            self._run_dir,
            self.events,
            number=self.number,
            heartbeat_timeout=options.heartbeat_timeout,
        )
        return self.attempt

    def _local(self, event: tuple, attempt: Attempt, where: str) -> Failure | None:
        """The failure a worker's exit shows, named `where` (this node, with several)."""
        if event[0] != "exit" or event[1] is not attempt:
            return None
        failure = attempt.exited(*event[2:])
        return self._here(failure, where)

    @staticmethod
    def _here(failure: Failure | None, where: str) -> Failure | None:
        if failure is None or not where:
            return failure
        return dataclasses.replace(failure, who=f"{failure.who} on {where}")

    def _finish(self, failure: Failure) -> None:
        """Name `failure` (with the end of its log, unless the console showed it already) and
        stop this node's workers: the stop line is the last line before they are gone."""
        assert self.attempt is not None
        echoed = self.attempt.end_echo()
        if failure.log and failure.log != echoed:
            say(f"the end of {failure.log}:\n{tail(failure.log)}")
        say(f"{failure.line}; stopping all workers")
        self.attempt.stop()

    def _restarts(self, failure: Failure) -> bool:
        """Whether the job restarts after `failure` (then counted)."""
        if self.number >= self.options.max_restart:
            return False
        self.number += 1
        say(f"restarting the job: restart {self.number} of {self.options.max_restart} "
            "(--max_restart)", logging.WARNING)  # fmt: skip
        return True

    def stop_from_outside(self, signum: int) -> None:
        """Stop this node's workers after the launcher got signal `signum`, and the job: the
        hub tells every node to stop and exit, another node tells the hub."""
        name = signal.Signals(signum).name
        who = f"the launcher of {self._name}" if self._name else "the launcher"
        failure = Failure(who, f"got {name}", 128 + signum, time.time())
        for link in self._links:
            if self._serving:
                link.send({"stop": _remote(failure)})
                link.send({"exit": failure.code})
            else:
                link.send({"failed": _remote(failure)})
        if self.attempt is not None:
            self.attempt.end_echo()
            self.attempt.stop()
        for link in self._links:
            link.close()

    # -- one node ------------------------------------------------------------------------------
    def run_alone(self, nodes: list[list[str]]) -> int:
        """Run the job on this node only."""
        return self.run_hub([Member(None, nodes[0])])

    # -- the hub -------------------------------------------------------------------------------
    def run_hub(self, members: list[Member]) -> int:
        """Run the job as the serving node; `members` is this node (and the nodes met)."""
        while True:
            nodes = [m.endpoints for m in members]
            self._links = [m.link for m in members if m.link is not None]
            own = _own_rank(members)
            for rank, member in enumerate(members):
                if member.link is not None:
                    start = {"rank": rank, "nodes": nodes, "attempt": self.number, "hub": own}
                    member.link.send({"start": start})
            attempt = self._start(nodes, own)
            failure, members = self._watch_hub(attempt, members)
            if failure is None:
                attempt.stop()
                self._tell(members, {"exit": 0})
                return 0
            self._tell(members, {"stop": _remote(failure)})
            self._finish(failure)
            members = self._stopped(members)
            try:
                if not self._restarts(failure):
                    self._tell(members, {"exit": failure.code})
                    return failure.code
                members = self.gather(members, first=False)
            except RendezvousError as e:
                say(f"cannot restart: {e}")
                self._tell(members, {"exit": failure.code})
                return failure.code

    @staticmethod
    def _tell(members: list[Member], message: dict[str, Any]) -> None:
        for member in members:
            if member.link is not None:
                member.link.send(message)

    def _watch_hub(
        self, attempt: Attempt, members: list[Member]
    ) -> tuple[Failure | None, list[Member]]:
        """Until the job's first failure (the earliest heard of within `SETTLE_SECONDS`) or its
        success; the members still there."""
        nodes = [m.endpoints for m in members]
        where = node_name(nodes, _own_rank(members)) if len(members) > 1 else ""
        ranks = {m.link: rank for rank, m in enumerate(members) if m.link is not None}
        done: set[Link] = set()
        lost: set[Link] = set()
        failures: list[Failure] = []
        first = None
        while True:
            event = self._next()
            if event is not None:
                failures += self._hub_event(event, attempt, where, ranks, done, lost, nodes)
            if failure := self._here(attempt.poll(), where):
                failures.append(failure)
            for link, rank in ranks.items():
                silent = link.silent_for()
                if link not in lost and silent > self.options.peer_timeout:
                    lost.add(link)
                    what = f"stopped answering for {silent:.0f} s (a lost node, link or launcher)"
                    failures.append(
                        Failure(node_name(nodes, rank), what, HANG_EXIT_CODE, time.time() - silent)
                    )
            if failures:
                first = first or time.monotonic()
                if time.monotonic() - first >= SETTLE_SECONDS:
                    # A lost node explains the rest: its workers die with it and their peers
                    # fail after, though a busy hub may see a peer's exit before the loss.
                    gone = {node_name(nodes, ranks[link]) for link in lost}
                    causes = [f for f in failures if f.who in gone] or failures
                    return min(causes, key=lambda f: f.time), _without(members, lost)
            elif attempt.succeeded and done == set(ranks):
                return None, members

    def _hub_event(
        self,
        event: tuple,
        attempt: Attempt,
        where: str,
        ranks: dict[Link, int],
        done: set[Link],
        lost: set[Link],
        nodes: list[list[str]],
    ) -> list[Failure]:
        kind, source, data = event[0], event[1], event[2] if len(event) > 2 else None
        if kind == "exit":
            failure = self._local(event, attempt, where)
            return [failure] if failure else []
        if kind == "arrived":
            self._waiting.append(Member(source, data[1], data[0]))  # for the next restart
            return []
        if source not in ranks:
            return []
        if kind == "closed" and source not in lost:
            lost.add(source)
            what = "ended: its launcher's connection closed (killed, or stopped)"
            return [Failure(node_name(nodes, ranks[source]), what, HANG_EXIT_CODE, data)]
        if kind == "message" and isinstance(data, dict):
            if isinstance(data.get("failed"), dict):
                return [Failure(**data["failed"])]
            if data.get("done"):
                done.add(source)
        return []

    def _stopped(self, members: list[Member]) -> list[Member]:
        """Wait until each node says its workers are gone; those that do not are dropped."""
        waiting = {m.link for m in members if m.link is not None}
        deadline = time.monotonic() + 2 * GRACE_SECONDS + self.options.peer_timeout
        while waiting and time.monotonic() < deadline:
            event = self._next()
            if event is None:
                continue
            kind, source, data = event[0], event[1], event[2] if len(event) > 2 else None
            if kind == "arrived":
                self._waiting.append(Member(source, data[1], data[0]))
            elif source in waiting and (kind == "closed" or (data or {}).get("stopped")):
                waiting.discard(source)
                if kind == "closed":
                    members = _without(members, {source})
        return _without(members, waiting)

    def gather(self, members: list[Member], *, first: bool) -> list[Member]:
        """The nodes of the next attempt, numbered: `members` and the nodes that come, until
        `nnodes[1]` are there, or `nnodes[0]` and `--elastic_timeout` passed.

        Raises:
          RendezvousError: if fewer than `nnodes[0]` came within `--join_timeout`, or the
            nodes' ranks or process counts do not fit together (then every node is told).
        """
        least, most = self.options.nnodes
        members, self._waiting = [*members, *self._waiting], []
        deadline = time.monotonic() + self.options.join_timeout
        enough = None
        while len(members) < most:
            if len(members) >= least:
                enough = enough or time.monotonic()
                if time.monotonic() - enough >= self.options.elastic_timeout:
                    break
            elif time.monotonic() > deadline:
                came = {m.endpoints[0].rpartition(":")[0] for m in members}
                missing = [ip for ip in self.options.ips if ip not in came]
                raise RendezvousError(
                    f"{len(members)} of --nnodes {_spec(least, most)} nodes came to the "
                    f"rendezvous within {self.options.join_timeout:g} s (--join_timeout)"
                    + (f"; missing: {', '.join(missing)}" if missing else "")
                )
            members = self._arrivals(members)
        return self._numbered(members, first)

    def _arrivals(self, members: list[Member]) -> list[Member]:
        """`members` after the next event: one more that came, or one fewer that left."""
        silent = {
            m.link
            for m in members
            if m.link is not None and m.link.silent_for() > self.options.peer_timeout
        }
        members = _without(members, silent)
        event = self._next()
        if event is None:
            return members
        kind, source, data = event[0], event[1], event[2] if len(event) > 2 else None
        if kind == "arrived":
            return [*members, Member(source, data[1], data[0])]
        if kind == "closed":
            return _without(members, {source})
        return members

    def _numbered(self, members: list[Member], first: bool) -> list[Member]:
        counts = [len(m.endpoints) for m in members]
        try:
            if len(set(counts)) > 1:
                listed = ", ".join(
                    f"{len(m.endpoints)} at {m.endpoints[0]}"
                    for m in sorted(members, key=lambda m: (m.asked, m.endpoints))
                )
                raise RendezvousError(
                    f"the nodes run different numbers of processes (--nproc_per_node): "
                    f"{listed}; give every node the same"
                )
            if first or self.options.fixed_ranks:
                ranks = _number([m.asked for m in members], len(members))
                members = [members[ranks.index(r)] for r in range(len(members))]
            everyone = [e for m in members for e in m.endpoints]
            if len(set(everyone)) != len(everyone):
                raise RendezvousError(f"the nodes' worker endpoints repeat: {everyone}")
        except RendezvousError as e:
            self._tell(members, {"error": str(e)})
            raise
        return members

    # -- a node that is not the hub ----------------------------------------------------------
    def run_node(self, hub: Link, master: str) -> int:
        """Run the job as a node that registered with the hub over `hub`."""
        failure = None
        nodes: list[list[str]] = []
        self._links, self._serving = [hub], False
        while True:
            message = self._await_hub(hub, master, started=failure is not None or bool(nodes))
            if message is None:  # the hub is gone between attempts
                return failure.code if failure else HANG_EXIT_CODE
            if "exit" in message:
                return int(message["exit"])
            start = message["start"]
            nodes, rank, self.number = start["nodes"], start["rank"], start["attempt"]
            attempt = self._start(nodes, rank)
            hub_name = node_name(nodes, start["hub"])
            failure, hub_lost = self._watch_node(attempt, hub, node_name(nodes, rank), hub_name)
            if failure is None:
                attempt.stop()
                return 0
            self._finish(failure)
            if hub_lost:
                return failure.code
            hub.send({"stopped": True})

    def _await_hub(self, hub: Link, master: str, *, started: bool) -> dict[str, Any] | None:
        """The hub's next "start" or "exit" (None if it is gone after the job started)."""
        deadline = time.monotonic() + self.options.join_timeout + self.options.elastic_timeout
        while time.monotonic() < deadline and hub.silent_for() <= self.options.peer_timeout:
            event = self._next()
            if event is None or event[1] is not hub:
                continue
            if event[0] == "closed":
                break
            message = event[2]
            if isinstance(message.get("error"), str):
                raise RendezvousError(f"the rendezvous at {master} refused: {message['error']}")
            if "start" in message or "exit" in message:
                return message
        if started:
            return None
        raise RendezvousError(f"the rendezvous at {master} ended before the job started")

    def _watch_node(
        self, attempt: Attempt, hub: Link, where: str, hub_name: str
    ) -> tuple[Failure | None, bool]:
        """Until the hub says the job failed (its verdict) or ended well (None); whether the
        hub was lost (then this node's own failure, or the hub's loss, is the verdict)."""
        mine: list[Failure] = []  # this node's failures, all told to the hub
        told, done = 0.0, False
        while True:
            event = self._next()
            own = min(mine, key=lambda f: f.time) if mine else None
            if event is not None and event[1] is hub:
                if event[0] == "closed":
                    lost = "ended: its launcher's connection closed (killed, or stopped)"
                    return own or Failure(hub_name, lost, HANG_EXIT_CODE, event[2]), True
                message = event[2]
                if isinstance(message.get("stop"), dict):
                    verdict = Failure(**message["stop"])  # with the log, if it is this node's
                    same = [f for f in mine if dataclasses.replace(f, log="") == verdict]
                    return (same or [verdict])[0], False
                if "exit" in message:
                    return None, False
            found = [self._local(event, attempt, where) if event else None]
            for failure in [*found, self._here(attempt.poll(), where)]:
                if failure is not None:  # the hub names the earliest of all
                    hub.send({"failed": _remote(failure)})
                    mine.append(failure)
                    told = told or time.monotonic()
            silent = hub.silent_for()
            if silent > self.options.peer_timeout or (
                mine and time.monotonic() - told > self.options.peer_timeout
            ):
                what = f"stopped answering for {silent:.0f} s (a lost node, link or launcher)"
                lost = Failure(hub_name, what, HANG_EXIT_CODE, time.time() - silent)
                return min(mine, key=lambda f: f.time) if mine else lost, True
            if not mine and not done and attempt.succeeded:
                hub.send({"done": True})
                done = True


def _own_rank(members: list[Member]) -> int:
    """The hub's rank: it need not be 0 (a node may ask for a rank)."""
    return next(rank for rank, m in enumerate(members) if m.link is None)


def _without(members: list[Member], links: set) -> list[Member]:
    return [m for m in members if m.link is None or m.link not in links]


def _spec(least: int, most: int) -> str:
    return str(most) if least == most else f"{least}:{most}"
