"""Paddle's API contract where Paddle's own unit tests check it: BuildStrategy's Python-side
attributes, the exception types, `_enable_env`, the auto-parallel strategies' sections, the role
makers' and `fleet.util`'s Paddle methods, `fleet.utils.LocalFS`, and Paddle's `FLAGS_*`
environment variables read by `fleet.init`.

Expected values come from Paddle 3.3.1 (`paddle.static.BuildStrategy()`, `dist.Strategy()`,
`UtilBase.get_file_shard`, ...), run once and written down here."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fleetjax
from fleetjax import StrategyWarning, fleet
from fleetjax.fleet import auto
from fleetjax.fleet.base import role_maker, util_factory
from fleetjax.fleet.utils import FS, FSFileExistsError, FSFileNotExistsError, LocalFS

# -- BuildStrategy -----------------------------------------------------------------------------

# paddle.static.BuildStrategy()'s attributes that are not proto fields, as Paddle 3.3.1 has them
# (its sets are empty lists here).
PADDLE_BUILD_STRATEGY_PYTHON_DEFAULTS = {
    "nccl_comm_num": 1,
    "use_hierarchical_allreduce": False,
    "hierarchical_allreduce_inter_nranks": 0,
    "sync_batch_norm": False,
    "fuse_all_reduce_ops": True,
    "num_trainers": 1,
    "trainer_id": 0,
    "trainers_endpoints": [],
    "bkcl_comm_num": 1,
    "async_mode": False,
    "build_cinn_pass": False,
    "fuse_adamw": False,
    "memory_optimize": None,
    "mkldnn_enabled_op_types": [],
    "onednn_enabled_op_types": [],
    "sequential_run": False,
}


def paddle_test_build_strategy() -> fleetjax.BuildStrategy:
    """The build strategy Paddle's test_fleet_distributed_strategy.py builds."""
    b = fleetjax.BuildStrategy()
    b.nccl_comm_num = 10
    b.use_hierarchical_allreduce = True
    b.hierarchical_allreduce_inter_nranks = 1
    b.fuse_elewise_add_act_ops = True
    b.sync_batch_norm = True
    b.enable_inplace = True
    b.fuse_all_reduce_ops = True
    b.trainers_endpoints = ["1", "2"]
    return b


class TestBuildStrategy:
    def test_python_side_attributes_have_paddles_defaults(self):
        b = fleetjax.BuildStrategy()
        assert {k: b._plain(k) for k in PADDLE_BUILD_STRATEGY_PYTHON_DEFAULTS} == (
            PADDLE_BUILD_STRATEGY_PYTHON_DEFAULTS
        )

    def test_set_assigned_and_saved_like_paddles_test(self, tmp_path):
        s = fleetjax.DistributedStrategy()
        s.build_strategy = paddle_test_build_strategy()
        assert s.build_strategy.nccl_comm_num == 10
        assert s.build_strategy.trainers_endpoints == ["1", "2"]
        s.save_to_prototxt(tmp_path / "s.prototxt")
        loaded = fleetjax.DistributedStrategy.from_prototxt(tmp_path / "s.prototxt")
        assert loaded.build_strategy == s.build_strategy
        text = (tmp_path / "s.prototxt").read_text()
        assert "# fleetjax: build_strategy.nccl_comm_num = 10" in text

    def test_a_setting_fleet_takes_from_elsewhere_warns_naming_that_field(self):
        s = fleetjax.DistributedStrategy(build_strategy={"nccl_comm_num": 2, "trainer_id": 3})
        with pytest.warns(StrategyWarning) as caught:
            fleetjax.read_plan(s)
        messages = [str(w.message) for w in caught]
        assert (
            "DistributedStrategy.build_strategy.nccl_comm_num=2 has no effect in fleetjax: "
            "Paddle's fleet replaces it with DistributedStrategy.nccl_comm_num, the field "
            "fleetjax reads; set that one" in messages
        )
        assert any("build_strategy.trainer_id" in m and "role maker" in m for m in messages)

    def test_values_are_checked(self):
        with pytest.raises(ValueError, match=r"build_strategy.nccl_comm_num must be >= 1, got 0"):
            fleetjax.BuildStrategy(nccl_comm_num=0)
        with pytest.raises(TypeError, match=r"memory_optimize must be bool or None, got str"):
            fleetjax.BuildStrategy(memory_optimize="yes")


