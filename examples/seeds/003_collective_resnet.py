"""Seed 003 ("Collective synchronous training in practice"): its ResNet50 example with
fleetjax's imports and the digits MLP in place of the ResNet50 and ImageNet: Paddle's
environment flags, then `fleet.init`, the strategy (fused all-reduce, build and execution
strategies, AMP), saved to a prototxt file, and the training loop printing Paddle's line.

    python examples/seeds/003_collective_resnet.py   # 8 simulated CPU devices
    fleetjax-run --nproc_per_node 2 --cpu_devices_per_proc 4 examples/seeds/003_collective_resnet.py
"""

import os

os.environ["FLAGS_fuse_parameter_memory_size"] = "16"  # noqa: SIM112 (Paddle's names)
os.environ["FLAGS_fuse_parameter_groups_size"] = "50"  # noqa: SIM112 (Paddle's names)
os.environ["FLAGS_fraction_of_gpu_memory_to_use"] = "0.7"  # noqa: SIM112 (Paddle's names)
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # without an accelerator: 8 CPU devices

import time

from models import PIPELINE_MLP, digits, pipeline_params

import fleetjax as fluid  # import paddle.fluid as fluid
import fleetjax as paddle  # import paddle
import fleetjax.fleet as fleet  # import paddle.distributed.fleet as fleet

# paddle.enable_static(): JAX compiles every step; there is no mode to switch.
fleet.init(is_collective=True)

model = PIPELINE_MLP  # X.applications.Resnet50(): the loss of the digits MLP
batch_size = 32
loader = digits(batch_size, steps=10)  # model.get_train_dataloader(local_path, batch_size)

dist_strategy = fleet.DistributedStrategy()

# distributed strategy
dist_strategy.sync_nccl_allreduce = True
dist_strategy.nccl_comm_num = 2
dist_strategy.fuse_all_reduce_ops = True

# build strategy
build_strategy = fluid.BuildStrategy()
build_strategy.enable_sequential_execution = True
build_strategy.fuse_elewise_add_act_ops = True
build_strategy.fuse_bn_act_ops = True
build_strategy.enable_auto_fusion = True
build_strategy.fuse_all_optimizer_ops = True
dist_strategy.build_strategy = build_strategy

# execute strategy
execution_strategy = fluid.ExecutionStrategy()
execution_strategy.num_threads = 3
execution_strategy.num_iteration_per_drop_scope = 100
execution_strategy.num_iteration_per_run = 1
dist_strategy.execution_strategy = execution_strategy

# amp
dist_strategy.amp = True
dist_strategy.amp_configs = {
    "init_loss_scaling": 128,
    "decr_every_n_nan_or_inf": 2,
    "incr_every_n_steps": 1000,
    "incr_ratio": 2.0,
    "use_dynamic_loss_scaling": True,
    "decr_ratio": 0.5,
    "custom_white_list": [],
    "custom_black_list": [],
}

dist_strategy.save_to_prototxt("dist_strategy.prototxt")

optimizer = fluid.optimizers.Momentum(learning_rate=0.01, momentum=0.9)  # fluid.optimizer
optimizer = fleet.distributed_optimizer(optimizer, dist_strategy)
step = paddle.make_train_step(model, optimizer)  # optimizer.minimize(model.loss)

# place = fluid.CUDAPlace(...); exe = fluid.Executor(place): the step places on fleet.mesh.
state = step.init(pipeline_params())  # exe.run(fluid.default_startup_program())

for i, data in enumerate(loader):
    start_time = time.time()
    # cost_val = exe.run(model.main_prog, feed=data, fetch_list=[model.loss.name])
    state, metrics = step(state, data)
    cost_val = [float(metrics["loss"])]

    end_time = time.time()
    print(
        "worker_index: %d, step%d cost = %f, speed: %f"  # noqa: UP031 (the seed's line)
        % (fleet.worker_index(), i, cost_val[0], batch_size / (end_time - start_time))
    )
