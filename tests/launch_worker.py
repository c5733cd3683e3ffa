"""A worker for tests/facade/test_launch.py and tests/facade/test_launch_faults.py, started by
`python -m fleetjax.launch`.

    launch_worker.py env ARGS...   print the launcher's variables and ARGS as JSON, exit 0
    launch_worker.py fail          worker 1 exits with code 3 once all have started; the
                                   others wait
    launch_worker.py fail0         worker 0 raises once all have started; the others wait and
                                   print `worker N got SIGTERM` when they get it (and go on)
    launch_worker.py train         join the others with fleet.init(), then synchronise with
                                   them forever (as a training loop does)
    launch_worker.py raise         join the others with fleet.init(); worker 1 raises at once
                                   (after printing `raising at <time.time()>`), the others
                                   compute
    launch_worker.py noisy_raise   worker 1 raises once all have started, and logs 30 lines
                                   after its traceback (at exit, as a runtime's threads may);
                                   the others wait
    launch_worker.py hang          worker 1 prints nothing more and sleeps; the others call
                                   fleetjax.launch.heartbeat() without printing
    launch_worker.py spawn         start a child (in the worker's process group) and a detached
                                   grandchild (a session of its own), print their pids, wait
    launch_worker.py chatty N      worker 0 prints N numbered lines over about 2 s, exit 0
    launch_worker.py steps FAULT   join the others and train with a TrainStep, silently (its
                                   calls are the progress); at step 5 worker 1 (after printing
                                   `fault at <time.time()>`) does FAULT: `exit3` (sys.exit(3)),
                                   `raise_exit0` (raise SystemExit(0)), `os_exit0`
                                   (os._exit(0)), `spin` (a busy Python loop), `sleep`
                                   or `freeze` (SIGSTOP: not even JAX's heartbeats go on);
                                   `none`: no fault, all stop after 10 s, exit 0;
                                   `first_call` (not at step 5): the first step waits in a
                                   host callback for 600 s (on the process JAX runs it on)
    launch_worker.py batches HOW   join the others and train 6 steps with a TrainStep, printing
                                   each loss: `first`, worker 0 passes 4 rows a step and
                                   worker 1 8; `later`, both 8, worker 1 16 from step 3 on
    launch_worker.py jit FAULT     join the others and loop over a plain `jax.jit` all-reduce
                                   (no TrainStep, no output); at iteration 5 worker 1 does
                                   FAULT as `steps` has it

Every worker first prints `pid=<its pid>`, so a test can find (and clean up) each process.
"""

import atexit
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

PREFIXES = ("PADDLE_", "JAX_", "CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus", "FLEETJAX_")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _joined(rank: int) -> None:
    from fleetjax import fleet

    fleet.init(is_collective=True)
    fleet.barrier_worker()
    print(f"ready: worker {fleet.worker_index()} of {fleet.worker_num()}", flush=True)


def _faults(fault: str) -> None:
    print(f"fault at {time.time()}", flush=True)
    if fault == "exit3":
        sys.exit(3)
    if fault == "raise_exit0":
        raise SystemExit(0)
    if fault == "os_exit0":
        os._exit(0)
    if fault == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
    while fault == "spin":
        pass
    time.sleep(600)


def _train_until_fault(rank: int, fault: str) -> None:
    """Train with a TrainStep (no output per step) until worker 1's fault at step 5."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import fleetjax

    _joined(rank)

    def stall() -> None:  # JAX runs it on one process: its step never ends, nor the others'
        print(f"fault at {time.time()}", flush=True)
        time.sleep(600)

    def loss(params, batch):
        if fault == "first_call":  # every process compiles the same program
            jax.debug.callback(stall)
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    step = fleetjax.make_train_step(loss, optax.sgd(0.01))
    state = step.init({"w": jnp.zeros((4, 1))})
    rows = {"x": np.ones((8, 4), np.float32), "y": np.ones((8, 1), np.float32)}
    begin = time.monotonic()
    for i in range(1_000_000):
        if rank == 1 and i == 5 and fault not in ("none", "first_call"):
            _faults(fault)
        # All stop at the same step: every 64 steps, worker 0 says whether 10 s passed.
        if fault == "none" and i % 64 == 0:
            from jax.experimental import multihost_utils

            late = np.int32(rank == 0 and time.monotonic() - begin > 10)
            if multihost_utils.broadcast_one_to_all(late):
                return
        state, metrics = step(state, rows)
        float(metrics["loss"])  # as a loop that logs would: each step waits for the last


def _batches(rank: int, how: str) -> None:
    """Train with batches of each process's own shapes (`how`: see the module docstring)."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    import fleetjax

    _joined(rank)
    step = fleetjax.make_train_step(
        lambda params, batch: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2),
        optax.sgd(0.01),
    )
    state = step.init({"w": jnp.zeros((4, 1))})
    for i in range(6):
        rows = 8 if how == "later" else 4 * (rank + 1)
        rows = 16 if how == "later" and rank == 1 and i >= 2 else rows
        print(f"step {i + 1}: {rows} rows at {time.time()}", flush=True)
        batch = {"x": np.ones((rows, 4), np.float32), "y": np.ones((rows, 1), np.float32)}
        state, metrics = step(state, batch)
        print(f"step {i + 1}: loss {float(metrics['loss'])}", flush=True)