# -- error types -------------------------------------------------------------------------------


class TestErrorTypesArePaddles:
    def test_unknown_attribute_is_a_type_error_with_our_message(self):
        s = fleetjax.DistributedStrategy()
        with pytest.raises(TypeError, match="'unknown_key' is not a field of DistributedStrategy"):
            s.unknown_key = "UNK"
        with pytest.raises(fleetjax.UnknownFieldError):
            s.unknown_key = "UNK"
        assert not hasattr(s, "unknown_key")

    def test_a_sync_of_the_wrong_type_is_a_value_error_and_keeps_the_value(self):
        s = fleetjax.DistributedStrategy()
        with pytest.raises(ValueError, match="DistributedStrategy.a_sync must be bool, got str"):
            s.a_sync = "True"
        with pytest.raises(TypeError):
            s.fp16_allreduce = "True"
        assert (s.a_sync, s.fp16_allreduce) == (True, False)

    def test_strategy_from_a_list_and_an_unknown_fused_pass_are_value_errors(self):
        with pytest.raises(ValueError, match="Strategy must be set from a dict, got list"):
            fleetjax.Strategy([{"enable": True, "stage": 2}])
        with pytest.raises(ValueError, match="'dropout' is not a field of fused_passes"):
            fleetjax.Strategy({"fused_passes": {"enable": True, "dropout": True}})


# -- _enable_env -------------------------------------------------------------------------------


def test_enable_env_exports_paddles_flags_which_fleet_init_maps(monkeypatch):
    environ = {k: v for k, v in os.environ.items() if k not in ENABLE_ENV_FLAGS}
    monkeypatch.setattr(os, "environ", environ)  # what _enable_env writes goes with the test
    fleetjax.DistributedStrategy(fuse_grad_size_in_MB=16)._enable_env()
    assert {name: os.environ[name] for name in ENABLE_ENV_FLAGS} == {
        "FLAGS_cudnn_batchnorm_spatial_persistent": "true",
        "FLAGS_conv_workspace_size_limit": "4000",
        "FLAGS_cudnn_exhaustive_search": "true",
        "FLAGS_sync_nccl_allreduce": "true",
        "FLAGS_fuse_parameter_memory_size": "16",
        "FLAGS_fuse_parameter_groups_size": "20",
    }
    # fleet.init reads them back into an empty strategy's fields.
    f = fleet.Fleet().init(strategy=fleetjax.DistributedStrategy())
    assert f.strategy.fuse_grad_size_in_MB == 16


ENABLE_ENV_FLAGS = (
    "FLAGS_cudnn_batchnorm_spatial_persistent",
    "FLAGS_conv_workspace_size_limit",
    "FLAGS_cudnn_exhaustive_search",
    "FLAGS_sync_nccl_allreduce",
    "FLAGS_fuse_parameter_memory_size",
    "FLAGS_fuse_parameter_groups_size",
)


# -- the auto-parallel strategies ---------------------------------------------------------------

# paddle.distributed.Strategy()'s top-level keys and optimization sections in Paddle 3.3.1.
PADDLE_STRATEGY_KEYS = {
    "auto_mode": "semi",
    "gradient_scale": True,
    "gradient_scale_using_allreduce_avg": False,
    "use_cache": True,
    "return_numpy": True,
    "all_ranks": False,
    "split_data": True,
    "seed": None,
    "reinit": False,
    "full_graph": True,
}
PADDLE_OPTIMIZATION_SECTIONS = {
    "dp_optimization": {
        "enable": False,
        "fuse_all_reduce_ops": True,
        "fuse_grad_size_in_MB": 32,
        "overlap_comm_cacl": True,
        "gradient_sync_after_accumulate": False,
    },
    "mp_optimization": {
        "allreduce_matmul_grad_overlapping": False,
        "replace_with_c_embedding": False,
        "replace_with_parallel_cross_entropy": False,
    },
    "sp_optimization": {"enable": True},
}


