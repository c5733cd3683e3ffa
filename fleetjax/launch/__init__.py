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
    Either way the launchers stay linked (fleetjax/launch/_rendezvous.py and _job.py): each
    says it is alive every second, the serving node names the job's first failure for all,
    and Gloo listens on and announces each node's own address (never the host name's).

Faults (the first failure is named, with its code, whatever the others do afterwards):
  * A worker that exits with an error or is killed: the launcher prints the end of its log
    (20 lines, or back to its last traceback, whole; unless the console showed it), then
    `<who> <what>; stopping all workers` as its last line, stops the others (SIGTERM, then
    SIGKILL after 3 s, Paddle's wait) and exits
    with that worker's code (128 + signal number if it was killed). The script runs under
    fleetjax/_worker.py, which records how it ended before Python's exit handlers, so a
    `sys.exit(3)` while the others wait in a collective is named at once (JAX's shutdown
    barrier would hold that worker for 5 minutes); a joined worker that leaves by
    `os._exit(0)` while the others run is a failure too (exit code 1), and so is one that ends
    its script with code 0 after fewer `TrainStep` calls than the others, who then wait for it
    (named 5 s later).
  * Hangs: a worker that neither writes to its log, runs a `TrainStep` (or compiles its first
    call), imports, nor calls `heartbeat()` for `--heartbeat_timeout` seconds (default
    `DEFAULT_HEARTBEAT_TIMEOUT`; 0: never) is taken as hung. Every worker's Python stacks go
    into its log, and the one named is the one the others wait for: one that runs its own code
    rather than waits in JAX, then the one with the fewest steps; exit code 124.
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
    by SIGKILL: a guard process (fleetjax/launch/_guard.py) outlives the launcher for that.
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

from fleetjax import _liveness
from fleetjax.launch._arguments import (
    DEFAULT_ELASTIC_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_PEER_TIMEOUT,
    DEFAULT_START_PORT,
    PADDLE_MAX_RESTART,
    LaunchError,
    parse_args,
)
from fleetjax.launch._collective import (
    Layout,
    Nodes,
    collective_workers,
    layout,
    node_index,
    plan_workers,
    where,
)
from fleetjax.launch._machine import check_port_free, visible_gpus
from fleetjax.launch._run import main
from fleetjax.launch._supervise import Worker

__all__ = [
    "DEFAULT_ELASTIC_TIMEOUT",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_PEER_TIMEOUT",
    "DEFAULT_START_PORT",
    "LaunchError",
    "Layout",
    "Nodes",
    "PADDLE_MAX_RESTART",
    "Worker",
    "check_port_free",
    "collective_workers",
    "heartbeat",
    "layout",
    "main",
    "node_index",
    "parse_args",
    "plan_workers",
    "visible_gpus",
    "where",
]


def heartbeat() -> None:
    """Tell `fleetjax-run --heartbeat_timeout` that this worker makes progress.

    Output to the worker's log counts as progress already, and so does each `TrainStep` call;
    call this in other stretches without output (it touches the log,
    `FLEETJAX_HEARTBEAT_FILE`). Outside `fleetjax-run` it does nothing.
    """
    _liveness.beat()
