"""A worker for tests/test_launch.py, started by `python -m fleetjax.launch`.

    launch_worker.py env ARGS...   print the launcher's variables and ARGS as JSON, exit 0
    launch_worker.py fail          worker 1 exits with code 3; the others wait
    launch_worker.py train         join the others with fleet.init(), then synchronise with
                                   them forever (as a training loop does)

Every worker first prints `pid=<its pid>`, so a test can find (and clean up) each process.
"""

import json
import os
import sys
import time

PREFIXES = ("PADDLE_", "JAX_", "CUDA_VISIBLE_DEVICES", "FLAGS_selected_gpus")


def main(mode: str, args: list[str]) -> int:
    rank = int(os.environ["PADDLE_TRAINER_ID"])
    print(f"pid={os.getpid()}", flush=True)
    if mode == "env":
        env = {k: v for k, v in os.environ.items() if k.startswith(PREFIXES)}
        print(json.dumps({"rank": rank, "env": env, "args": args}), flush=True)
        return 0
    if mode == "fail":
        if rank == 1:
            time.sleep(0.5)
            print("worker 1 fails", flush=True)
            return 3
        time.sleep(600)
        return 0
    if mode == "train":
        from fleetjax import fleet

        fleet.init(is_collective=True)
        fleet.barrier_worker()
        print(f"ready: worker {fleet.worker_index()} of {fleet.worker_num()}", flush=True)
        while True:
            fleet.barrier_worker()
            time.sleep(0.1)
    raise ValueError(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