class TestAutoParallelStrategies:
    def test_strategy_has_paddles_keys_and_sections(self):
        s = fleetjax.Strategy()
        assert {k: s._get(k) for k in PADDLE_STRATEGY_KEYS} == PADDLE_STRATEGY_KEYS
        for name, section in PADDLE_OPTIMIZATION_SECTIONS.items():
            assert s._get(name).to_dict() == section
        assert fleetjax.Strategy({"seed": 7, "split_data": False}).seed == 7

    def test_gradient_scale_false_is_refused_saying_what_to_do(self):
        with pytest.raises(ValueError, match="scale the loss by the replica count"):
            fleetjax.Strategy({"gradient_scale": False})

    def test_fleet_auto_strategy_has_paddles_qat_and_tuning(self):
        s = auto.Strategy()
        assert s.qat.to_dict() == {
            "enable": False,
            "channel_wise_abs_max": True,
            "weight_bits": 8,
            "activation_bits": 8,
            "not_quant_pattern": ["skip_quant"],
            "algo": None,
            "onnx_format": True,
        }
        assert s.tuning.to_dict() == {
            "enable": False,
            "profile_start_step": 1,
            "profile_end_step": 1,
            "run_after_tuning": True,
            "debug": False,
        }
        assert s.dataset.to_dict() == {"enable": False, "num_shards": 1}
        assert s.fused_passes.to_dict() == {"enable": False, "fused_passes_list": []}
        assert s.amp.decr_ratio == 0.8 and s.sharding.degree == 8 and s.auto_mode == "semi"
        with pytest.raises(ValueError, match="Expected|must be set from a dict"):
            auto.Strategy("config.yaml")

    @pytest.mark.parametrize("make", [auto.Strategy, fleetjax.Strategy])
    def test_qat_and_paddle_2_4s_segment_broadcast_mb(self, make):
        """Paddle's auto_parallel test_strategy: the qat section's defaults, and
        `sharding.segment_broadcast_MB = 64.0`, which Paddle 3 still takes (as any attribute):
        kept and read back, with a warning that it does nothing."""
        s = make()
        qat = s.qat
        assert (qat.enable, qat.channel_wise_abs_max, qat.weight_bits) == (False, True, 8)
        assert (qat.activation_bits, qat.not_quant_pattern, qat.algo) == (8, ["skip_quant"], None)
        s.sharding.enable, s.sharding.stage, s.sharding.degree = True, 2, 2
        s.sharding.segment_broadcast_MB = 64.0
        assert s.sharding.segment_broadcast_MB == 64.0
        if make is fleetjax.Strategy:
            with pytest.warns(StrategyWarning, match=r"sharding.segment_broadcast_MB=64.0 has no"):
                fleetjax.read_plan(s)
            s.qat.enable = True
            with pytest.raises(NotImplementedError, match=r"Strategy.qat.enable=True: quantiz"):
                fleetjax.read_plan(s)

    def test_from_legacy_strategy_converts_as_paddle(self):
        legacy = auto.Strategy({"sharding": {"enable": True, "stage": 2}, "seed": 3})
        legacy.fused_passes.enable = True
        legacy.fused_passes.fused_passes_list = ["fused_gemm_epilogue_pass"]
        s = fleetjax.Strategy({"pipeline": {"enable": True}})
        s._from_legacy_strategy(legacy)
        assert s.non_defaults() == {
            "sharding": {"enable": True, "stage": 2},
            "fused_passes": {"enable": True, "gemm_epilogue": True},
            "seed": 3,
        }
        # fleetjax's public spelling: the constructor converts the same way (pipeline aside,
        # which only `s` had before).
        assert fleetjax.Strategy(legacy).non_defaults() == s.non_defaults()

    def test_from_legacy_strategy_refuses_qat_and_warns_for_what_it_drops(self):
        legacy = auto.Strategy({"tuning": {"enable": True}})
        with pytest.warns(StrategyWarning, match="fleet.auto.Strategy.tuning has no effect"):
            fleetjax.Strategy()._from_legacy_strategy(legacy)
        legacy.qat.enable = True
        with pytest.raises(NotImplementedError, match="quantization-aware training"):
            fleetjax.Strategy()._from_legacy_strategy(legacy)
        with pytest.raises(NotImplementedError, match="quantization-aware training"):
            fleetjax.Strategy(legacy)


# -- role makers -------------------------------------------------------------------------------


