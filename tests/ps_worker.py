"""A process of a parameter-server job for tests/facade/test_parameter_server.py, started by
`python -m fleetjax.launch --server_num ... --trainer_num ...` with Paddle's PS variables.

    ps_worker.py roles   print the fleet's role answers as JSON; a server calls
                         init_server() and run_server(), a trainer joins the others,
                         init_worker(), waits for them (barrier_worker) and stop_worker()
    ps_worker.py raise   as `roles`, but trainer 1 raises once joined, and trainer 0 computes

Every process first prints `pid=<its pid>`.
"""

import json
import os
import sys
import time


def main(mode: str) -> int:
    print(f"pid={os.getpid()}", flush=True)
    from fleetjax import fleet

    fleet.init(is_collective=False)
    answers = {
        "is_server": fleet.is_server(),
        "is_worker": fleet.is_worker(),
        "server_num": fleet.server_num(),
        "server_index": fleet.server_index(),
        "worker_num": fleet.worker_num(),
        "worker_index": fleet.worker_index(),
        "server_endpoints": fleet.server_endpoints(),
    }
    print(json.dumps(answers), flush=True)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return 0
    fleet.init_worker()
    fleet.barrier_worker()
    print(f"ready: trainer {fleet.worker_index()} of {fleet.worker_num()}", flush=True)
    if mode == "raise":
        import jax.numpy as jnp

        if fleet.worker_index() == 1:
            print(f"raising at {time.time()}", flush=True)
            raise RuntimeError("trainer 1 fails on purpose")
        while True:  # computes, as trainer 0 of a real job would
            jnp.ones((64, 64)).sum().block_until_ready()
    fleet.stop_worker()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
