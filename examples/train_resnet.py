r"""Seed 003's ResNet50 practice scaled to a CPU: a small ResNet on scikit-learn's handwritten
digits with AMP, fused all-reduce, sync batch norm and LARS (or DGC), the Paddle Fleet way.

The ResNet of examples/resnet.py classifies 8x8 digit images (shipped with scikit-learn),
data-parallel over 8 devices (simulated on the CPU when there is no accelerator). The default
strategy is the seed's ResNet50 one without its NCCL and executor knobs (no JAX meaning):
float16 AMP with its loss-scaling settings, `fuse_all_reduce_ops` with `fuse_grad_size_in_MB`
16 (an XLA:GPU combiner threshold; XLA:CPU combines every all-reduce anyway), `sync_batch_norm`,
and LARS on Momentum: examples/strategies/resnet_seed003.prototxt.

    python examples/train_resnet.py                              # the seed's practice, 8 devices
    python examples/train_resnet.py --strategy examples/strategies/resnet_seed003.prototxt
    python examples/train_resnet.py --dgc                        # DGC instead of LARS
    python examples/train_resnet.py --no-sync-bn --no-amp        # per-replica BN, float32
    python examples/train_resnet.py --tensorboard runs/resnet     # needs tensorboardX

Switches are set on top of the strategy file. A metrics line (loss, batch accuracy, images/s)
is printed every --log-every steps, and a final summary with the test accuracy.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from resnet import ResNetFunctions, make_resnet
from train_digits import load_data
from train_gpt import run_training

import fleetjax
from fleetjax import fleet
from fleetjax.data import Loader
from fleetjax.mesh import data_parallel_size


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="images per data-parallel replica and step (Paddle's per-trainer batch size)",
    )
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=2.0,
        help="the Momentum's learning rate, cosine-decayed to 0 over --steps",
    )
    parser.add_argument("--depth", type=int, default=8, help="ResNet depth, 6 n + 2")
    parser.add_argument("--width", type=int, default=16, help="channels of the first stage")
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=int(os.environ.get("JAX_NUM_CPU_DEVICES", 8)),  # fleetjax.launch sets it
        help="simulated CPU devices per process, without an accelerator (default 8)",
    )
    parser.add_argument("--strategy", help="a DistributedStrategy prototxt file (Paddle's format)")
    switches = parser.add_argument_group("strategy switches (set on top of --strategy)")
    on_off = argparse.BooleanOptionalAction
    switches.add_argument("--amp", action=on_off, help="AMP with the strategy's amp_configs")
    switches.add_argument("--sync-bn", action=on_off, help="sync_batch_norm")
    switches.add_argument("--lars", action=on_off, help="LARS on the Momentum")
    switches.add_argument("--dgc", action="store_true", help="DGC on the Momentum instead of LARS")
    switches.add_argument(
        "--fuse-grad-size-in-MB", type=int, metavar="MB", help="gradient all-reduce buckets"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50, help="a metrics line every N steps")
    parser.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard scalars here")
    return parser.parse_args(argv)


def default_strategy() -> fleetjax.DistributedStrategy:
    """Seed 003's ResNet50 strategy (examples/strategies/resnet_seed003.prototxt)."""
    return fleetjax.DistributedStrategy(
        fuse_all_reduce_ops=True,
        fuse_grad_size_in_MB=16,
        amp=True,
        amp_configs={
            "init_loss_scaling": 128,
            "decr_every_n_nan_or_inf": 2,
            "incr_every_n_steps": 1000,
            "incr_ratio": 2.0,
            "use_dynamic_loss_scaling": True,
            "decr_ratio": 0.5,
            "custom_white_list": [],
            "custom_black_list": [],
        },
        sync_batch_norm=True,
        lars=True,
        # Paddle's usual exclusion of batch-norm parameters and biases from LARS's decay.
        lars_configs={"exclude_from_weight_decay": ["bn", "bias"]},
    )