class TestRoleMakers:
    def test_role_maker_base_constructs_empty_as_paddles(self):
        role = role_maker.RoleMakerBase()
        for query in ("_is_worker", "_worker_num", "_worker_index", "_node_num", "_role_id"):
            with pytest.raises(NotImplementedError, match=f"knows no role: {query}"):
                getattr(role, query)()
        assert role._get_trainer_endpoints() == [] and role._get_pserver_endpoints() == []
        assert role.to_string() == (
            "role: None, current_id: -1, worker_endpoints: [], server_endpoints: []"
        )
        with pytest.warns(UserWarning, match="RoleMakerBase has no workers"):
            assert role._all_gather(1, "worker") is None
        with pytest.warns(UserWarning, match="RoleMakerBase has no workers"):
            assert role._all_reduce(1, "sum", "worker") is None

    def test_paddle_cloud_role_maker_answers_paddles_queries(self):
        env = {
            "PADDLE_TRAINER_ID": "1",
            "PADDLE_TRAINER_ENDPOINTS": "127.0.0.1:36001,127.0.0.2:36001,127.0.0.2:36002",
            "PADDLE_LOCAL_DEVICE_IDS": "0,1",
        }
        ro = role_maker.PaddleCloudRoleMaker(is_collective=True, environ=env)
        assert (ro._worker_num(), ro._node_num(), ro._worker_index(), ro._role_id()) == (3, 2, 1, 1)
        assert (ro._is_worker(), ro._is_server(), ro._is_first_worker()) == (True, False, False)
        assert ro._get_trainer_endpoints()[0] == "127.0.0.1:36001"
        assert ro._get_trainer_endpoint() == "127.0.0.2:36001"
        assert (ro._is_non_distributed(), ro._get_local_device_ids()) == (False, "0,1")
        assert role_maker.PaddleCloudRoleMaker(True, environ={})._is_non_distributed()

    @pytest.mark.parametrize(
        "missing", ["PADDLE_TRAINERS_NUM", "TRAINING_ROLE", "PADDLE_TRAINER_ID", "PADDLE_PORT",
                    "POD_IP"],
    )  # fmt: skip
    def test_paddle_cloud_role_maker_reads_the_environment_on_first_use(
        self, fresh_fleet, monkeypatch, missing
    ):
        """Paddle 3.3.1 (its test_fleet_rolemaker_new's calls): a PaddleCloudRoleMaker is made
        whatever the environment holds; `_generate_role()`, which each role query and
        `fleet.init` call, reads it and raises Paddle's error for a missing variable."""
        env = {
            "PADDLE_PSERVERS_IP_PORT_LIST": "127.0.0.1:36001,127.0.0.2:36001",
            "PADDLE_TRAINERS_NUM": "2",
            "TRAINING_ROLE": "TRAINER",
            "PADDLE_TRAINER_ID": "1",
            "PADDLE_PORT": "36001",
            "POD_IP": "127.0.0.1",
        }
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.delenv(missing)
        ro = role_maker.PaddleCloudRoleMaker(is_collective=False)
        message = f"^Can not find {missing}, please check your environment.$"
        with pytest.raises(ValueError, match=message):
            ro._generate_role()
        with pytest.raises(ValueError, match=message):
            ro._is_worker()
        with pytest.raises(ValueError, match=message):
            fresh_fleet.init(ro)
        monkeypatch.setenv(missing, env[missing])  # read when asked, not when made
        assert (ro._is_worker(), ro._worker_index(), ro._worker_num()) == (True, 1, 2)

    def test_collectives_over_one_process(self):
        ro = role_maker.UserDefinedRoleMaker(worker_endpoints=["127.0.0.1:6170"])
        assert ro._all_gather(5, "worker") == [5]
        assert ro._all_reduce([1, 2], "max", "worker") == [1, 2]
        for array in (np.ones(2), jnp.ones(2)):  # either array: a numpy array, as Paddle's
            reduced = ro._all_reduce(array, "sum", "worker")
            assert type(reduced) is np.ndarray and reduced.tolist() == [1.0, 1.0]
        assert ro._all_reduce(np.float32(2), "sum", "worker") == 2.0
        ro._barrier("worker")

    def test_fleet_asks_a_user_defined_role_maker_through_paddles_methods(self, fresh_fleet):
        class FixedRole(role_maker.RoleMakerBase):
            def _worker_index(self):
                return 0

            def _worker_num(self):
                return 1

            def _is_worker(self):
                return True

            def _is_first_worker(self):
                return True

            def _get_trainer_endpoints(self):
                return ["10.1.1.1:6170"]

            def _node_num(self):
                return 1

        fresh_fleet.init(FixedRole())
        assert fresh_fleet.worker_endpoints(to_string=True) == "10.1.1.1:6170"
        assert (fresh_fleet.worker_index(), fresh_fleet.is_first_worker()) == (0, True)
        assert fresh_fleet.util.role_maker is fresh_fleet._role

    @pytest.mark.parametrize("call", ["init_worker", "stop_worker"])
    def test_parameter_server_calls_are_also_value_errors(self, fresh_fleet, call, monkeypatch):
        monkeypatch.setenv("PADDLE_TRAINER_ENDPOINTS", "127.0.0.1:36000")  # not a lone process
        fresh_fleet.init()
        with pytest.raises(ValueError, match=f"{call}.. is a parameter-server call"):
            getattr(fresh_fleet, call)()


