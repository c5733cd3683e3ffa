"""The GPT and ResNet training scripts (examples/train_gpt.py, train_resnet.py): they train on 8
simulated CPU devices and print their metrics and summary; their strategy files are what the
scripts build; and sync batch norm really normalizes with statistics over all replicas."""

import collections
import importlib.util
import math
import operator
import os
import pathlib
import re
import struct
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest

import fleetjax

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "examples"))
import train_gpt
import train_resnet
from resnet import make_resnet

EXAMPLES = pathlib.Path(__file__).parents[2] / "examples"
STRATEGIES = EXAMPLES / "strategies"

SUMMARY = re.compile(r"^loss (?P<first>[\d.]+) -> (?P<last>[\d.]+) \| (?P<rest>.*)$")
METRICS = re.compile(r"^step (?P<step>\d+): (?P<metrics>.*) \| (?P<rate>[\d,]+) (?P<unit>\w+)/s$")


def run(script: str, *args: str) -> tuple[dict, list[dict], str]:
    """Run an example; returns (its summary, its metrics lines, its progress-bar output)."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    summary = SUMMARY.match(lines[-1])
    assert summary, out.stdout
    metrics = []
    for line in lines:
        if found := METRICS.match(line):
            pairs = (item.split(" ") for item in found["metrics"].split(" | "))
            values = {name: float(value) for name, value in pairs}
            rate = float(found["rate"].replace(",", ""))
            metrics.append({"step": int(found["step"]), **values, found["unit"]: rate})
    first, last = float(summary["first"]), float(summary["last"])
    return {"first": first, "last": last, "rest": summary["rest"]}, metrics, out.stderr


@pytest.mark.slow  # 20 s; test_hybrid trains dp2 x pp2 x mp2 by default
def test_gpt_trains_dp2_pp2_mp2_from_its_strategy_file():
    """Issue 5: the example GPT trains with dp2 x pp2 x mp2 on 8 devices (the file holds the
    script's default strategy: see test_strategy_files_are_what_the_scripts_build)."""
    strategy = STRATEGIES / "gpt_dp2_pp2_mp2.prototxt"
    args = ("--strategy", str(strategy), "--steps", "30", "--log-every", "10")
    summary, metrics, progress = run("train_gpt.py", *args)
    assert "training: 100%" in progress
    assert summary["rest"].endswith(
        "8 cpu devices, mesh {'dp': 2, 'pp': 2, 'sharding': 1, 'mp': 2}"
    )
    assert "tokens/s (steps 2-30: the first compiles)" in summary["rest"]
    # Untrained, the model predicts uniformly over the 128 byte values.
    assert summary["first"] == pytest.approx(math.log(128), abs=0.05)
    assert summary["last"] < summary["first"] - 1.5
    assert [m["step"] for m in metrics] == [10, 20, 30]
    assert metrics[-1]["loss"] == summary["last"]
    assert all(m["tokens"] > 0 and m["input_wait_ms"] >= 0 for m in metrics)
    assert "samples=960" in progress  # 30 steps of 32 windows


@pytest.mark.slow
def test_gpt_trains_with_dropout_under_the_pipeline():
    summary, _, _ = run("train_gpt.py", "--steps", "20", "--dropout", "0.1", "--log-every", "10")
    assert summary["rest"].endswith("mesh {'dp': 2, 'pp': 2, 'sharding': 1, 'mp': 2}")
    assert summary["last"] < summary["first"] - 0.5


@pytest.mark.slow
def test_gpt_with_zero_amp_and_recompute():
    strategy = STRATEGIES / "gpt_zero_amp.prototxt"
    summary, metrics, _ = run("train_gpt.py", "--strategy", str(strategy), "--steps", "20")
    assert "mesh {'dp': 1, 'pp': 2, 'sharding': 2, 'mp': 2}" in summary["rest"]
    assert summary["last"] < summary["first"] - 1.0
    assert metrics[-1]["loss_scale"] == 32768.0  # float16 AMP: Paddle's initial loss scale


@pytest.fixture(scope="module")
def resnet_run(tmp_path_factory):
    """One run of train_resnet.py with its default strategy, writing TensorBoard logs when
    tensorboardX is installed: (summary, metrics lines, progress output, log directory)."""
    logdir = tmp_path_factory.mktemp("tensorboard")
    args = ["--steps", "60", "--log-every", "20"]
    if importlib.util.find_spec("tensorboardX") is not None:
        args += ["--tensorboard", str(logdir)]
    return (*run("train_resnet.py", *args), logdir)


@pytest.mark.slow
def test_resnet_trains_with_the_seed_003_practice(resnet_run):
    summary, metrics, progress, _ = resnet_run
    assert "training: 100%" in progress
    assert summary["rest"].endswith(
        "8 cpu devices, mesh {'dp': 8, 'pp': 1, 'sharding': 1, 'mp': 1}"
    )
    accuracy = float(re.search(r"test accuracy ([\d.]+)% of 360", summary["rest"])[1])
    assert accuracy > 90, summary
    assert summary["last"] < summary["first"] / 10
    assert [m["step"] for m in metrics] == [20, 40, 60]
    assert metrics[-1]["loss_scale"] == 128.0  # the seed's init_loss_scaling
    assert all(0 <= m["accuracy"] <= 1 and m["images"] > 0 for m in metrics)


@pytest.mark.slow
def test_resnet_with_dgc_and_each_replicas_own_statistics():
    """DGC runs the update per replica; local running statistics stay each replica's."""
    summary, _, _ = run("train_resnet.py", "--dgc", "--no-sync-bn", "--steps", "60")
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", summary["rest"])[1])
    assert accuracy > 90, summary


def event_scalars(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from the TensorBoard event files in `logdir` (TFRecord
    files of `Event` protos: length, its CRC, the record, its CRC)."""
    from tensorboardX.proto import event_pb2

    found = collections.defaultdict(list)
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found[value.tag].append((event.step, value.simple_value))
    return dict(found)


@pytest.mark.slow
def test_tensorboard_scalars_are_the_printed_metrics(resnet_run):
    pytest.importorskip("tensorboardX")
    _, metrics, _, logdir = resnet_run
    scalars = event_scalars(logdir)
    assert set(scalars) == {
        "train/loss",
        "train/accuracy",
        "train/loss_scale",
        "train/input_wait_ms",
        "train/images_per_second",
    }
    for name in ("loss", "accuracy", "input_wait_ms"):
        got = [(step, round(value, 4)) for step, value in scalars[f"train/{name}"]]
        assert got == [(m["step"], m[name]) for m in metrics]
    rates = [value for _, value in scalars["train/images_per_second"]]
    np.testing.assert_allclose(rates, [m["images"] for m in metrics], rtol=1e-3, atol=1)


def test_tensorboard_without_tensorboardx_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX fails
    with pytest.raises(SystemExit, match=r"not installed: pip install tensorboardX"):
        train_gpt.tensorboard_writer(str(tmp_path))


@pytest.mark.parametrize(
    ("file", "script", "flags"),
    [
        ("gpt_dp2_pp2_mp2.prototxt", train_gpt, []),
        (
            "gpt_zero_amp.prototxt",
            train_gpt,
            ["--dp", "1", "--sharding", "2", "--stage", "2", "--amp", "float16", "--recompute"],
        ),
        ("resnet_seed003.prototxt", train_resnet, []),
    ],
)
def test_strategy_files_are_what_the_scripts_build(file, script, flags):
    built = script.strategy_from(script.parse_args(flags))
    assert fleetjax.DistributedStrategy.from_prototxt(STRATEGIES / file) == built
    # Loading the file and adding the same flags changes nothing.
    on_top = script.strategy_from(script.parse_args([*flags, "--strategy", str(STRATEGIES / file)]))
    assert on_top == built


def test_flags_go_on_top_of_the_strategy_file():
    args = ["--strategy", str(STRATEGIES / "gpt_dp2_pp2_mp2.prototxt"), "--pp", "1", "--dp", "4"]
    s = train_gpt.strategy_from(train_gpt.parse_args([*args, "--schedule", "FThenB"]))
    assert not s.pipeline and s.pipeline_configs["schedule_mode"] == "FThenB"
    assert s.hybrid_configs["dp_degree"] == 4 and s.hybrid_configs["mp_degree"] == 2
    s = train_gpt.strategy_from(
        train_gpt.parse_args(["--batch-size", "24", "--micro-batches", "3"])
    )
    assert s.pipeline_configs["micro_batch_size"] == 8
    s = train_resnet.strategy_from(train_resnet.parse_args(["--dgc", "--no-amp"]))
    assert (s.dgc, s.lars, s.amp, s.sync_batch_norm) == (True, False, False, True)


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [
        (train_gpt, ["--stage", "2"], r"--stage 2 needs ZeRO sharding: give --sharding N > 1"),
        (
            train_gpt,
            ["--batch-size", "10"],
            r"--batch-size 10 does not split into accumulate_steps=4 micro-batches",
        ),
        (
            train_gpt,
            ["--mp", "1", "--sequence-parallel"],
            r"--sequence-parallel splits the sequence over the tensor-parallel devices: give "
            r"--mp N > 1 \(mp_degree is 1\)",
        ),
    ],
)
def test_bad_flags_say_what_is_wrong(script, flags, message):
    with pytest.raises(SystemExit, match=message):
        script.strategy_from(script.parse_args(flags))


def test_gpt_takes_every_schedule_and_the_sequence_axes():
    assert train_gpt.SCHEDULES == ("FThenB", "1F1B", "Eager1F1B", "VPP", "ZBH1", "ZBVPP")
    for mode in train_gpt.SCHEDULES:
        s = train_gpt.strategy_from(train_gpt.parse_args(["--schedule", mode]))
        assert s.pipeline_configs["schedule_mode"] == mode
    flags = ["--dp", "1", "--pp", "1", "--sharding", "4", "--cp", "2", "--sep", "2", "--mp", "1"]
    s = train_gpt.strategy_from(train_gpt.parse_args(flags))
    degrees = {k: s.hybrid_configs[f"{k}_degree"] for k in ("dp", "pp", "sharding", "cp", "sep")}
    assert degrees == {"dp": 1, "pp": 1, "sharding": 4, "cp": 2, "sep": 2}
    assert train_gpt.parse_args(["--mp", "2", "--sequence-parallel"]).sequence_parallel


ROOT = next(p for p in pathlib.Path(__file__).parents if (p / "pyproject.toml").exists())


def documented_runs(page: str) -> list[tuple[list[str], str]]:
    """(the arguments, the summary line the page shows) of each `examples/train_gpt.py`
    command on docs/`page`: a bash block of commands, then a text block of their summaries."""
    runs = []
    text = (ROOT / "docs" / page).read_text()
    for commands, shown in re.findall(r"```bash\n(.*?)```\n\n```text\n(.*?)```", text, re.S):
        lines = [line.split(" #")[0].split() for line in commands.splitlines()]
        lines = [line for line in lines if line[:2] == ["python", "examples/train_gpt.py"]]
        runs += [
            (line[2:], summary) for line, summary in zip(lines, shown.splitlines(), strict=True)
        ]
    return runs


@pytest.mark.slow  # the GPT under each command: 1 to 2 minutes on 2 cores
@pytest.mark.parametrize(
    ("page", "count"), [("mesh.md", 2), ("long_sequences.md", 3)], ids=["zero-bubble", "sequence"]
)
def test_the_gpt_commands_of_a_page_print_what_it_shows(page, count):
    """docs/mesh.md's zero-bubble schedules and docs/long_sequences.md's sequence axes: each
    command ends on the losses and the mesh its page shows (the default run's losses)."""
    runs = documented_runs(page)
    assert len(runs) == count
    for args, shown in runs:
        summary, _, _ = run("train_gpt.py", *args, "--log-every", "10")
        assert f"loss {summary['first']:.4f} -> {summary['last']:.4f}" == shown.split(" | ")[0]
        assert summary["rest"].endswith(shown.split(" | ")[-1]), (args, summary["rest"])
        assert shown.startswith("loss 4.8492 -> 2.8836 | ")  # the dp 2 x pp 2 x mp 2 run's


def test_the_resnet_refuses_a_depth_that_is_not_6n_plus_2():
    with pytest.raises(ValueError, match=r"depth must be 6 n \+ 2 .* got 10"):
        make_resnet(10)


# -- sync batch norm ----------------------------------------------------------------------------

ROWS = 32


@pytest.fixture(scope="module")
def digits():
    train, _ = train_resnet.load_images(seed=0)
    return {k: v[:ROWS] for k, v in train.items()}


def one_step_batch_stats(sync: bool, batch: dict) -> tuple[float, dict]:
    """The loss and batch statistics of one train step of the ResNet over 8 replicas (with
    momentum 0 the running statistics after a step are the batch's)."""
    strategy = fleetjax.DistributedStrategy(sync_batch_norm=sync)
    resnet, params = make_resnet(8, 10, sync_batch_norm=sync, replicas=8, momentum=0.0)
    step = fleetjax.make_train_step(
        resnet.loss_fn,
        fleetjax.optimizers.momentum(0.1),
        strategy,
        has_aux=True,
        has_state=True,
        state_specs=resnet.stats_specs(),
    )
    state, metrics = step(step.init(params, model_state=resnet.initial_stats()), batch)
    return float(metrics["loss"]), jax.tree.map(np.asarray, state.model_state)


@pytest.fixture(scope="module")
def single_device():
    """`batch -> (loss, batch statistics)` of plain batch norm over `batch`, on one device, with
    the replicated models' parameters (the same seed)."""
    resnet, params = make_resnet(8, 10, momentum=0.0)
    loss_fn = jax.jit(resnet.loss_fn)

    def run(batch: dict) -> tuple[float, dict]:
        loss, _, stats = loss_fn(params, resnet.initial_stats(), batch)
        return float(loss), jax.tree.map(np.asarray, stats)

    return run


@pytest.mark.slow
def test_sync_batch_norm_normalizes_with_the_whole_batchs_statistics(digits, single_device):
    loss, stats = one_step_batch_stats(True, digits)
    expected_loss, expected = single_device(digits)
    assert loss == pytest.approx(expected_loss, rel=1e-5)
    assert stats["stem"]["bn"]["mean"].shape == (1, 16)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), stats, expected
    )


@pytest.mark.slow
def test_local_batch_norm_keeps_each_replicas_own_statistics(digits, single_device):
    loss, stats = one_step_batch_stats(False, digits)
    assert stats["stem"]["bn"]["mean"].shape == (8, 16)
    rows = ROWS // 8
    for r in range(8):
        block = {k: v[r * rows : (r + 1) * rows] for k, v in digits.items()}
        _, expected = single_device(block)
        replica = jax.tree.map(operator.itemgetter(slice(r, r + 1)), stats)
        chex.assert_trees_all_close(replica, expected, rtol=1e-4, atol=1e-5)
    # The replicas' statistics differ from each other and from the whole batch's, and so does
    # the loss.
    whole_loss, whole = single_device(digits)
    means = stats["blocks"][2]["conv2"]["bn"]["mean"]
    assert np.ptp(means, axis=0).max() > 0.1
    assert np.abs(means - whole["blocks"][2]["conv2"]["bn"]["mean"]).max() > 0.1
    assert abs(loss - whole_loss) > 1e-3


def test_running_statistics_follow_paddles_momentum(digits, single_device):
    """After one step from means 0 and variances 1: momentum * initial + (1 - momentum) *
    the batch's, Paddle's update."""
    _, batch = single_device(digits)
    resnet, params = make_resnet(8, 10, momentum=0.9)
    _, _, stats = jax.jit(resnet.loss_fn)(params, resnet.initial_stats(), digits)
    initial = resnet.initial_stats()
    chex.assert_trees_all_close(
        stats,
        jax.tree.map(lambda i, b: 0.9 * i + 0.1 * b, initial, batch),
        rtol=1e-4,
        atol=1e-6,
    )