def _jit_until_fault(rank: int, fault: str) -> None:
    """A loop of plain `jax.jit` all-reduces over every process's devices until worker 1's
    fault at iteration 5."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    _joined(rank)
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    x = jax.device_put(jnp.ones(jax.device_count()), NamedSharding(mesh, PartitionSpec("d")))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    for i in range(1_000_000):
        if rank == 1 and i == 5:
            _faults(fault)
        total(x + i).block_until_ready()


def _wait_until_all_started() -> None:
    """Until every worker of this node logged its pid (so that a test can track it)."""
    log_dir = pathlib.Path(os.environ["FLEETJAX_HEARTBEAT_FILE"]).parent  # this worker's log's
    count = int(os.environ["PADDLE_TRAINERS_NUM"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        logs = [log_dir / f"workerlog.{rank}" for rank in range(count)]
        if all(log.exists() and "pid=" in log.read_text() for log in logs):
            return
        time.sleep(0.05)


def main(mode: str, args: list[str]) -> int:
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    print(f"pid={os.getpid()}", flush=True)
    if mode == "env":
        env = {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}
        script = {"argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": __file__}
        print(json.dumps({"rank": rank, "env": env, "args": args, "script": script}), flush=True)
        return 0
    if mode == "fail":
        if rank == 1:
            _wait_until_all_started()
            print("worker 1 fails", flush=True)
            return 3
        time.sleep(600)
        return 0
    if mode == "noisy_raise":
        if rank == 1:
            _wait_until_all_started()
            atexit.register(lambda: print("\n".join(f"after it {i}" for i in range(30))))
            raise RuntimeError("worker 1 fails on purpose")
        time.sleep(600)
        return 0
    if mode == "fail0":
        if rank == 0:
            _wait_until_all_started()
            raise RuntimeError("worker 0 fails on purpose")
        signal.signal(signal.SIGTERM, lambda *_: print(f"worker {rank} got SIGTERM", flush=True))
        time.sleep(600)
        return 0
    if mode == "train":
        from fleetjax import fleet

        _joined(rank)
        while True:
            fleet.barrier_worker()
            time.sleep(0.1)
    if mode == "raise":
        import jax.numpy as jnp

        _joined(rank)
        if rank == 1:
            print(f"raising at {time.time()}", flush=True)
            raise RuntimeError("worker 1 fails on purpose")
        while True:  # computes, as worker 0 of a real job would
            jnp.ones((64, 64)).sum().block_until_ready()
    if mode == "hang":
        from fleetjax import launch

        print(f"worker {rank} works", flush=True)  # after the import's seconds of silence
        while True:
            if rank != 1:
                launch.heartbeat()
            time.sleep(0.2)
    if mode == "spawn":
        child = subprocess.Popen(SLEEPER)
        grandchild = subprocess.Popen(SLEEPER, start_new_session=True)
        print(f"child={child.pid} detached={grandchild.pid}", flush=True)
        time.sleep(600)
        return 0
    if mode == "chatty":
        if rank == 0:
            for i in range(int(args[0])):
                print(f"line {i}", flush=True)
                time.sleep(2 / int(args[0]))
        return 0
    if mode == "gloo":  # Gloo's line for a communicator, in two writes, around the script's
        for text in ("before\n", "[Gl", "oo] Rank 0 is connected to 1 peer ranks\n", "50%\r"):
            print(text, end="", flush=True)
            time.sleep(0.3)
        print("100%\ndone", flush=True)
        return 0
    if mode == "steps":
        _train_until_fault(rank, args[0])
        return 0
    if mode == "jit":
        _jit_until_fault(rank, args[0])
        return 0
    if mode == "batches":
        _batches(rank, args[0])
        return 0
    raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