@pytest.fixture
def fresh_fleet(monkeypatch):
    for name in ("PADDLE_TRAINER_ID", "PADDLE_TRAINER_ENDPOINTS", "PADDLE_TRAINERS_NUM"):
        monkeypatch.delenv(name, raising=False)
    return fleet.Fleet()


# -- fleet.util --------------------------------------------------------------------------------

# Paddle 3.3.1's UtilBase.get_file_shard: (files, workers, index) -> the worker's files.
PADDLE_FILE_SHARDS = [
    (5, 2, 0, [0, 1, 2]),
    (5, 2, 1, [3, 4]),
    (2, 3, 2, []),
    (7, 3, 1, [3, 4]),
    (7, 3, 2, [5, 6]),
    (8, 4, 3, [6, 7]),
    (0, 2, 1, []),
    (10, 4, 1, [3, 4, 5]),
    (10, 4, 3, [8, 9]),
]


class TestUtil:
    def test_standalone_util_base_and_factory(self):
        util = fleet.UtilBase()
        strategy = fleet.DistributedStrategy()
        util._set_strategy(strategy)
        util._set_role_maker(None)
        assert (util.dist_strategy, util.role_maker) == (strategy, None)
        made = fleet.base.util_factory.UtilFactory()._create_util(
            {"role_maker": None, "valid_strategy": strategy}
        )
        assert isinstance(made, util_factory.UtilBase) and made.dist_strategy is strategy
        with pytest.raises(RuntimeError, match="no role maker yet: call fleet.init"):
            util.all_gather(1)

    @pytest.mark.parametrize(("count", "workers", "index", "expected"), PADDLE_FILE_SHARDS)
    def test_get_file_shard_as_paddle(self, count, workers, index, expected):
        endpoints = [f"127.0.0.1:{7000 + i}" for i in range(workers)]
        util = fleet.UtilBase()
        util._set_role_maker(
            role_maker.UserDefinedRoleMaker(current_id=index, worker_endpoints=endpoints)
        )
        files = [f"part-{i}" for i in range(count)]
        assert util.get_file_shard(files) == [f"part-{i}" for i in expected]

    def test_init_gives_the_util_its_role_and_a_subclass_keeps_paddles_helpers(self, fresh_fleet):
        class UserDefinedUtil(fleet.UtilBase):
            def get_user_id(self):
                return 10

        fresh_fleet.util = UserDefinedUtil()
        fresh_fleet.init()
        assert fresh_fleet.util.get_user_id() == 10
        assert fresh_fleet.util.get_file_shard(["a", "b"]) == ["a", "b"]

    def test_set_file_system_takes_an_fs(self):
        util = fleet.UtilBase()
        util._set_file_system(LocalFS())
        assert isinstance(util.fs_client, LocalFS)
        with pytest.raises(TypeError, match="fs_client must be a fleetjax.fleet.utils.FS"):
            util._set_file_system("/tmp")


# -- LocalFS -----------------------------------------------------------------------------------


