"""save_to_prototxt / load_from_prototxt against files written by real Paddle 2.6.2 and 3.3.1.

The files in tests/data were written by Paddle's own `DistributedStrategy.save_to_prototxt`
(pip install paddlepaddle==3.3.1 / ==2.6.2; the script is in tests/data/README.md).
"""

import contextlib
import os
import pathlib
import re
import stat
import subprocess

import pytest
from read_only import read_only

import fleetjax
from fleetjax import DistributedStrategy, ExecutionStrategy

DATA = pathlib.Path(__file__).parents[1] / "data"
PADDLE_FILES = sorted(DATA.glob("paddle*.prototxt"))


def write(tmp_path, text):
    path = tmp_path / "strategy.prototxt"
    path.write_text(text)
    return path


@pytest.mark.parametrize("version", ["2.6.2", "3.3.1"])
def test_paddle_written_seed_001_example(version):
    s = DistributedStrategy.from_prototxt(DATA / f"paddle{version}_seed001_example.prototxt")
    assert s.dgc and s.recompute
    assert s.recompute_configs["checkpoints"] == ["x"]
    assert repr(s) == (
        "DistributedStrategy(recompute=True, dgc=True, recompute_configs={'checkpoints': ['x']})"
    )


@pytest.mark.parametrize("version", ["2.6.2", "3.3.1"])
def test_paddle_written_hybrid_file(version):
    s = DistributedStrategy.from_prototxt(DATA / f"paddle{version}_hybrid_everything.prototxt")
    assert (s.gradient_merge, s.lars, s.pipeline, s.a_sync) == (True, True, True, False)
    assert s.fuse_grad_size_in_TFLOPS == 25.0
    assert s.last_comm_group_size_MB == 2.5
    assert s.recompute_configs["checkpoint_shape"] == [100, 512, 1024]
    assert s.dgc_configs["sparsity"] == [0.75, 0.9375, 0.999]
    assert s.pipeline_configs["schedule_mode"] == "F-then-B"
    assert s.lars_configs["exclude_from_weight_decay"] == ["batch_norm", ".b"]
    assert s.lars_configs["epsilon"] == 1e-8
    assert s.sharding_configs["segment_broadcast_MB"] == 16.5
    assert s.sharding_configs["stage"] == 2
    assert s.hybrid_configs["mp_configs"]["sync_param"] is False
    assert [s.hybrid_configs[f"{a}_degree"] for a in ("dp", "mp", "pp")] == [2, 2, 2]
    assert s.gradient_merge_configs == {"k_steps": 4, "avg": False, "mode": "across_calls"}


def test_paddle_2_file_with_execution_strategy():
    s = DistributedStrategy.from_prototxt(DATA / "paddle2.6.2_seed003_resnet.prototxt")
    assert s.execution_strategy == ExecutionStrategy(
        num_threads=3, num_iteration_per_drop_scope=100, num_iteration_per_run=1
    )
    assert s.build_strategy.enable_sequential_execution is True
    assert s.build_strategy.fuse_all_optimizer_ops is True
    assert s.amp and s.amp_configs["init_loss_scaling"] == 128.0
    assert s.nccl_comm_num == 2


@pytest.mark.parametrize("path", PADDLE_FILES, ids=lambda p: p.name)
def test_paddle_files_round_trip(path, tmp_path):
    s = DistributedStrategy.from_prototxt(path)
    s.save_to_prototxt(tmp_path / "again.prototxt")
    assert DistributedStrategy.from_prototxt(tmp_path / "again.prototxt") == s


def test_written_text_is_paddles_format(tmp_path):
    s = DistributedStrategy()
    s.amp = True
    s.amp_configs = {"init_loss_scaling": 1024.0, "custom_white_list": ["softmax", "matmul"]}
    s.hybrid_configs = {"dp_degree": 2, "mp_configs": {"sync_param": False}}
    s.hybrid_parallel_order = ["dp", "sharding", "pp", "mp"]
    s.execution_strategy.num_threads = 4
    s.save_to_prototxt(tmp_path / "s.prototxt")
    assert (tmp_path / "s.prototxt").read_text() == (
        "amp: true\n"
        "fuse_grad_size_in_TFLOPS: 20.0\n"
        "cudnn_exhaustive_search: true\n"
        "conv_workspace_size_limit: 4000\n"
        "cudnn_batchnorm_spatial_persistent: true\n"
        "amp_configs {\n"
        "  init_loss_scaling: 1024.0\n"
        "  decr_ratio: 0.5\n"
        '  custom_white_list: "softmax"\n'
        '  custom_white_list: "matmul"\n'
        "}\n"
        "dgc_configs {\n"
        "  sparsity: 0.999\n"
        "}\n"
        "hybrid_configs {\n"
        "  dp_degree: 2\n"
        "  mp_configs {\n"
        "    sync_param: false\n"
        "  }\n"
        "}\n"
        "# Fields Paddle's proto does not have; Paddle skips these comment lines.\n"
        '# fleetjax: hybrid_configs.order = ["dp", "sharding", "pp", "mp"]\n'
        "# fleetjax: execution_strategy.num_threads = 4\n"
    )


