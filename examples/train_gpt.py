r"""Train the example GPT with tensor, pipeline and ZeRO parallelism, recompute and AMP, the
Paddle Fleet way, with fleetjax.

The GPT of examples/gpt.py learns to predict the next byte of Python source code: the standard
library's `argparse.py`, which ships with every Python (nothing is downloaded). By default the 8
devices (simulated on the CPU when there is no accelerator) are split dp2 x pp2 x mp2: two
data-parallel replicas, each a two-stage 1F1B pipeline whose stages split every layer over two
tensor-parallel devices.

    python examples/train_gpt.py                               # dp2 x pp2 x mp2, 8 CPU devices
    python examples/train_gpt.py --strategy examples/strategies/gpt_zero_amp.prototxt
    python examples/train_gpt.py --pp 1 --dp 1 --sharding 4 --stage 3   # ZeRO-3 x mp2
    python examples/train_gpt.py --schedule VPP --amp --recompute
    python examples/train_gpt.py --schedule ZBH1                # zero bubble (also ZBVPP, ...)
    python examples/train_gpt.py --dp 1 --sep 2                 # segment parallelism x pp2 x mp2
    python examples/train_gpt.py --dp 1 --pp 1 --sharding 4 --cp 2 --sequence-parallel
    python examples/train_gpt.py --tensorboard runs/gpt         # needs tensorboardX

Flags are set on top of the strategy file (or, without one, of dp2 x pp2 x mp2 with a 1F1B
pipeline of 4 micro-batches of 4 rows). The batches are windows of the text, shuffled by
`fleetjax.data.Loader`, which reads each process's rows and prefetches them onto the devices. A
metrics line (loss, the loop's wait for data, tokens/s) is printed every --log-every steps, and
a final summary of the loss, the throughput and the mesh.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import time
from typing import Any

import grain
import jax
import numpy as np
from gpt import GPTConfig, make_gpt

import fleetjax
from fleetjax import fleet
from fleetjax.data import Loader
from fleetjax.mesh import data_parallel_size
from fleetjax.transforms.pipeline import PipelineLayer
from fleetjax.transforms.pipeline.schedules import SCHEDULE_MODES

SCHEDULES = tuple(dict.fromkeys(SCHEDULE_MODES.values()))  # FThenB, 1F1B, Eager1F1B, VPP, ...
INTERLEAVED = ("VPP", "ZBVPP")  # the schedules that run several model chunks per stage
VIRTUAL_STAGES = 2  # model chunks per pipeline stage under VPP and ZBVPP


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument(
        "--batch-size",
        type=int,
        help="rows (sequences) per data-parallel replica and step, Paddle's per-trainer batch "
        "size; under a pipeline it sets micro_batch_size = batch-size / accumulate_steps "
        "(default: the strategy's micro_batch_size x accumulate_steps under a pipeline, else 16)",
    )
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--hidden", type=int, default=64, help="the residual width")
    parser.add_argument("--heads", type=int, default=8, help="attention heads")
    parser.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="hidden_dropout_prob: dropout of the embeddings and the blocks' outputs, with a "
        "PRNG key per step (and, under a pipeline, per micro-batch and layer)",
    )
    parser.add_argument(
        "--corpus", default="argparse", help="a module whose source file is the training text"
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=int(os.environ.get("JAX_NUM_CPU_DEVICES", 8)),  # fleetjax.launch sets it
        help="simulated CPU devices per process, without an accelerator (default 8)",
    )
    parser.add_argument("--strategy", help="a DistributedStrategy prototxt file (Paddle's format)")
    switches = parser.add_argument_group("strategy switches (set on top of --strategy)")
    for axis, what in DEGREES.items():
        switches.add_argument(f"--{axis}", type=int, metavar="N", help=what)
    switches.add_argument("--stage", type=int, choices=(1, 2, 3), help="the ZeRO stage")
    switches.add_argument("--micro-batches", type=int, metavar="M", help="accumulate_steps")
    switches.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="the pipeline's schedule_mode (VPP and ZBVPP: 2 model chunks per stage)",
    )
    switches.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Megatron's sequence parallelism: the residual stream's sequence split over mp "
        "outside the tensor-parallel matmuls (Paddle GPT's sequence_parallel; needs --mp > 1)",
    )
    switches.add_argument("--amp", choices=("float16", "bfloat16"), nargs="?", const="bfloat16")
    switches.add_argument(
        "--recompute", action="store_true", help="recompute each block in the backward pass"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20, help="a metrics line every N steps")
    parser.add_argument("--tensorboard", metavar="DIR", help="write TensorBoard scalars here")
    return parser.parse_args(argv)


# The hybrid_configs degrees the command line sets (--dp N is dp_degree), and what each splits.
DEGREES = {
    "dp": "data-parallel replicas",
    "sharding": "ZeRO sharding degree (splits the batch too)",
    "pp": "pipeline stages",
    "mp": "tensor-parallel (Megatron) degree",
    "sep": "segment-parallel degree: each sequence split over sep, an all-to-all around "
    "attention gives each device heads / sep heads of the whole sequence (Ulysses)",
    "cp": "context-parallel degree: each sequence split over cp, attention a ring of keys and "
    "values; carved out of --sharding, which it must divide (Paddle's cp_sharding_degree)",
}


def default_strategy() -> fleetjax.DistributedStrategy:
    """dp2 x pp2 x mp2: examples/strategies/gpt_dp2_pp2_mp2.prototxt."""
    return fleetjax.DistributedStrategy(
        pipeline=True,
        pipeline_configs={"accumulate_steps": 4, "micro_batch_size": 4, "schedule_mode": "1F1B"},
        hybrid_configs={"dp_degree": 2, "pp_degree": 2, "mp_degree": 2},
    )


def pipelined(s: fleetjax.DistributedStrategy) -> bool:
    """Whether `s` asks for a pipeline (make_train_step's rule)."""
    return s.pipeline or s.hybrid_configs["pp_degree"] > 1


def strategy_from(args: argparse.Namespace) -> fleetjax.DistributedStrategy:
    """The strategy file (or `default_strategy`) with the command line's switches on top."""
    if args.strategy:
        s = fleetjax.DistributedStrategy.from_prototxt(args.strategy)
    else:
        s = default_strategy()
    degrees = {axis: getattr(args, axis) for axis in DEGREES}
    s.hybrid_configs = {f"{axis}_degree": n for axis, n in degrees.items() if n is not None}
    if args.sharding is not None:
        s.sharding = args.sharding > 1
        s.sharding_configs = {"sharding_degree": args.sharding}
    if args.stage is not None:
        if not s.sharding:
            raise SystemExit(f"--stage {args.stage} needs ZeRO sharding: give --sharding N > 1")
        s.sharding_configs = {"stage": args.stage}
    if args.pp is not None:
        s.pipeline = args.pp > 1
    if args.micro_batches is not None:
        s.pipeline_configs = {"accumulate_steps": args.micro_batches}
    if args.schedule is not None:
        s.pipeline_configs = {"schedule_mode": args.schedule}
    if args.batch_size is not None and pipelined(s):
        m = s.pipeline_configs["accumulate_steps"]
        if args.batch_size % m:
            raise SystemExit(
                f"--batch-size {args.batch_size} does not split into accumulate_steps={m} "
                "micro-batches: give a multiple of it"
            )
        s.pipeline_configs = {"micro_batch_size": args.batch_size // m}
    if args.amp:
        s.amp, s.amp_configs = True, {"dtype": args.amp}
    if args.recompute:
        # Keep each block's input, recompute the rest (Paddle's full-block recompute).
        s.recompute, s.recompute_configs = True, {"policy": "nothing_saveable"}
    if args.sequence_parallel and s.hybrid_configs["mp_degree"] < 2:
        raise SystemExit(
            "--sequence-parallel splits the sequence over the tensor-parallel devices: give "
            f"--mp N > 1 (mp_degree is {s.hybrid_configs['mp_degree']})"
        )
    return s


def corpus(module: str) -> np.ndarray:
    """The bytes of `module`'s source file as int32 tokens (ASCII only: the vocabulary is 128)."""
    path = getattr(importlib.import_module(module), "__file__", None)
    if path is None or not path.endswith(".py"):
        raise SystemExit(f"--corpus {module}: its file {path} is not Python source")
    text = np.frombuffer(pathlib.Path(path).read_bytes(), np.uint8)
    return text[text < 128].astype(np.int32)


def windows(tokens: np.ndarray, length: int) -> grain.MapDataset:
    """Every window of `length + 1` consecutive tokens, as records `{"tokens": window}`."""
    return grain.MapDataset.range(len(tokens) - length).map(
        lambda start: {"tokens": tokens[start : start + length + 1]}
    )


def tensorboard_writer(logdir: str) -> Any:
    """A tensorboardX `SummaryWriter` for `logdir`."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise SystemExit(
            f"--tensorboard {logdir}: TensorBoard logs are written with tensorboardX, which is "
            "not installed: pip install tensorboardX"
        ) from None
    return SummaryWriter(logdir)


class TrainingLog:
    """A training loop's output: a tqdm progress bar, a metrics line every `log_every` steps
    (each metric, and the throughput since the previous line) and, with `logdir`, the same
    scalars for TensorBoard. Shared by the examples' training scripts.

    The first step compiles, so throughput is timed from its end. Metrics are read from the
    device only when a line is printed. With a `loader`, the bar shows its epoch and samples,
    and each line the mean time the loop waited for a batch (`input_wait_ms`).
    """

    def __init__(
        self,
        steps: int,
        *,
        log_every: int,
        per_step: int,
        unit: str,
        logdir: str | None = None,
        loader: Loader | None = None,
    ) -> None:
        """`per_step` `unit`s (e.g. 1024 "tokens") are processed per step."""
        for flag, value in (("--steps", steps), ("--log-every", log_every)):
            if value < 1:
                raise SystemExit(f"{flag} must be a positive number of steps, got {value}")
        from tqdm import tqdm  # here: the notebooks use this module's data without tqdm

        lead = jax.process_index() == 0  # one process reports
        self.writer = tensorboard_writer(logdir) if logdir and lead else None
        self.progress = tqdm(total=steps, desc="training", unit="step", disable=not lead)
        self.log_every, self.per_step, self.unit = log_every, per_step, unit
        self.loader = loader
        self._waited = 0.0  # seconds waited for batches since the last mark
        self.done = 0
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._start = self._mark = time.perf_counter()
        self._marked = 0  # steps done at the last mark

    def step(self, metrics: dict[str, Any]) -> None:
        """Record one step's scalar metrics (device arrays or numbers)."""
        self.done += 1
        self.progress.update()
        if self.loader is not None:
            self._waited += self.loader.last_wait_s
        if self.done == 1:
            self.first = self.last = {k: float(v) for k, v in metrics.items()}
            self._start = self._mark = time.perf_counter()
            self._marked, self._waited = 1, 0.0
        elif self.done % self.log_every == 0 or self.done == self.progress.total:
            self.last = {k: float(v) for k, v in metrics.items()}  # waits for the step
            now, steps = time.perf_counter(), self.done - self._marked
            rate = steps * self.per_step / (now - self._mark)
            scalars = dict(self.last)
            if self.loader is not None:
                scalars["input_wait_ms"] = 1e3 * self._waited / steps
            self._mark, self._marked, self._waited = now, self.done, 0.0
            self.progress.set_postfix(self._postfix())
            self.progress.write(
                f"step {self.done}: "
                + " | ".join(f"{k} {v:.4f}" for k, v in scalars.items())
                + f" | {rate:,.0f} {self.unit}/s"
            )
            if self.writer is not None:
                for name, value in {**scalars, f"{self.unit}_per_second": rate}.items():
                    self.writer.add_scalar(f"train/{name}", value, self.done)

    def _postfix(self) -> dict[str, str]:
        postfix = {"loss": f"{self.last['loss']:.4f}"}
        if self.loader is not None:
            postfix |= {"epoch": f"{self.loader.epoch:.2f}", "samples": f"{self.loader.samples:,}"}
        return postfix

    def close(self) -> float:
        """Close the bar and the log; returns the throughput (`unit`s per second) of every step
        after the first (NaN after a single step)."""
        self.progress.close()
        if self.writer is not None:
            self.writer.close()
        timed = self.done - 1
        elapsed = time.perf_counter() - self._start
        return timed * self.per_step / elapsed if timed > 0 else float("nan")


def run_training(
    step: fleetjax.TrainStep,
    state: fleetjax.TrainState,
    loader: Loader,
    args: argparse.Namespace,
    per_step: int,
    unit: str,
    keep: tuple[str, ...],
) -> tuple[fleetjax.TrainState, TrainingLog, float]:
    """`args.steps` steps on `loader`'s batches, logged (the metrics named `keep`, where the
    step returns them) by a `TrainingLog`; returns the state, the log and the throughput."""
    log = TrainingLog(
        args.steps,
        log_every=args.log_every,
        per_step=per_step,
        unit=unit,
        logdir=args.tensorboard,
        loader=loader,
    )
    for _ in range(args.steps):
        state, metrics = step(state, next(loader))
        log.step({k: metrics[k] for k in keep if k in metrics})
    loader.close()
    return state, log, log.close()


def main(args: argparse.Namespace) -> dict[str, Any]:
    strategy = strategy_from(args)
    fleet.init(is_collective=True, strategy=strategy)
    mesh = fleet.mesh
    config = GPTConfig(
        vocab_size=128,
        max_position_embeddings=args.seq_len,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_hidden_layers=args.layers,
        intermediate_size=4 * args.hidden,
        hidden_dropout_prob=args.dropout,
        sequence_parallel=args.sequence_parallel,
    )
    model, params = make_gpt(config, seed=args.seed)
    specs = model.partition_specs()
    if pipelined(strategy):
        chunks = VIRTUAL_STAGES if strategy.pipeline_configs["schedule_mode"] in INTERLEAVED else 1
        # Each block is marked for recompute (model.loss_fn marks its own); the mark does
        # nothing without the recompute switch.
        block = fleetjax.recompute(model.stage)
        loss_fn = PipelineLayer(model.embed, block, model.head_loss, chunks)
        params, specs = model.pipeline_params(params), model.pipeline_params(specs)
        per_replica = (
            strategy.pipeline_configs["micro_batch_size"]
            * strategy.pipeline_configs["accumulate_steps"]
        )
    else:
        loss_fn = model.loss_fn
        per_replica = args.batch_size or 16
    optimizer = fleet.distributed_optimizer(
        fleetjax.optimizers.adamw(args.learning_rate, weight_decay=0.01)
    )
    step = fleetjax.make_train_step(loss_fn, optimizer, param_specs=specs, has_rng=args.dropout > 0)
    state = step.init(params)

    rows = per_replica * data_parallel_size(mesh)
    tokens_per_step = rows * args.seq_len
    size = sum(x.size for x in jax.tree.leaves(params))
    print(
        f"GPT: {size / 1e6:.2f}M parameters ({args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads); {rows} x {args.seq_len} tokens per step"
    )
    print(fleet.applied_strategy())
    loader = Loader(windows(corpus(args.corpus), args.seq_len), step, rows, seed=args.seed)
    state, log, throughput = run_training(
        step, state, loader, args, tokens_per_step, "tokens", ("loss", "loss_scale")
    )

    summary = {
        "first_loss": log.first["loss"],
        "final_loss": log.last["loss"],
        "tokens_per_second": throughput,
        "devices": mesh.devices.size,
        "mesh": dict(mesh.shape),
    }
    platform = mesh.devices.flat[0].platform
    print(
        f"\nloss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} | "
        f"{throughput:,.0f} tokens/s (steps 2-{args.steps}: the first compiles) | "
        f"{summary['devices']} {platform} devices, mesh {summary['mesh']}"
    )
    return summary


if __name__ == "__main__":
    arguments = parse_args()
    jax.config.update("jax_num_cpu_devices", arguments.cpu_devices)  # before any backend starts
    main(arguments)
