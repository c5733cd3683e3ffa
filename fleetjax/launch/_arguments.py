"""`fleetjax-run`'s options (Paddle's `fleetrun`'s names and defaults)."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import logging
from collections.abc import Sequence
from typing import Any, NoReturn

from fleetjax import _worker

DEFAULT_START_PORT = 6070  # Paddle's
# A worker silent this long is hung. Each TrainStep call is progress (its first, compiling,
# too), so this covers what else a healthy worker may do without output: compiling other
# functions, loading data, a checkpoint; 30 minutes is PyTorch's default collective timeout.
DEFAULT_HEARTBEAT_TIMEOUT = 1800.0
# The launchers of a job's nodes talk every second: 4 s of silence is a lost node or link, and
# the job has stopped within 10 s (3 s of it the workers' grace period).
DEFAULT_PEER_TIMEOUT = 4.0
DEFAULT_JOIN_TIMEOUT = float(_worker.JOIN_TIMEOUT_SECONDS)  # JAX's initialization timeout
DEFAULT_ELASTIC_TIMEOUT = 30.0  # Paddle's --elastic_timeout
PADDLE_MAX_RESTART = 3  # Paddle's --max_restart, which Paddle applies with --elastic_level >= 1
# Paddle's --run_mode values that fleetjax-run runs (the options say which one when it is not
# given: a parameter-server option makes it "ps", as in Paddle).
RUN_MODES = ("collective", "ps")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class LaunchError(Exception):
    """The launch cannot go ahead (bad options, busy port); the message says why."""


class _Parser(argparse.ArgumentParser):
    """An option is named in full (no prefixes), and a mistyped one is an error that says which
    was meant."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise LaunchError(message)  # one line, as every other usage error

    def parse_options(self, argv: Sequence[str] | None) -> argparse.Namespace:
        args, unknown = self.parse_known_args(argv)
        if unknown:  # options before the script (after it, they are the script's)
            option = unknown[0].partition("=")[0]
            known = [o for action in self._actions for o in action.option_strings]
            close = difflib.get_close_matches(option, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise LaunchError(f"unknown option {option}{hint}; fleetjax-run --help lists them")
        return args


def _option(container: Any, *names: str, **kwargs: Any) -> None:
    """`container.add_argument` of Paddle's option `names`, each also with dashes
    (`--nproc-per-node`), as torchrun spells them."""
    dashed = [name.replace("_", "-") for name in names if "_" in name]
    container.add_argument(*names, *dashed, **kwargs)


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
    add = functools.partial(_option, parser)
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
    add(
        "--run_mode",
        choices=RUN_MODES,
        help="Paddle's: collective, or ps (parameter server) as --server_num, --servers, "
        "--trainer_num or --workers imply (default: as the options imply)",
    )
    add(
        "--log_level",
        type=str.upper,
        default="INFO",
        choices=LOG_LEVELS,
        help="the launcher's own lines shown: INFO (default, Paddle's) adds its progress to "
        "warnings and errors; worker output is not filtered",
    )
    _add_fault_options(parser)
    parser.add_argument("training_script", nargs="?", help="the script each process runs")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    args = parser.parse_options(argv)
    args.log_level = logging.getLevelName(args.log_level)
    return args


def _add_fault_options(parser: argparse.ArgumentParser) -> None:
    """The options for faults and restarts, and Paddle's parameter-server options."""
    add = functools.partial(_option, parser)
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
    _option(
        elastic,
        "--max_restart",
        type=int,
        help="restart the whole job after a failure up to this many times (default: 0; 3, "
        "Paddle's, with --elastic_level 1 or 2 or --nnodes min:max)",
    )
    _option(
        elastic,
        "--elastic_level",
        type=int,
        default=-1,
        choices=(-1, 0, 1, 2),
        help="-1/0: no restarts (Paddle's default -1); 1 or 2: restart after a failure (3 "
        "times unless --max_restart says otherwise); fewer nodes take --nnodes min:max",
    )
    _option(
        elastic,
        "--elastic_timeout",
        type=_seconds,
        default=DEFAULT_ELASTIC_TIMEOUT,
        metavar="SECONDS",
        help="with --nnodes min:max, once min nodes are there, how long to wait for more "
        f"(default: {DEFAULT_ELASTIC_TIMEOUT:g}, Paddle's)",
    )
    ps = parser.add_argument_group("parameter-server jobs (Paddle's)")
    _option(ps, "--server_num", type=int, help="parameter servers on this node")
    _option(ps, "--servers", help="comma-separated ip:port of every parameter server")
    _option(
        ps,
        "--trainer_num",
        "--worker_num",
        dest="trainer_num",
        type=int,
        help="trainers on this node",
    )
    _option(
        ps,
        "--workers",
        "--trainers",
        dest="workers",
        help="comma-separated ip:port of every trainer",
    )


def split_list(text: str, option: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise LaunchError(f"{option}={text!r} has an empty entry; give a comma-separated list")
    return items
