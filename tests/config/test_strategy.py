"""DistributedStrategy, BuildStrategy, ExecutionStrategy and Strategy: defaults and semantics."""

import copy
import pickle

import pytest

import fleetjax
from fleetjax import BuildStrategy, DistributedStrategy, ExecutionStrategy, Strategy

# Defaults as the seed documents state them (001: attribute reference; 003: the tables).
SEED_001_CONFIGS = {
    "recompute_configs": {"checkpoints": [], "enable_offload": False},
    "gradient_merge_configs": {"k_steps": 1, "avg": True},
    "lars_configs": {
        "lars_coeff": 0.001,
        "lars_weight_decay": 0.0005,
        "exclude_from_weight_decay": [],
        "epsilon": 0.0,
    },
    "lamb_configs": {"lamb_weight_decay": 0.01, "exclude_from_weight_decay": []},
    "localsgd_configs": {"k_steps": 1, "begin_step": 1},
    "adaptive_localsgd_configs": {"init_k_steps": 1, "begin_step": 1},
    "amp_configs": {
        "init_loss_scaling": 32768.0,
        "use_dynamic_loss_scaling": True,
        "incr_every_n_steps": 1000,
        "decr_every_n_nan_or_inf": 2,
        "incr_ratio": 2.0,
        "decr_ratio": 0.5,
        "custom_white_list": [],
        "custom_black_list": [],
    },
    "dgc_configs": {"rampup_begin_step": 0, "rampup_step": 1, "sparsity": [0.999]},
    "sharding_configs": {
        "sharding_segment_strategy": "segment_broadcast_MB",
        "segment_broadcast_MB": 32.0,
        "sharding_degree": 8,
        "gradient_merge_acc_step": 1,
        "optimize_offload": False,
        "dp_degree": 1,
        "mp_degree": 1,
        "pp_degree": 1,
        "pp_allreduce_in_optimize": False,
    },
}
SEED_001_SWITCHES = [
    "auto", "recompute", "pipeline", "gradient_merge", "lars", "lamb", "localsgd",
    "adaptive_localsgd", "amp", "dgc", "fp16_allreduce", "sharding",
]  # fmt: skip
SEED_003_DISTRIBUTED = {
    "auto": False,
    "a_sync": True,
    "sync_nccl_allreduce": True,
    "nccl_comm_num": 1,
    "use_hierarchical_allreduce": False,
    "hierarchical_allreduce_inter_nranks": 1,
    "sync_batch_norm": False,
    "fuse_all_reduce_ops": True,
    "fuse_grad_size_in_MB": 32,
    "fuse_grad_size_in_TFLOPS": 20.0,
    "cudnn_exhaustive_search": True,
    "conv_workspace_size_limit": 4000,
    "cudnn_batchnorm_spatial_persistent": True,
}
SEED_003_BUILD = {
    "enable_sequential_execution": False,
    "fuse_elewise_add_act_ops": False,
    "fuse_bn_act_ops": False,
    "fuse_relu_depthwise_conv": False,
    "fuse_broadcast_ops": False,
    "fuse_all_optimizer_ops": False,
    "enable_inplace": False,
    "enable_backward_optimizer_op_deps": True,
    "cache_runtime_context": False,
}
SEED_003_EXECUTION = {
    "num_threads": 1,
    "num_iteration_per_drop_scope": 10,
    "num_iteration_per_run": 3,
    "use_thread_barrier": False,
}
SEED_002_STRATEGY = {
    "sharding": {"enable": False, "stage": 1, "degree": 8},
    "gradient_merge": {"enable": False, "k_steps": 1, "avg": True},
    "fused_passes": {"enable": False, "gemm_epilogue": False, "dropout_add": False},
    "pipeline": {
        "enable": False,
        "schedule_mode": "1F1B",
        "micro_batch_size": 1,
        "accumulate_steps": 1,
    },
}