def test_round_trip_of_every_kind_of_field(tmp_path):
    s = DistributedStrategy()
    s.update(
        amp=True,
        nccl_comm_num=3,
        last_comm_group_size_MB=0.25,
        recompute_configs={
            "checkpoints": ["a", "b"],
            "refined_ops_patterns": [{"main_ops": ["matmul"], "num": 2}, {"pre_ops": ["x"]}],
        },
        hybrid_configs={"sharding_degree": 2, "order": ["sharding", "dp", "pp", "mp"]},
        sharding_configs={"sharding_segment_strategy": "segment_anchors"},
        build_strategy={"fuse_gemm_epilogue": True, "enable_sequential_execution": True},
        execution_strategy={"num_iteration_per_run": 1},
        mode="COLLECTIVE",
    )
    s.save_to_prototxt(tmp_path / "s.prototxt")
    loaded = DistributedStrategy.from_prototxt(tmp_path / "s.prototxt")
    assert loaded == s
    patterns = loaded.recompute_configs["refined_ops_patterns"]  # messages, as in Paddle
    assert (patterns[0].num, patterns[1].pre_ops, patterns[1].num) == (2, ["x"], 0)
    assert loaded.recompute_configs.set_values()["refined_ops_patterns"][1] == {"pre_ops": ["x"]}


def test_loading_twice_does_not_duplicate_lists():
    s = DistributedStrategy()
    path = DATA / "paddle3.3.1_hybrid_everything.prototxt"
    s.load_from_prototxt(path).load_from_prototxt(path)
    assert s.recompute_configs["checkpoints"] == ["x", "y"]


def test_unknown_field_names_field_and_line(tmp_path):
    path = write(tmp_path, "amp: true\nfoo_bar: 1\n")
    with pytest.raises(fleetjax.PrototxtError) as info:
        DistributedStrategy.from_prototxt(path)
    assert str(info.value) == (
        f'{path}: 2:1 : Message type "paddle.fleet.DistributedStrategy" has no field named '
        '"foo_bar".'
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "amp_configs {\n  use_bf16: true\n}\n",
            r': 2:3 : .*AMPConfig" has no field named "use_bf16"',
        ),
        ('amp: true\namp_configs { init_loss_scaling: "x" }\n', r": 2:\d+ : .*init_loss_scaling"),
    ],
    ids=["unknown-nested-field", "malformed-value"],
)
def test_errors_name_the_line(tmp_path, text, expected):
    with pytest.raises(fleetjax.PrototxtError, match=expected):
        DistributedStrategy.from_prototxt(write(tmp_path, text))


def test_value_out_of_range_in_a_file(tmp_path):
    path = write(tmp_path, "sharding_configs {\n  stage: 5\n}\n")
    with pytest.raises(
        fleetjax.PrototxtError, match=r"sharding_configs.stage must be one of 1, 2, 3"
    ):
        DistributedStrategy.from_prototxt(path)