class TestLocalFS:
    def test_every_fs_method_is_an_interface(self):
        fs = FS()
        with pytest.raises(NotImplementedError):
            fs.ls_dir("x")
        with pytest.raises(NotImplementedError):
            fs.mv("a", "b", False, False)

    def test_directories_and_files(self, tmp_path):
        fs, root = LocalFS(), str(tmp_path)
        assert fs.ls_dir(f"{root}/missing") == ([], []) and not fs.need_upload_download()
        fs.mkdirs(f"{root}/b/c")
        fs.mkdirs(f"{root}/b/c")  # exists: nothing
        fs.touch(f"{root}/a.txt")
        fs.touch(f"{root}/a.txt", exist_ok=True)
        with pytest.raises(FSFileExistsError):
            fs.touch(f"{root}/a.txt", exist_ok=False)
        assert fs.ls_dir(root) == (["b"], ["a.txt"]) and fs.list_dirs(root) == ["b"]
        assert (fs.is_file(f"{root}/a.txt"), fs.is_dir(f"{root}/a.txt")) == (True, False)
        assert fs.is_exist(f"{root}/b") and fs.is_dir(f"{root}/b")
        with pytest.raises(FSFileExistsError, match="is already a file"):
            fs.mkdirs(f"{root}/a.txt")
        fs.delete(f"{root}/b")
        fs.delete(f"{root}/b")  # missing: nothing
        assert fs.ls_dir(root) == ([], ["a.txt"])

    def test_mv_and_rename(self, tmp_path):
        fs, root = LocalFS(), str(tmp_path)
        with pytest.raises(FSFileNotExistsError):
            fs.mv(f"{root}/nope", f"{root}/dir")
        fs.mkdirs(f"{root}/dir")
        fs.mv(f"{root}/dir", f"{root}/new")
        with pytest.raises(FSFileExistsError):
            fs.mv(f"{root}/new", f"{root}/new")
        fs.mkdirs(f"{root}/dir")
        fs.mv(f"{root}/dir", f"{root}/new", overwrite=True)
        assert fs.ls_dir(root) == (["new"], [])
        fs.rename(f"{root}/new", f"{root}/renamed")
        assert fs.list_dirs(root) == ["renamed"]

    def test_upload_download_and_cat_copy(self, tmp_path):
        fs, root = LocalFS(), str(tmp_path)
        with pytest.raises(FSFileNotExistsError):
            fs.upload(f"{root}/src.txt", f"{root}/dst.txt")
        with open(f"{root}/src.txt", "w") as f:
            f.write("a\nb\n")
        fs.upload(f"{root}/src.txt", f"{root}/dst.txt")
        with pytest.raises(FSFileExistsError):
            fs.upload(f"{root}/src.txt", f"{root}/dst.txt")
        assert fs.cat(f"{root}/dst.txt") == "a\nb" and fs.cat(f"{root}/nope") == ""
        fs.mkdirs(f"{root}/model/sub")
        fs.touch(f"{root}/model/sub/w")
        fs.upload_dir(f"{root}/model", f"{root}/remote")
        fs.download(f"{root}/remote/model", f"{root}/back")
        assert fs.ls_dir(f"{root}/back/sub") == ([], ["w"])
        fs.download(f"{root}/src.txt", f"{root}/back", overwrite=True)
        assert fs.is_file(f"{root}/back")


# -- Paddle's FLAGS_* environment variables ----------------------------------------------------

_INIT_IN_A_FRESH_PROCESS = textwrap.dedent(
    """
    import json, os, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import jax
        from fleetjax import fleet
        fleet.init(is_collective=True)
    print(json.dumps({
        "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "visible_gpus": jax.config.values["jax_cuda_visible_devices"],
        "fuse_grad_size_in_MB": fleet.strategy.fuse_grad_size_in_MB,
        "fuse_grad_size_in_num": fleet.strategy.fuse_grad_size_in_num,
        "xla_flags": os.environ["XLA_FLAGS"].split(),
        "warnings": [str(w.message) for w in caught],
    }))
    """
)