class TestDefaults:
    @pytest.mark.parametrize("switch", SEED_001_SWITCHES)
    def test_seed_001_switches_are_off(self, switch):
        assert getattr(DistributedStrategy(), switch) is False

    @pytest.mark.parametrize("name", sorted(SEED_001_CONFIGS))
    def test_seed_001_configs(self, name):
        config = getattr(DistributedStrategy(), name)
        for key, value in SEED_001_CONFIGS[name].items():
            assert config[key] == value, (name, key)

    @pytest.mark.parametrize("name", sorted(SEED_003_DISTRIBUTED))
    def test_seed_003_distributed_table(self, name):
        assert getattr(DistributedStrategy(), name) == SEED_003_DISTRIBUTED[name]

    def test_seed_003_build_and_execution_tables(self):
        s = DistributedStrategy()
        for strategy, table in (
            (s.build_strategy, SEED_003_BUILD),
            (BuildStrategy(), SEED_003_BUILD),
            (s.execution_strategy, SEED_003_EXECUTION),
            (ExecutionStrategy(), SEED_003_EXECUTION),
        ):
            assert {k: getattr(strategy, k) for k in table} == table

    def test_seed_002_strategy(self):
        s = Strategy()
        for section, keys in SEED_002_STRATEGY.items():
            for key, value in keys.items():
                assert getattr(s, section)[key] == value, (section, key)
        assert s.amp.enable is False and s.recompute.enable is False

    def test_hybrid_and_a_sync_configs(self):
        s = DistributedStrategy()
        assert {k: s.hybrid_configs[k] for k in ("dp_degree", "mp_degree", "pp_degree")} == {
            "dp_degree": -1,
            "mp_degree": 1,
            "pp_degree": 1,
        }
        assert s.hybrid_configs["sharding_degree"] == 1
        assert s.hybrid_configs["order"] == ["dp", "pp", "sharding", "sep", "cp", "mp"]
        assert s.hybrid_parallel_order == s.hybrid_configs["order"]
        assert s.a_sync_configs["k_steps"] == -1
        assert s.pipeline_configs["schedule_mode"] == "1F1B"

    def test_seed_differences_from_paddle_are_listed(self):
        listed = {
            path: (ours, paddle) for path, ours, paddle in fleetjax.seed_default_differences()
        }
        assert listed["amp_configs.decr_ratio"] == (0.5, 0.8)
        assert listed["dgc_configs.sparsity"] == ([0.999], [])
        assert listed["conv_workspace_size_limit"] == (4000, 512)
        assert set(listed) == {
            "amp_configs.decr_ratio",
            "dgc_configs.sparsity",
            "fuse_grad_size_in_TFLOPS",
            "cudnn_exhaustive_search",
            "conv_workspace_size_limit",
            "cudnn_batchnorm_spatial_persistent",
            "execution_strategy.num_iteration_per_run",
        }

    def test_default_repr_is_empty(self):
        assert repr(DistributedStrategy()) == "DistributedStrategy()"
        assert repr(Strategy()) == "Strategy()"


class TestConfigAssignment:
    def test_dict_updates_only_the_keys_given(self):
        s = DistributedStrategy()
        s.pipeline_configs = {"micro_batch_size": 4}
        s.pipeline_configs = {"accumulate_steps": 2}
        assert s.pipeline_configs["micro_batch_size"] == 4
        assert s.pipeline_configs["accumulate_steps"] == 2

    def test_list_replaces_the_old_list(self):
        s = DistributedStrategy()
        s.recompute_configs = {"checkpoints": ["x", "y"]}
        s.recompute_configs = {"checkpoints": ["c"]}
        assert s.recompute_configs["checkpoints"] == ["c"]

    def test_live_config_item_and_attribute_assignment(self):
        s = DistributedStrategy()
        s.amp_configs["init_loss_scaling"] = 1024.0
        s.hybrid_configs["pp_configs"].dp_comm_overlap = True
        s.hybrid_configs["mp_configs"]["sync_param"] = False
        assert s.amp_configs.init_loss_scaling == 1024.0
        assert s.hybrid_configs["pp_configs"]["dp_comm_overlap"] is True
        assert s.hybrid_configs["mp_configs"].sync_param is False

    def test_int_is_accepted_for_float(self):
        s = DistributedStrategy()
        s.amp_configs = {"init_loss_scaling": 1024}
        assert s.amp_configs["init_loss_scaling"] == 1024.0
        assert isinstance(s.amp_configs["init_loss_scaling"], float)

    def test_nested_dict_merges(self):
        s = DistributedStrategy()
        s.hybrid_configs = {"dp_degree": 2, "mp_configs": {"sync_param": False}}
        s.hybrid_configs = {"mp_configs": {"sync_grad": True}}
        assert s.hybrid_configs["dp_degree"] == 2
        assert s.hybrid_configs["mp_configs"]["sync_param"] is False
        assert s.hybrid_configs["mp_configs"]["sync_grad"] is True

    def test_paddle_test_case_10_hybrid_with_sync_param_name(self):
        s = DistributedStrategy()
        names = ["embedding", "layer_norm", ".w", ".b_"]
        s.hybrid_configs = {
            "dp_degree": 1,
            "mp_degree": 2,
            "pp_degree": 4,
            "mp_configs": {"sync_param": True, "sync_mode": "broadcast", "sync_param_name": names},
        }
        assert s.sync_param_name == names
        assert s.hybrid_configs["mp_configs"].sync_mode == "broadcast"

    def test_order_from_hybrid_configs(self):
        s = DistributedStrategy()
        s.hybrid_configs = {"order": ["sharding", "mp", "dp", "pp"]}
        assert s.hybrid_parallel_order == ["sharding", "mp", "dp", "pp"]

    def test_deleting_a_key_restores_the_default(self):
        s = DistributedStrategy()
        s.amp_configs = {"incr_ratio": 4.0}
        del s.amp_configs["incr_ratio"]
        assert s.amp_configs["incr_ratio"] == 2.0
        assert not s.amp_configs.is_set("incr_ratio")

    def test_returned_lists_refuse_in_place_changes(self):
        s = DistributedStrategy()
        s.recompute_configs = {"checkpoints": ["x"]}
        with pytest.raises(TypeError, match="assign a new list"):
            s.recompute_configs["checkpoints"].append("y")
        assert s.recompute_configs["checkpoints"] == ["x"]

    def test_build_strategy_object_is_copied_and_replaces(self):
        s = DistributedStrategy()
        s.build_strategy.fuse_broadcast_ops = True
        built = BuildStrategy(fuse_bn_act_ops=True)
        s.build_strategy = built
        built.fuse_bn_act_ops = False
        assert s.build_strategy.fuse_bn_act_ops is True
        assert s.build_strategy.fuse_broadcast_ops is False
        assert isinstance(s.build_strategy, BuildStrategy)
        assert isinstance(s.execution_strategy, ExecutionStrategy)

    def test_seed_003_build_fields_set_on_the_strategy_reach_build_strategy(self):
        s = DistributedStrategy()
        s.fuse_all_optimizer_ops = True
        s.fuse_bn_act_ops = True
        s.fuse_elewise_add_act_ops = True
        assert s.build_strategy.fuse_all_optimizer_ops is True
        assert s.build_strategy.fuse_bn_act_ops is True
        assert s.fuse_elewise_add_act_ops is True

    def test_paddle_property_names(self):
        s = DistributedStrategy()
        s._fuse_grad_size_in_TFLOPS = 25.0
        assert s.fuse_grad_size_in_TFLOPS == 25.0


