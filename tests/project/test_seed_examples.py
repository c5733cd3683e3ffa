"""The seed documents' examples as scripts (examples/seeds/): each runs to the end on simulated
CPU devices, in a directory of its own, and prints what the seed's Paddle example prints."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import fleetjax

SEEDS = pathlib.Path(__file__).parents[2] / "examples" / "seeds"
LOSSES = re.compile(r"^  losses (?P<losses>[\d. ]+)$", re.MULTILINE)


def run(script: str, cwd: pathlib.Path) -> str:
    """The script's output; it must exit 0. Its device count is its own (JAX_NUM_CPU_DEVICES)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, str(SEEDS / script)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr  # warnings included


def losses(output: str) -> list[list[float]]:
    return [[float(x) for x in found["losses"].split()] for found in LOSSES.finditer(output)]


def test_every_script_is_tested():
    scripts = {p.name for p in SEEDS.glob("[0-9]*.py")}
    tested = {name for name, _ in FAST + SLOW}
    assert scripts == tested


def sections(*names: str):
    """Checks that the output has these sections, each training with losses, in order."""

    def check(output: str, cwd: pathlib.Path) -> None:
        assert re.findall(r"^(\w[\w, ]*)$", output, re.MULTILINE)[: len(names)] == list(names)
        trained = losses(output)
        assert trained and all(len(got) >= 3 and all(0 < x < 5 for x in got) for got in trained)

    return check


def check_004(output: str, cwd: pathlib.Path) -> None:
    assert "current lr is 0.2\ncurrent lr is 0.3\ncurrent lr is 0.4\n" in output
    assert "current lr is 0.6\nget_lr\n0.01\n" in output  # Paddle's prints
    assert "  state_dict before the first step: {}" in output
    assert "  worker_num 1" in output and "  server_endpoints []" in output
    # Alone, Paddle's parameter-server calls warn and return (its is_non_distributed_check).
    for call in ("init_worker", "init_server", "run_server", "stop_worker"):
        assert f"{call}() function doesn't work when use non_distributed fleet." in output
    assert "  exported model, 3 rows: [(3, 1), ()]" in output
    assert re.search(r"^loss: [\d.]+$", output, re.MULTILINE)  # the dygraph loop, as written
    assert "  saved step 2" in output
    assert (cwd / "dirname" / "inference.jaxexport").exists()


def check_003(output: str, cwd: pathlib.Path) -> None:
    lines = re.findall(r"^worker_index: 0, step(\d+) cost = ([\d.]+), speed: [\d.]+$", output, re.M)
    assert [int(step) for step, _ in lines] == list(range(10))
    costs = [float(cost) for _, cost in lines]
    assert costs[-1] < costs[0]
    written = fleetjax.DistributedStrategy.from_prototxt(cwd / "dist_strategy.prototxt")
    assert written.amp and written.amp_configs["init_loss_scaling"] == 128
    assert written.fuse_all_reduce_ops and written.nccl_comm_num == 2


def check_001_memory(output: str, cwd: pathlib.Path) -> None:
    sections("recompute", "pipeline", "gradient_merge", "sharding")(output, cwd)
    assert "  mesh {'dp': 2, 'pp': 1, 'sharding': 8, 'mp': 1}" in output


def check_001_programs(output: str, cwd: pathlib.Path) -> None:
    assert re.search(r"^  10 steps in one call, losses( [\d.]+){10}$", output, re.MULTILINE)
    loaded = fleetjax.DistributedStrategy.from_prototxt(cwd / "dist_strategy.prototxt")
    assert loaded.dgc and loaded.recompute_configs["checkpoints"] == ["x"]
    assert "pure data parallelism fits" in output


def pipelined(*applied: str):
    """Checks that the output reports these settings applied, and that the loss went down."""

    def check(output: str, cwd: pathlib.Path) -> None:
        for setting in applied:
            assert re.search(rf"^  {setting}", output, re.MULTILINE), (setting, output)
        (trained,) = losses(output)
        assert trained[-1] < trained[0]

    return check


FAST = [
    ("003_collective_resnet.py", check_003),
    ("004_fleet_api.py", check_004),
    # a pipeline with fp16 all-reduce; seed 002's ZeRO-2 + gradient merge + 1F1B pipeline
    (
        "001_pipeline_fp16_allreduce.py",
        pipelined(r"pipeline +1F1B over pp=2", r"fp16 allreduce +gradients all-reduced in float16"),
    ),
    (
        "002_strategy.py",
        pipelined(
            r"pipeline +1F1B over pp=2, micro_batch_size=2, accumulate_steps=2",
            r"sharding +ZeRO stage 2 over sharding=2",
            r"gradient merge +k_steps=2",
        ),
    ),
]
SLOW = [  # about 15 s or more each on 2 cores, or the same switches as a FAST one
    ("000_distributed_strategy.py", sections("recompute", "pipeline", "gradient_merge")),
    ("001_amp_fp16_allreduce.py", sections("amp", "fp16_allreduce")),
    (
        "001_optimizers.py",
        sections("lars", "lamb", "localsgd", "adaptive_localsgd", "dgc"),
    ),
    ("001_memory.py", check_001_memory),
    ("001_prototxt_and_programs.py", check_001_programs),
    # 002_strategy.py's Strategy through dist.to_static, the pipeline's stages by parallelize
    (
        "002_to_static.py",
        pipelined(
            r"pipeline +1F1B over pp=2, micro_batch_size=2, accumulate_steps=2",
            r"sharding +ZeRO stage 2 over sharding=2",
            r"gradient merge +k_steps=2",
        ),
    ),
    (
        "002_strategy_sections.py",
        sections("sharding", "gradient_merge", "fused_passes", "pipeline"),
    ),
]


@pytest.mark.parametrize(("script", "check"), FAST, ids=[name for name, _ in FAST])
def test_seed_example(script, check, tmp_path):
    check(run(script, tmp_path), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("script", "check"), SLOW, ids=[name for name, _ in SLOW])
def test_seed_example_slow(script, check, tmp_path):
    check(run(script, tmp_path), tmp_path)
