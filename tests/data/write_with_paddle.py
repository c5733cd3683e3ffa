"""Writes the paddle*.prototxt files here with the installed Paddle (2.x or 3.x).

pip install paddlepaddle==3.3.1          # or ==2.6.2 with protobuf==3.20.3
python tests/data/write_with_paddle.py tests/data
"""

import sys

import paddle
import paddle.distributed.fleet as fleet

out, major = sys.argv[1], paddle.__version__.split(".")[0]
tag = f"paddle{paddle.__version__}"


def save(name, s):
    s.save_to_prototxt(f"{out}/{tag}_{name}.prototxt")


# seed 001, save_to_prototxt example
s = fleet.DistributedStrategy()
s.dgc = True
s.recompute = True
s.recompute_configs = {"checkpoints": ["x"]}
save("seed001_example", s)

# seed 003, ResNet50 practice (execution_strategy only exists in 2.x)
s = fleet.DistributedStrategy()
s.sync_nccl_allreduce = True
s.nccl_comm_num = 2
s.fuse_all_reduce_ops = True
bs = paddle.static.BuildStrategy()
if major == "2":
    bs.enable_sequential_execution = True
bs.fuse_elewise_add_act_ops = True
bs.fuse_bn_act_ops = True
bs.enable_auto_fusion = True
bs.fuse_all_optimizer_ops = True
s.build_strategy = bs
if major == "2":
    es = paddle.static.ExecutionStrategy()
    es.num_threads = 3
    es.num_iteration_per_drop_scope = 100
    es.num_iteration_per_run = 1
    s.execution_strategy = es
s.amp = True
s.amp_configs = {
    "init_loss_scaling": 128,
    "decr_every_n_nan_or_inf": 2,
    "incr_every_n_steps": 1000,
    "incr_ratio": 2.0,
    "use_dynamic_loss_scaling": True,
    "decr_ratio": 0.5,
    "custom_white_list": [],
    "custom_black_list": [],
}
save("seed003_resnet", s)

# hybrid parallel with nested configs, and most *_configs blocks
s = fleet.DistributedStrategy()
s.hybrid_configs = {
    "dp_degree": 2,
    "mp_degree": 2,
    "pp_degree": 2,
    "sharding_degree": 1,
    "mp_configs": {"sync_param": False},
}
s.pipeline = True
s.pipeline_configs = {"micro_batch_size": 2, "accumulate_steps": 4, "schedule_mode": "F-then-B"}
s.sharding_configs = {
    "sharding_degree": 2,
    "dp_degree": 4,
    "segment_broadcast_MB": 16.5,
    "stage": 2,
}
s.lars = True
s.lars_configs = {
    "lars_coeff": 0.002,
    "lars_weight_decay": 0.0001,
    "epsilon": 1e-8,
    "exclude_from_weight_decay": ["batch_norm", ".b"],
}
s.lamb_configs = {"lamb_weight_decay": 0.02, "exclude_from_weight_decay": ["bias"]}
s.dgc_configs = {"rampup_begin_step": 1252, "rampup_step": 100, "sparsity": [0.75, 0.9375, 0.999]}
s.localsgd_configs = {"k_steps": 4, "begin_step": 30}
s.adaptive_localsgd_configs = {"init_k_steps": 2, "begin_step": 30}
s.gradient_merge = True
s.gradient_merge_configs = {"k_steps": 4, "avg": False}
s.recompute_configs = {
    "checkpoints": ["x", "y"],
    "enable_offload": True,
    "checkpoint_shape": [100, 512, 1024],
}
s.fp16_allreduce = True
s.a_sync = False
s.fuse_grad_size_in_MB = 16
s._fuse_grad_size_in_TFLOPS = 25.0
s.use_hierarchical_allreduce = True
s.hierarchical_allreduce_inter_nranks = 8
s.sync_batch_norm = True
s.cudnn_exhaustive_search = True
s.conv_workspace_size_limit = 4000
s.cudnn_batchnorm_spatial_persistent = True
s.last_comm_group_size_MB = 2.5
save("hybrid_everything", s)
print("wrote", tag)