class TestErrors:
    def test_unknown_config_key_names_key_and_lists_valid_keys(self):
        s = DistributedStrategy()
        with pytest.raises(fleetjax.UnknownFieldError) as info:
            s.gradient_merge_configs = {"k_step": 1}
        text = str(info.value)
        assert "'k_step'" in text and "gradient_merge_configs" in text
        assert "did you mean 'k_steps'" in text and "Valid names: k_steps, avg, mode" in text

    def test_unknown_nested_key_is_an_error(self):
        s = DistributedStrategy()
        with pytest.raises(fleetjax.UnknownFieldError, match="'nope' is not a field of"):
            s.hybrid_configs = {"mp_configs": {"nope": 1}}

    def test_renamed_paddle_2_0_key_explains(self):
        s = DistributedStrategy()
        with pytest.raises(fleetjax.UnknownFieldError, match="'accumulate_steps' since Paddle"):
            s.pipeline_configs = {"micro_batch": 12}

    def test_unknown_attribute(self):
        s = DistributedStrategy()
        with pytest.raises(AttributeError, match="'unknown_key' is not a field of Distributed"):
            s.unknown_key = "UNK"
        with pytest.raises(AttributeError):
            _ = s.unknown_key
        assert not hasattr(s, "unknown_key")

    @pytest.mark.parametrize(
        ("name", "value", "expected"),
        [
            ("amp", "True", "DistributedStrategy.amp must be bool, got str 'True'"),
            ("nccl_comm_num", "2", "DistributedStrategy.nccl_comm_num must be int, got str"),
            ("nccl_comm_num", 2.0, "DistributedStrategy.nccl_comm_num must be int, got float"),
            ("fp16_allreduce", 1, "DistributedStrategy.fp16_allreduce must be bool, got int"),
            ("fuse_grad_size_in_TFLOPS", "0.3", "must be float, got str"),
        ],
    )
    def test_wrong_type_raises_and_keeps_old_value(self, name, value, expected):
        s = DistributedStrategy()
        before = getattr(s, name)
        with pytest.raises(TypeError, match=expected):
            setattr(s, name, value)
        assert getattr(s, name) == before

    def test_wrong_type_in_configs_keeps_every_old_value(self):
        s = DistributedStrategy()
        s.amp_configs = {"incr_ratio": 3.0}
        with pytest.raises(TypeError, match=r"amp_configs.incr_every_n_steps must be int"):
            s.amp_configs = {"incr_ratio": 4.0, "incr_every_n_steps": 1.5}
        assert s.amp_configs["incr_ratio"] == 3.0
        with pytest.raises(TypeError, match=r"amp_configs.incr_ratio must be float, got str"):
            s.amp_configs = {"incr_ratio": "a"}

    def test_string_for_a_list_field(self):
        s = DistributedStrategy()
        with pytest.raises(TypeError, match="checkpoints must be a list of str, got str 'abc'"):
            s.recompute_configs = {"checkpoints": "abc"}

    def test_list_element_type(self):
        s = DistributedStrategy()
        with pytest.raises(TypeError, match=r"checkpoint_shape\[1\] must be int"):
            s.recompute_configs = {"checkpoint_shape": [2, "8"]}

    @pytest.mark.parametrize(
        ("config", "values", "expected"),
        [
            ("amp_configs", {"decr_ratio": 1.5}, "strictly between 0 and 1, got 1.5"),
            ("amp_configs", {"incr_ratio": 0.5}, "incr_ratio must be > 1"),
            ("gradient_merge_configs", {"k_steps": 0}, "k_steps must be >= 1, got 0"),
            ("sharding_configs", {"stage": 4}, "stage must be one of 1, 2, 3, got 4"),
            ("pipeline_configs", {"schedule_mode": "bogus"}, "schedule_mode must be one of"),
            ("hybrid_configs", {"dp_degree": 0}, "dp_degree must be -1 .* or >= 1, got 0"),
            ("hybrid_configs", {"order": ["dp", "xx"]}, r"order\[1\] must be one of 'dp'"),
            ("dgc_configs", {"sparsity": [0.5, 1.0]}, r"sparsity\[1\] must be in \[0, 1\)"),
        ],
    )
    def test_values_out_of_range(self, config, values, expected):
        s = DistributedStrategy()
        with pytest.raises(ValueError, match=expected):
            setattr(s, config, values)
        assert getattr(s, config).non_defaults() == {}

    def test_config_must_be_a_dict(self):
        with pytest.raises(TypeError, match="amp_configs must be a dict of amp_configs keys"):
            DistributedStrategy().amp_configs = [("init_loss_scaling", 1.0)]

    def test_int32_range(self):
        with pytest.raises(ValueError, match="must fit in int32"):
            DistributedStrategy().fuse_grad_size_in_MB = 2**40


