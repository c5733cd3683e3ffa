r"""examples/train_ctr.py's CTR training as a Paddle parameter-server script.

A Paddle parameter-server script runs on every process of the job; Paddle's environment
(`TRAINING_ROLE`, `PADDLE_PSERVERS_IP_PORT_LIST`, `PADDLE_TRAINERS_NUM`, `PADDLE_TRAINER_ID`,
`POD_IP`, `PADDLE_PORT`) says whether the process is a server or a trainer. This is such a
script with fleetjax's imports and a JAX model. In fleetjax the sparse tables live sharded over
the trainers' devices and a step is one SPMD program over the trainers, so the servers' calls
return at once and the servers end; the trainers train.

    python -m fleetjax.launch --server_num 1 --trainer_num 2 --cpu_devices_per_proc 4 \
        examples/train_ctr_ps.py --steps 100

or by hand, one process per role (here one server and one trainer):

    TRAINING_ROLE=PSERVER PADDLE_PSERVERS_IP_PORT_LIST=127.0.0.1:6001 PADDLE_TRAINERS_NUM=1 \
        POD_IP=127.0.0.1 PADDLE_PORT=6001 python examples/train_ctr_ps.py
    TRAINING_ROLE=TRAINER PADDLE_PSERVERS_IP_PORT_LIST=127.0.0.1:6001 PADDLE_TRAINERS_NUM=1 \
        PADDLE_TRAINER_ID=0 POD_IP=127.0.0.1 PADDLE_PORT=6002 python examples/train_ctr_ps.py

The options are train_ctr.py's (`--geo K` for Geo-SGD, `--rule` for the tables' rule).
"""

from __future__ import annotations

import jax
import numpy as np
import train_ctr
from ctr import DeepFM, PowerLawClicks, loss_fn, process_rows
from flax import nnx
from jax.experimental import multihost_utils

import fleetjax
from fleetjax import fleet


def main(args) -> dict[str, float] | None:
    strategy = train_ctr.strategy_from(args)  # a_sync, a_sync_configs, sparse_table_configs
    fleet.init(is_collective=False, strategy=strategy)
    if fleet.is_server():
        fleet.init_server()
        fleet.run_server()
        return None

    fleet.init_worker()
    data = PowerLawClicks(args.slots, args.ids_per_slot, alpha=args.alpha, seed=args.seed)
    net = DeepFM(data.num_ids, args.slots, data.dense, args.embedding_dim, rngs=nnx.Rngs(0))
    model = fleet.distributed_model(net).module  # the nnx Module, trained in place
    fleet.distributed_optimizer(fleetjax.optimizers.adam(args.lr))
    batches = data.batches(args.batch_size, args.seed)
    losses = []
    for i in range(args.steps):
        losses.append(float(fleet.minimize(loss_fn, process_rows(next(batches)))))
        if (i + 1) % 50 == 0 and fleet.is_first_worker():
            print(f"step {i + 1}: loss {losses[-1]:.4f}", flush=True)
    fleet.stop_worker()

    held_out = data.batch(8192, np.random.default_rng([args.seed, 2**31]))
    params = multihost_utils.process_allgather(nnx.state(model), tiled=True)
    auc = train_ctr.evaluate(nnx.graphdef(model), params, held_out)
    result = {"first": losses[0], "last": losses[-1], "auc": auc}
    if fleet.is_first_worker():
        print(
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f} | auc {auc:.4f} | "
            f"trainer {fleet.worker_index()} of {fleet.worker_num()}"
        )
    return result


if __name__ == "__main__":
    arguments = train_ctr.parse_args()
    jax.config.update("jax_num_cpu_devices", arguments.cpu_devices)  # before any backend starts
    main(arguments)
