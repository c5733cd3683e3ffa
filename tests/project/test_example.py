"""The README's main job, shortened: examples/train_digits.py on 8 simulated CPU devices, in
this environment as the README's two commands leave it (the test extra brings jax's CUDA plugin)
and with no device variables set."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import fleetjax

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "train_digits.py"


def output(*args: str) -> tuple[str, str]:
    """(what the example printed, its progress bar output)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {"XLA_FLAGS": ""}
    out = subprocess.run(
        [sys.executable, str(EXAMPLE), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout, out.stderr


def run(*args: str) -> tuple[str, str]:
    """(the final summary line, the progress bar output)."""
    printed, progress = output(*args)
    return printed.strip().splitlines()[-1], progress


def test_trains_and_prints_a_summary():
    summary, progress = run("--steps", "150")
    assert "training: 100%" in progress
    # Nothing but the progress bar: no ERROR from jax's CUDA plugin on a machine without GPUs.
    assert not re.search(r"ERROR|Traceback|Error\b", progress), progress
    # 150 steps of 256 of the 1437 training images: 5 batches an epoch.
    assert "epoch=30.0, input_wait=" in progress and "samples=38,400" in progress
    assert "8 cpu devices, mesh {'dp': 8, 'pp': 1, 'sharding': 1, 'mp': 1}" in summary
    accuracy = float(summary.split("test accuracy ")[1].split("%")[0])
    assert accuracy > 90, summary
    assert summary.startswith("150 steps | final loss ")  # as many as the bar's 150/150
    assert "samples/s (steps 2-150: the first compiles)" in summary


def test_strategy_from_a_prototxt_file(tmp_path):
    s = fleetjax.DistributedStrategy()
    s.hybrid_configs = {"dp_degree": 4, "order": ["dp", "pp", "sharding", "mp"]}
    s.save_to_prototxt(tmp_path / "s.prototxt")
    summary, _ = run(
        "--steps", "5", "--cpu-devices", "4", "--strategy", str(tmp_path / "s.prototxt")
    )
    assert "4 cpu devices, mesh {'dp': 4" in summary


def accuracy(summary: str) -> float:
    return float(summary.split("test accuracy ")[1].split("%")[0])


@pytest.mark.slow
def test_dgc_reaches_dense_momentum_accuracy():
    """Issue 6: DGC at 99.9% sparsity within 1 point of dense momentum, same steps."""
    dense, _ = run("--optimizer", "momentum", "--steps", "600")
    sparse, _ = run("--optimizer", "momentum", "--dgc", "--steps", "600")
    assert abs(accuracy(sparse) - accuracy(dense)) <= 1.0, (dense, sparse)


@pytest.mark.slow  # each switch trains in its own test file; this is the script's flags
def test_every_switch_trains():
    flags = ["--amp", "--recompute", "--gradient-merge", "2", "--fp16-allreduce"]
    summary, _ = run("--steps", "100", *flags)
    assert accuracy(summary) > 85, summary


def test_prints_the_strategy_in_effect_and_writes_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboardX")
    from test_examples import event_scalars

    printed, _ = output("--steps", "40", "--amp", "--tensorboard", str(tmp_path))
    strategy = fleetjax.DistributedStrategy(amp=True, amp_configs={"dtype": "bfloat16"})
    applied = fleetjax.applied_strategy(strategy, fleetjax.build_mesh(dp=8), flags_in_effect=())
    assert str(applied) + "\n" in printed
    scalars = event_scalars(tmp_path)
    assert set(scalars) == {"train/loss", "train/accuracy"}
    assert [step for step, _ in scalars["train/loss"]] == [20, 40]
    final_loss = float(printed.split("final loss ")[1].split(" ")[0])
    assert scalars["train/loss"][-1][1] == pytest.approx(final_loss, abs=1e-4)