class TestStrategy:
    def test_config_dict_sets_sections(self):
        s = Strategy({"sharding": {"enable": True, "stage": 2, "degree": 2}, "pipeline": {}})
        assert (s.sharding.enable, s.sharding.stage, s.sharding.degree) == (True, 2, 2)

    def test_paddle_doc_example(self):
        s = Strategy()
        s.sharding.enable = True
        s.sharding.stage = 2
        s.sharding.degree = 2
        s.gradient_merge.enable = True
        s.gradient_merge.k_steps = 2
        s.gradient_merge.avg = False
        s.pipeline.enable = True
        s.pipeline.schedule_mode = "1F1B"
        s.pipeline.micro_batch_size = 2
        assert s.to_dict()["gradient_merge"] == {
            "enable": True,
            "k_steps": 2,
            "avg": False,
            "mode": "in_step",
        }

    def test_unknown_section_and_key(self):
        with pytest.raises(fleetjax.UnknownFieldError, match="'shard' is not a field of Strat"):
            Strategy({"shard": {}})
        with pytest.raises(fleetjax.UnknownFieldError, match="'gemm_spilogue'.*typo"):
            Strategy().fused_passes.gemm_spilogue = True

    def test_stage_must_be_1_2_or_3(self):
        s = Strategy()
        with pytest.raises(ValueError, match="sharding.stage must be one of 1, 2, 3, got 0"):
            s.sharding.stage = 0
        assert s.sharding.stage == 1

    def test_config_must_be_a_dict(self):
        with pytest.raises(TypeError, match="must be set from a dict"):
            Strategy([1])

    def test_repr_shows_non_defaults(self):
        s = Strategy({"amp": {"enable": True, "dtype": "bfloat16"}})
        assert repr(s) == "Strategy(amp={'enable': True, 'dtype': 'bfloat16'})"


class TestValueSemantics:
    def test_repr_shows_fields_that_differ_from_defaults(self):
        s = DistributedStrategy()
        s.amp = True
        s.amp_configs = {"init_loss_scaling": 1024.0, "incr_ratio": 2.0}
        assert repr(s) == "DistributedStrategy(amp=True, amp_configs={'init_loss_scaling': 1024.0})"

    def test_copy_is_independent(self):
        s = DistributedStrategy()
        s.recompute_configs = {"checkpoints": ["x"]}
        for c in (copy.copy(s), copy.deepcopy(s), pickle.loads(pickle.dumps(s))):
            assert c == s
            c.recompute_configs = {"checkpoints": ["y"]}
            assert s.recompute_configs["checkpoints"] == ["x"]

    def test_config_equals_plain_dict(self):
        s = DistributedStrategy()
        expected = {"k_steps": 1, "avg": True, "mode": "across_calls"}
        assert s.gradient_merge_configs == expected
        assert dict(s.gradient_merge_configs) == expected
