r"""A CTR model with sparse tables on 8 devices: Paddle's parameter-server training as one SPMD
step, in the functional form.

DeepFM (examples/ctr.py) learns clicks on power-law distributed ids. Its two embedding tables
are split by rows over every device and trained by Paddle's sparse rules on the rows each batch
touches (`sparse_table_configs`); the dense layers train data parallel with Adam.

    python examples/train_ctr.py                         # synchronous (a_sync=False)
    python examples/train_ctr.py --geo 10                # Geo-SGD, exchanging every 10 steps
    python examples/train_ctr.py --rule SparseAdamSGDRule --ids-per-slot 100000
    python -m fleetjax.launch --nproc_per_node 2 --cpu_devices_per_proc 4 examples/train_ctr.py

examples/train_ctr_ps.py is the same training as a Paddle parameter-server script.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
from ctr import DeepFM, PowerLawClicks, loss_fn, process_rows
from flax import nnx
from jax.experimental import multihost_utils
from sklearn.metrics import roc_auc_score

import fleetjax

RULES = ("SparseAdaGradSGDRule", "StdAdaGradSGDRule", "SparseNaiveSGDRule", "SparseAdamSGDRule")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=512, help="global batch size")
    parser.add_argument("--slots", type=int, default=26, help="sparse features per example")
    parser.add_argument("--ids-per-slot", type=int, default=4096)
    parser.add_argument("--alpha", type=float, default=1.1, help="the power law's exponent")
    parser.add_argument("--embedding-dim", type=int, default=8)
    parser.add_argument("--rule", choices=RULES, default="SparseAdaGradSGDRule")
    parser.add_argument("--table-lr", type=float, default=0.05, help="the tables' rule's")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's, for the dense layers")
    parser.add_argument("--geo", type=int, metavar="K", help="Geo-SGD every K steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=int(os.environ.get("JAX_NUM_CPU_DEVICES", 8)),  # fleetjax.launch sets it
        help="simulated CPU devices per process, without an accelerator (default 8)",
    )
    return parser.parse_args(argv)


def strategy_from(args: argparse.Namespace) -> fleetjax.DistributedStrategy:
    """Paddle's parameter-server strategy: a_sync (and Geo's k_steps), the tables' rule."""
    s = fleetjax.DistributedStrategy()
    s.a_sync = args.geo is not None
    if args.geo:
        s.a_sync_configs = {"k_steps": args.geo}
    section = {"SparseNaiveSGDRule": "naive", "SparseAdamSGDRule": "adam"}.get(args.rule, "adagrad")
    rule = {"name": args.rule, section: {"learning_rate": args.table_lr}}
    accessor = {"embed_sgd_param": rule, "embedx_sgd_param": rule}
    s.sparse_table_configs = {name: {"accessor": accessor} for name in ("first_order", "embedding")}
    return s


def evaluate(graphdef: nnx.GraphDef, params: nnx.State, batch: dict[str, np.ndarray]) -> float:
    """The AUC of the clicks of `batch` (every process computes it on the whole batch)."""
    model = nnx.merge(graphdef, params)
    scores = np.asarray(jax.jit(lambda m, b: m(b["ids"], b["dense"]))(model, batch))
    return float(roc_auc_score(batch["label"], scores))


def main(args: argparse.Namespace) -> dict[str, float]:
    fleetjax.fleet.init(is_collective=True, strategy=strategy_from(args))
    data = PowerLawClicks(args.slots, args.ids_per_slot, alpha=args.alpha, seed=args.seed)
    model = DeepFM(data.num_ids, args.slots, data.dense, args.embedding_dim, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def loss(params: nnx.State, batch: dict) -> jax.Array:
        return loss_fn(nnx.merge(graphdef, params), batch)

    optimizer = fleetjax.fleet.distributed_optimizer(fleetjax.optimizers.adam(args.lr))
    step = fleetjax.make_train_step(loss, optimizer)
    state = step.init(params)
    batches = data.batches(args.batch_size, args.seed)
    for i in range(args.steps):
        state, metrics = step(state, process_rows(next(batches)))
        if i == 0:  # the first step compiles: time the others
            first, start = float(metrics["loss"]), time.perf_counter()
        if (i + 1) % 50 == 0 and jax.process_index() == 0:
            print(f"step {i + 1}: loss {float(metrics['loss']):.4f}", flush=True)
    last = float(metrics["loss"])
    rate = (args.steps - 1) * args.batch_size / (time.perf_counter() - start)
    params = multihost_utils.process_allgather(state.params, tiled=True)
    if step.plan.replica_params:  # Geo-SGD: every replica has its own; evaluate replica 0's
        params = jax.tree.map(lambda x: x[0], params)
    held_out = data.batch(8192, np.random.default_rng([args.seed, 2**31]))
    result = {"first": first, "last": last, "auc": evaluate(graphdef, params, held_out)}
    if jax.process_index() == 0:
        print(f"loss {first:.4f} -> {last:.4f} | auc {result['auc']:.4f} | {rate:,.0f} examples/s")
    return result


if __name__ == "__main__":
    arguments = parse_args()
    jax.config.update("jax_num_cpu_devices", arguments.cpu_devices)  # before any backend starts
    main(arguments)
