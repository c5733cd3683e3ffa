"""Running `fleetjax-run`: the job's options, meeting the other nodes and the command's `main`."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import pathlib
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence

from fleetjax import _worker
from fleetjax.launch import _job, _rendezvous
from fleetjax.launch._arguments import PADDLE_MAX_RESTART, LaunchError, parse_args
from fleetjax.launch._collective import Nodes, collective_workers, layout, where
from fleetjax.launch._machine import check_port_free
from fleetjax.launch._parameter_server import is_parameter_server, plan_parameter_server
from fleetjax.launch._supervise import LOG, say


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
    if is_parameter_server(args):
        workers = plan_parameter_server(args, environ)
        options = _options(args, log_dir, Nodes())
        return options, lambda nodes, rank: workers, lambda job: job.run_alone([[]])
    nodes, this = where(args), layout(args, environ)
    options = _options(args, log_dir, nodes)
    if nodes.nnodes[0] < nodes.nnodes[1]:  # fleet.init() explains a strategy that lost nodes
        elastic = {_worker.MAX_NODES: str(nodes.nnodes[1])}
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
        LOG.setLevel(args.log_level)
        if args.training_script is None:
            raise LaunchError("no training script: fleetjax-run [options] train.py [its arguments]")
        options, planner, run_job = _prepare(args, pathlib.Path(args.log_dir), os.environ)
        _checked_paths(args)  # the log directory made last, once all else is right
    except LaunchError as e:
        say(f"error: {e}")
        return 2
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="fleetjax-run-"))
    job = _job.Job(options, planner, run_dir)
    handlers = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run_job(job)
    except (LaunchError, _rendezvous.RendezvousError) as e:  # before any worker started
        say(f"error: {e}")
        return 2
    except _Stop as stop:
        name = signal.Signals(stop.signum).name
        say(
            f"got {name}"
            + ("; stopping all workers" if job.attempt else " before any worker started"),
            logging.WARNING,
        )
        job.stop_from_outside(stop.signum)
        return 128 + stop.signum
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        shutil.rmtree(run_dir, ignore_errors=True)