def strategy_from(args: argparse.Namespace) -> fleetjax.DistributedStrategy:
    """The strategy file (or `default_strategy`) with the command line's switches on top."""
    if args.strategy:
        s = fleetjax.DistributedStrategy.from_prototxt(args.strategy)
    else:
        s = default_strategy()
    if args.amp is not None:
        s.amp = args.amp
    if args.sync_bn is not None:
        s.sync_batch_norm = args.sync_bn
    if args.lars is not None:
        s.lars = args.lars
    if args.dgc:
        s.lars, s.dgc = False, True
    if args.fuse_grad_size_in_MB is not None:
        s.fuse_all_reduce_ops, s.fuse_grad_size_in_MB = True, args.fuse_grad_size_in_MB
    return s


def load_images(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The digits (train and test) as [N, 8, 8, 1] images in [0, 1] and int32 labels."""
    return tuple(
        {"image": split["image"].reshape(-1, 8, 8, 1), "label": split["label"]}
        for split in load_data(seed)
    )


def process_rows(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """This process's rows of a global batch: the step joins all processes' rows in order."""
    rows = len(next(iter(batch.values()))) // jax.process_count()
    start = jax.process_index() * rows
    return {k: v[start : start + rows] for k, v in batch.items()}


def accuracy(resnet: ResNetFunctions, params: Any, stats: Any, batch: dict[str, Any]) -> jax.Array:
    """The fraction of `batch`'s images classified right, with the running statistics."""
    predicted = jnp.argmax(resnet.logits(params, stats, batch["image"]), -1)
    return jnp.mean(predicted == batch["label"])


def main(args: argparse.Namespace) -> dict[str, Any]:
    strategy = strategy_from(args)
    fleet.init(is_collective=True, strategy=strategy)
    mesh = fleet.mesh
    replicas = data_parallel_size(mesh)
    resnet, params = make_resnet(
        args.depth,
        10,
        width=args.width,
        sync_batch_norm=strategy.sync_batch_norm,
        replicas=replicas,
        seed=args.seed,
    )
    # Cosine decay (Paddle's CosineAnnealingDecay), as the ResNet practice with LARS uses.
    schedule = optax.cosine_decay_schedule(args.learning_rate, args.steps)
    optimizer = fleet.distributed_optimizer(fleetjax.optimizers.momentum(schedule, 0.9))
    # The BatchNorms' running statistics are the step's model state (local ones split over the
    # data axes, one row per replica).
    step = fleetjax.make_train_step(
        resnet.loss_fn,
        optimizer,
        has_aux=True,
        has_state=True,
        state_specs=resnet.stats_specs(mesh=mesh),
    )
    state = step.init(params, model_state=resnet.initial_stats())

    size = sum(x.size for x in jax.tree.leaves(params))
    rows = args.batch_size * replicas
    print(f"ResNet-{args.depth}: {size / 1e3:.0f}K parameters; {rows} images per step")
    print(fleet.applied_strategy())
    train, test = load_images(args.seed)
    loader = Loader(train, step, rows, seed=args.seed)
    keep = ("loss", "accuracy", "loss_scale")
    state, log, throughput = run_training(step, state, loader, args, rows, "images", keep)

    params = state.params
    if step.plan.replica_params:  # LocalSGD: every replica has its own; evaluate replica 0's
        params = jax.tree.map(lambda x: x[0], params)
    # Evaluation splits the test images over the replicas like a training batch: under local
    # statistics each replica normalizes its rows with its own running statistics.
    evaluated = len(test["label"]) // replicas * replicas
    test = step.shard_batch(process_rows({k: v[:evaluated] for k, v in test.items()}))
    with jax.set_mesh(mesh):  # the layers constrain activations against the ambient mesh
        test_accuracy = float(
            jax.jit(accuracy, static_argnums=0)(resnet, params, state.model_state, test)
        )

    summary = {
        "first_loss": log.first["loss"],
        "final_loss": log.last["loss"],
        "test_accuracy": test_accuracy,
        "images_per_second": throughput,
        "devices": mesh.devices.size,
        "mesh": dict(mesh.shape),
    }
    platform = mesh.devices.flat[0].platform
    print(
        f"\nloss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} | test accuracy "
        f"{test_accuracy:.2%} of {evaluated} | {throughput:,.0f} images/s over "
        f"{args.steps - 1} steps | {summary['devices']} {platform} devices, mesh {summary['mesh']}"
    )
    return summary


if __name__ == "__main__":
    arguments = parse_args()
    jax.config.update("jax_num_cpu_devices", arguments.cpu_devices)  # before any backend starts
    main(arguments)
