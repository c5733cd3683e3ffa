r"""Data-parallel training on 8 devices, the Paddle Fleet way, with fleetjax.

An MLP learns scikit-learn's handwritten digits (8x8 images, shipped with scikit-learn). With no
accelerator, JAX simulates 8 CPU devices; the global batch is split over them and XLA
all-reduces the gradients.

    python examples/train_digits.py                       # 8 simulated CPU devices
    python examples/train_digits.py --strategy s.prototxt # a Paddle strategy file
    python examples/train_digits.py --amp --recompute     # strategy switches as flags
    python examples/train_digits.py --optimizer momentum --dgc
    python examples/train_digits.py --checkpoint-dir ckpt # resumes where a killed run stopped
    python examples/train_digits.py --tensorboard runs/digits  # loss and accuracy scalars
    python -m fleetjax.launch --nproc_per_node 2 --cpu_devices_per_proc 4 \
        examples/train_digits.py                          # 2 processes x 4 devices, same losses

The batches come from `fleetjax.data.Loader`: shuffled each epoch, each process reading only its
own rows of every global batch, the next ones prefetched onto the devices while the step runs,
and its position saved with each checkpoint, so a resumed run sees the same batches.
It prints the strategy in effect (`fleet.applied_strategy()`: what is applied, the XLA flags,
what has no effect and why) before it trains.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm
from train_gpt import tensorboard_writer

import fleetjax
from fleetjax import fleet
from fleetjax.checkpoint import CheckpointManager
from fleetjax.data import Loader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=256, help="hidden layer width")
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=int(os.environ.get("JAX_NUM_CPU_DEVICES", 8)),  # fleetjax.launch sets it
        help="simulated CPU devices per process, without an accelerator (default 8)",
    )
    parser.add_argument("--strategy", help="a DistributedStrategy prototxt file (Paddle's format)")
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="Paddle's optimizer to start from (lars and dgc rebuild a momentum, lamb an adam)",
    )
    switches = parser.add_argument_group("strategy switches (set on top of --strategy)")
    switches.add_argument("--amp", choices=("float16", "bfloat16"), nargs="?", const="bfloat16")
    switches.add_argument("--recompute", action="store_true", help="recompute the hidden layers")
    switches.add_argument("--gradient-merge", type=int, metavar="K", help="merge K steps' grads")
    switches.add_argument("--fp16-allreduce", action="store_true")
    for name in ("lars", "lamb", "dgc"):
        switches.add_argument(f"--{name}", action="store_true")
    switches.add_argument("--localsgd", type=int, metavar="K", help="average every K steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=0, help="print the loss every N steps")
    parser.add_argument(
        "--checkpoint-dir", help="save checkpoints here, and resume from the latest one"
    )
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument(
        "--prefetch", type=int, default=2, help="batches placed on the devices ahead of the step"
    )
    parser.add_argument(
        "--tensorboard", metavar="DIR", help="write TensorBoard scalars here (tensorboardX)"
    )
    return parser.parse_args(argv)


OPTIMIZERS = {
    "adamw": lambda lr: fleetjax.optimizers.adamw(lr, weight_decay=1e-4),
    "adam": fleetjax.optimizers.adam,
    "momentum": lambda lr: fleetjax.optimizers.momentum(lr * 25, 0.9),
    "sgd": lambda lr: fleetjax.optimizers.sgd(lr * 50),
}


def strategy_from(args: argparse.Namespace) -> fleetjax.DistributedStrategy:
    """The strategy file (or Paddle's defaults) with the command line's switches on top."""
    s = fleetjax.DistributedStrategy()
    if args.strategy:
        s.load_from_prototxt(args.strategy)
    if args.amp:
        s.amp, s.amp_configs = True, {"dtype": args.amp}
    if args.recompute:
        s.recompute, s.recompute_configs = True, {"checkpoints": ["hidden"]}
    if args.gradient_merge:
        s.gradient_merge, s.gradient_merge_configs = True, {"k_steps": args.gradient_merge}
    if args.localsgd:
        s.localsgd, s.localsgd_configs = True, {"k_steps": args.localsgd}
    s.fp16_allreduce |= args.fp16_allreduce
    s.lars |= args.lars
    s.lamb |= args.lamb
    s.dgc |= args.dgc
    return s


def init_params(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (n_in, n_out)) * jnp.sqrt(2.0 / n_in),
            "b": jnp.zeros(n_out),
        }
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def hidden_layer(layer: dict[str, jax.Array], h: jax.Array) -> jax.Array:
    pre = fleetjax.checkpoint_name(h @ layer["w"] + layer["b"], "hidden")
    return jax.nn.relu(pre)


def logits_fn(params: list[dict[str, jax.Array]], images: jax.Array) -> jax.Array:
    h = images
    for layer in params[:-1]:
        # Recompute marks each layer; without the recompute switch the mark does nothing.
        h = fleetjax.recompute(hidden_layer)(layer, h)
    return h @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params: list[dict[str, jax.Array]], batch: dict[str, jax.Array]):
    logits = logits_fn(params, batch["image"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
    return loss, {"accuracy": accuracy}


def load_data(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(
        images, digits.target.astype(np.int32), test_size=0.2, random_state=seed
    )
    return {"image": x_train, "label": y_train}, {"image": x_test, "label": y_test}


def main(args: argparse.Namespace) -> dict[str, float]:
    fleet.init(is_collective=True, strategy=strategy_from(args))
    train, test = load_data(args.seed)

    optimizer = fleet.distributed_optimizer(OPTIMIZERS[args.optimizer](args.learning_rate))
    print(fleet.applied_strategy())
    step = fleetjax.make_train_step(loss_fn, optimizer, has_aux=True)
    state = step.init(init_params(jax.random.key(args.seed), [64, args.hidden, args.hidden, 10]))

    loader = Loader(train, step, args.batch_size, seed=args.seed, prefetch=args.prefetch)
    manager = None
    if args.checkpoint_dir:
        manager = CheckpointManager(args.checkpoint_dir, save_interval_steps=args.save_every)
        if (resumed := manager.resume(state)) is not None:  # the newest intact checkpoint
            step_done, state, extra = resumed
            loader.set_state(extra["data"])  # the data position: the next unseen batch
            print(f"resumed from {manager.directory} at step {step_done}")
    done = int(state.step)
    lead = jax.process_index() == 0  # one process reports
    writer = tensorboard_writer(args.tensorboard) if args.tensorboard and lead else None
    start = time.perf_counter()
    progress = tqdm(range(done, args.steps), desc="training", unit="step", disable=not lead)
    for i in progress:
        state, metrics = step(state, next(loader))
        if i == done:  # the first step compiles: time the others
            jax.block_until_ready(metrics)
            start = time.perf_counter()
        if (i + 1) % 20 == 0 or i + 1 == args.steps:
            progress.set_postfix(
                epoch=f"{loader.epoch:.1f}",
                samples=f"{loader.samples:,}",
                input_wait=f"{1e3 * loader.last_wait_s:.1f}ms",
                loss=f"{float(metrics['loss']):.4f}",
            )
            if writer is not None:
                for name in ("loss", "accuracy"):
                    writer.add_scalar(f"train/{name}", float(metrics[name]), i + 1)
        if args.log_every and (i + 1) % args.log_every == 0:
            progress.write(f"step {i + 1}: loss {float(metrics['loss']):.6f}")
        if manager is not None:
            manager.save(i + 1, state, {"data": loader.get_state()}, force=i + 1 == args.steps)
    progress.close()
    loader.close()
    if writer is not None:
        writer.close()
    if manager is not None:
        manager.close()
    if done >= args.steps:
        print(f"already trained {done} steps (--steps {args.steps}); nothing to do")
        return {}
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - start

    params = multihost_utils.process_allgather(state.params, tiled=True)
    if step.plan.replica_params:  # LocalSGD: every replica has its own; evaluate replica 0's
        params = jax.tree.map(lambda x: x[0], params)
    test_accuracy = float(
        jnp.mean(jnp.argmax(logits_fn(params, test["image"]), -1) == test["label"])
    )
    timed = args.steps - done - 1
    summary = {
        "final_loss": float(metrics["loss"]),
        "test_accuracy": test_accuracy,
        "samples_per_second": timed * args.batch_size / elapsed if timed else float("nan"),
        "devices": len(step.mesh.devices.flat),
    }
    platform = step.mesh.devices.flat[0].platform
    print(
        f"\n{args.steps - done} steps | final loss {summary['final_loss']:.4f} | "
        f"test accuracy {test_accuracy:.2%} | {summary['samples_per_second']:,.0f} samples/s "
        f"(steps {done + 2}-{args.steps}: the first compiles) | "
        f"{summary['devices']} {platform} devices, mesh {dict(step.mesh.shape)}"
    )
    return summary


if __name__ == "__main__":
    arguments = parse_args()
    jax.config.update("jax_num_cpu_devices", arguments.cpu_devices)  # before any backend starts
    main(arguments)