def test_fleet_init_reads_seed_003s_flags_before_the_backend_starts():
    env = {
        **os.environ,
        "FLAGS_fraction_of_gpu_memory_to_use": "0.7",
        "FLAGS_fuse_parameter_memory_size": "16",
        "FLAGS_fuse_parameter_groups_size": "50",
        "FLAGS_selected_gpus": "0",
        "FLAGS_call_stack_level": "2",
        "JAX_PLATFORMS": "cpu",
    }
    for name in (
        "XLA_PYTHON_CLIENT_MEM_FRACTION",
        "CUDA_VISIBLE_DEVICES",
        "PADDLE_TRAINER_ENDPOINTS",
    ):
        env.pop(name, None)
    child = subprocess.run(
        [sys.executable, "-c", _INIT_IN_A_FRESH_PROCESS],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    got = json.loads(child.stdout.splitlines()[-1])
    assert got["mem_fraction"] == "0.7" and got["visible_gpus"] == "0"
    assert (got["fuse_grad_size_in_MB"], got["fuse_grad_size_in_num"]) == (16, 50)
    assert f"--xla_gpu_all_reduce_combine_threshold_bytes={16 * 2**20}" in got["xla_flags"]
    assert "--xla_gpu_collective_combine_threshold_count=50" in got["xla_flags"]
    assert got["warnings"] == [
        "fleetjax does not read these Paddle flags: FLAGS_call_stack_level (they tune Paddle's "
        "executor, allocator or kernels; docs/knobs.md lists the flags it reads)"
    ]


class TestFlagsInOneProcess:
    """Here JAX's backend has started already (the test process computed before)."""

    def test_memory_fraction_too_late_warns(self, fresh_fleet, monkeypatch):
        monkeypatch.setenv("FLAGS_fraction_of_gpu_memory_to_use", "0.5")
        monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
        with pytest.warns(
            StrategyWarning, match="too late for FLAGS_fraction_of_gpu_memory_to_use=0.5"
        ):
            fresh_fleet.init()
        assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ

    def test_jax_variable_wins_over_the_flag(self, fresh_fleet, monkeypatch):
        monkeypatch.setenv("FLAGS_fraction_of_gpu_memory_to_use", "0.5")
        monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
        with pytest.warns(StrategyWarning, match="XLA_PYTHON_CLIENT_MEM_FRACTION=.9 wins over"):
            fresh_fleet.init()

    @pytest.mark.parametrize(
        ("name", "value", "message"),
        [
            ("FLAGS_fraction_of_gpu_memory_to_use", "1.5", "must be in \\(0, 1\\]"),
            ("FLAGS_fuse_parameter_memory_size", "big", "could not convert string to float"),
            ("FLAGS_cudnn_exhaustive_search", "maybe", "'maybe' is not a boolean"),
            ("FLAGS_conv_workspace_size_limit", "-1", "conv_workspace_size_limit must be >= 0"),
        ],
    )
    def test_bad_values_raise_naming_the_variable(
        self, fresh_fleet, monkeypatch, name, value, message
    ):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"environment variable {name}={value!r}: .*{message}"):
            fresh_fleet.init()

    def test_a_field_set_in_code_wins_over_the_flag(self, fresh_fleet, monkeypatch):
        monkeypatch.setenv("FLAGS_cudnn_exhaustive_search", "0")
        s = fleetjax.DistributedStrategy(cudnn_exhaustive_search=True)
        with pytest.warns(StrategyWarning, match="cudnn_exhaustive_search=True wins over FLAGS_"):
            fresh_fleet.init(strategy=s)
        assert fresh_fleet.strategy.cudnn_exhaustive_search is True

    def test_an_unset_field_takes_the_flag_and_the_users_strategy_is_untouched(
        self, fresh_fleet, monkeypatch
    ):
        monkeypatch.setenv("FLAGS_cudnn_exhaustive_search", "false")
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # where the flag matters
        s = fleetjax.DistributedStrategy()
        with pytest.warns(StrategyWarning, match="too late for DistributedStrategy.cudnn_exhaus"):
            fresh_fleet.init(strategy=s)
        assert fresh_fleet.strategy.cudnn_exhaustive_search is False
        assert not s.is_set("cudnn_exhaustive_search")

    def test_with_a_strategy_the_field_flags_warn(self, fresh_fleet, monkeypatch):
        monkeypatch.setenv("FLAGS_fuse_parameter_memory_size", "16")
        with pytest.warns(
            StrategyWarning, match="has no effect with a fleetjax.Strategy: it sets "
        ):
            fresh_fleet.init(strategy=fleetjax.Strategy())

    def test_paddles_no_limit_values_keep_the_default(self, fresh_fleet, monkeypatch):
        monkeypatch.setenv("FLAGS_fuse_parameter_memory_size", "-1")
        monkeypatch.setenv("FLAGS_fuse_parameter_groups_size", "1")
        fresh_fleet.init()
        assert not fresh_fleet.strategy.is_set("fuse_grad_size_in_MB")
        assert not fresh_fleet.strategy.is_set("fuse_grad_size_in_num")


def test_all_reduce_of_a_numpy_array_keeps_the_array():
    ro = role_maker.UserDefinedRoleMaker(worker_endpoints=["127.0.0.1:6170"])
    util = fleet.UtilBase()
    util._set_role_maker(ro)
    out = util.all_reduce(np.arange(3.0), "sum")
    assert isinstance(out, np.ndarray) and out.tolist() == [0.0, 1.0, 2.0]
    assert util.all_reduce((1, 2)) == [1, 2]
