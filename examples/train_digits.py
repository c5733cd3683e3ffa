"""Data-parallel training on 8 devices, the Paddle Fleet way, with fleetjax.

An MLP learns scikit-learn's handwritten digits (8x8 images, shipped with scikit-learn). With no
accelerator, JAX simulates 8 CPU devices; the global batch is split over them and XLA
all-reduces the gradients.

    python examples/train_digits.py                       # 8 simulated CPU devices
    python examples/train_digits.py --strategy s.prototxt # a Paddle strategy file
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import fleetjax
from fleetjax import fleet


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=256, help="hidden layer width")
    parser.add_argument(
        "--cpu-devices", type=int, default=8, help="simulated CPU devices (without an accelerator)"
    )
    parser.add_argument("--strategy", help="a DistributedStrategy prototxt file (Paddle's format)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def init_params(key: jax.Array, sizes: list[int]) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (n_in, n_out)) * jnp.sqrt(2.0 / n_in),
            "b": jnp.zeros(n_out),
        }
        for k, n_in, n_out in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def logits_fn(params: list[dict[str, jax.Array]], images: jax.Array) -> jax.Array:
    h = images
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
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


def batches(data: dict[str, np.ndarray], batch_size: int, seed: int):
    """Endless shuffled batches, one epoch after another."""
    rng = np.random.default_rng(seed)
    n = len(data["label"])
    while True:
        order = rng.permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            rows = order[start : start + batch_size]
            yield {k: v[rows] for k, v in data.items()}


def main(args: argparse.Namespace) -> dict[str, float]:
    strategy = (
        fleetjax.DistributedStrategy.from_prototxt(args.strategy)
        if args.strategy
        else fleetjax.DistributedStrategy()
    )
    fleet.init(is_collective=True, strategy=strategy)
    train, test = load_data(args.seed)

    optimizer = fleet.distributed_optimizer(optax.adamw(args.learning_rate, weight_decay=1e-4))
    step = fleetjax.make_train_step(loss_fn, optimizer, has_aux=True)
    state = step.init(init_params(jax.random.key(args.seed), [64, args.hidden, args.hidden, 10]))

    data = batches(train, args.batch_size, args.seed)
    state, metrics = step(state, next(data))  # compiles
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    with tqdm(range(1, args.steps), desc="training", unit="step") as progress:
        for i in progress:
            state, metrics = step(state, next(data))
            if i % 20 == 0 or i == args.steps - 1:
                progress.set_postfix(loss=f"{float(metrics['loss']):.4f}")
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - start

    test_accuracy = float(
        jnp.mean(jnp.argmax(logits_fn(state.params, test["image"]), -1) == test["label"])
    )
    summary = {
        "final_loss": float(metrics["loss"]),
        "test_accuracy": test_accuracy,
        "samples_per_second": (args.steps - 1) * args.batch_size / elapsed,
        "devices": len(step.mesh.devices.flat),
    }
    platform = step.mesh.devices.flat[0].platform
    print(
        f"\nfinal loss {summary['final_loss']:.4f} | test accuracy {test_accuracy:.2%} | "
        f"{summary['samples_per_second']:,.0f} samples/s over {args.steps - 1} steps | "
        f"{summary['devices']} {platform} devices, mesh {dict(step.mesh.shape)}"
    )
    return summary


if __name__ == "__main__":
    arguments = parse_args()
    jax.config.update("jax_num_cpu_devices", arguments.cpu_devices)  # before any backend starts
    main(arguments)