def test_bad_extension_line(tmp_path):
    path = write(tmp_path, "amp: true\n# fleetjax: hybrid_configs.order = [dp]\n")
    with pytest.raises(fleetjax.PrototxtError, match=r":2: bad fleetjax extension line"):
        DistributedStrategy.from_prototxt(path)
    path = write(tmp_path, '# fleetjax: hybrid_configs.nope = ["dp"]\n')
    with pytest.raises(fleetjax.PrototxtError, match="'nope' is not a field of hybrid_configs"):
        DistributedStrategy.from_prototxt(path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\x89PNG\r\n\x1a\n\x00", ":1: not a text file (byte 0x89 is not UTF-8); a prototxt"),
        ("amp: true\n# caf\xe9\n".encode("latin-1"), ":2: not a text file (byte 0xe9 is not"),
        (b"amp: true\n# fleetjax: amp.x = 1\n",
         ":2: bad fleetjax extension line: amp is a bool field, which has no fields"),
        (b"# fleetjax: .x = 1\n", ":1: bad fleetjax extension line: '.x' is not a field name"),
        (b"# fleetjax: hybrid_configs.order = " + b"[" * 100_000 + b"]" * 100_000 + b"\n",
         ":1: bad fleetjax extension line: the JSON value is nested too deeply"),
    ],
    ids=["binary", "latin-1", "extension-of-a-bool", "empty-name", "deep-json"],
)  # fmt: skip
def test_unreadable_files_name_the_file_and_line(tmp_path, data, message):
    path = tmp_path / "strategy.prototxt"
    path.write_bytes(data)
    with pytest.raises(fleetjax.PrototxtError, match=f"^{re.escape(f'{path}{message}')}"):
        DistributedStrategy.from_prototxt(path)


def test_failed_load_changes_nothing(tmp_path):
    s = DistributedStrategy()
    s.amp_configs = {"incr_ratio": 3.0}
    path = write(tmp_path, "amp_configs {\n  incr_ratio: 4.0\n  decr_ratio: 2.0\n}\n")
    with pytest.raises(fleetjax.PrototxtError):
        s.load_from_prototxt(path)
    assert s.amp_configs["incr_ratio"] == 3.0


def test_save_replaces_atomically(tmp_path):
    path = tmp_path / "s.prototxt"
    path.write_text("old contents")
    DistributedStrategy(amp=True).save_to_prototxt(path)
    assert path.read_text().startswith("amp: true\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.prototxt"]


def test_save_keeps_the_mode_of_a_replaced_file_and_gives_a_new_one_opens(tmp_path):
    umask = os.umask(0o027)
    try:
        DistributedStrategy(amp=True).save_to_prototxt(tmp_path / "new.prototxt")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "new.prototxt").stat().st_mode) == 0o640  # 0o666 & ~0o027
    (tmp_path / "old.prototxt").write_text("amp: false\n")
    (tmp_path / "old.prototxt").chmod(0o604)
    DistributedStrategy(amp=True).save_to_prototxt(tmp_path / "old.prototxt")
    assert stat.S_IMODE((tmp_path / "old.prototxt").stat().st_mode) == 0o604
    assert (tmp_path / "old.prototxt").read_text().startswith("amp: true\n")


@pytest.mark.parametrize("where", ["missing-folder", "read-only-folder", "a-folder"])
def test_a_failed_save_names_the_target_and_leaves_nothing(tmp_path, where):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "s.prototxt").write_text("old contents")
    target, error = {
        "missing-folder": (folder / "missing" / "s.prototxt", FileNotFoundError),
        "read-only-folder": (folder / "new.prototxt", PermissionError),
        "a-folder": (folder, IsADirectoryError),
    }[where]
    unwritable = read_only(folder) if where == "read-only-folder" else contextlib.nullcontext()
    with unwritable, pytest.raises(error) as info:
        DistributedStrategy(amp=True).save_to_prototxt(target)
    assert str(info.value).endswith(f": '{target}'")
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "s.prototxt"]
    assert (folder / "s.prototxt").read_text() == "old contents"


PADDLE_PYTHON = os.environ.get("FLEETJAX_PADDLE_PYTHON")


@pytest.mark.skipif(
    not PADDLE_PYTHON,
    reason="set FLEETJAX_PADDLE_PYTHON to a Python that has paddlepaddle installed",
)
def test_paddle_loads_what_fleetjax_writes(tmp_path):
    s = DistributedStrategy.from_prototxt(DATA / "paddle3.3.1_hybrid_everything.prototxt")
    s.hybrid_parallel_order = ["dp", "sharding", "pp", "mp"]
    s.execution_strategy.num_threads = 4
    s.save_to_prototxt(tmp_path / "ours.prototxt")
    script = (
        "import sys, paddle.distributed.fleet as fleet\n"
        "s = fleet.DistributedStrategy(); s.load_from_prototxt(sys.argv[1])\n"
        "print(s.amp_configs['decr_ratio'], s.pipeline_configs['schedule_mode'],"
        " s.conv_workspace_size_limit, s.hybrid_configs['dp_degree'], s.lars)\n"
    )
    out = subprocess.run(
        [PADDLE_PYTHON, "-c", script, str(tmp_path / "ours.prototxt")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split()[-5:] == ["0.5", "F-then-B", "4000", "2", "True"]
