"""Seed 001 (`fleet.DistributedStrategy`, the full reference), part 1: `save_to_prototxt` /
`load_from_prototxt`, `execution_strategy`, `build_strategy` and `auto`, with fleetjax's imports,
each trained for a few steps on the digits MLP.

    python examples/seeds/001_prototxt_and_programs.py   # 8 simulated CPU devices
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # without an accelerator: 8 CPU devices

from models import PIPELINE_MLP, digits, pipeline_params, train

import fleetjax as paddle  # import paddle
import fleetjax.fleet as fleet  # import paddle.distributed.fleet as fleet
from fleetjax import optimizers

print("save_to_prototxt")
strategy = fleet.DistributedStrategy()
strategy.dgc = True
strategy.recompute = True
strategy.recompute_configs = {"checkpoints": ["x"]}
strategy.save_to_prototxt("dist_strategy.prototxt")

print("load_from_prototxt")
strategy = fleet.DistributedStrategy()
strategy.load_from_prototxt("dist_strategy.prototxt")
fleet.init(is_collective=True, strategy=strategy)
train(fleet.distributed_optimizer(optimizers.Momentum(learning_rate=0.1)))

print("execution_strategy")
exe_strategy = paddle.ExecutionStrategy()  # paddle.static.ExecutionStrategy()
exe_strategy.num_threads = 10
exe_strategy.num_iteration_per_drop_scope = 10
exe_strategy.num_iteration_per_run = 10

strategy = paddle.fleet.DistributedStrategy()  # paddle.distributed.fleet.DistributedStrategy()
strategy.execution_strategy = exe_strategy
fleet.init(is_collective=True, strategy=strategy)
# num_iteration_per_run: TrainStep.run takes 10 steps in one compiled call.
step = paddle.make_train_step(PIPELINE_MLP, fleet.distributed_optimizer(optimizers.SGD(0.1)))
state, metrics = step.run(step.init(pipeline_params()), list(digits(64, 10)))
print("  10 steps in one call, losses", " ".join(f"{loss:.4f}" for loss in metrics["loss"]))

print("build_strategy")
build_strategy = paddle.BuildStrategy()  # paddle.static.BuildStrategy()
build_strategy.enable_sequential_execution = True
build_strategy.fuse_elewise_add_act_ops = True
build_strategy.fuse_bn_act_ops = True
build_strategy.enable_auto_fusion = True
build_strategy.fuse_relu_depthwise_conv = True
build_strategy.fuse_broadcast_ops = True
build_strategy.fuse_all_optimizer_ops = True
build_strategy.enable_inplace = True

strategy = paddle.fleet.DistributedStrategy()
strategy.build_strategy = build_strategy
fleet.init(is_collective=True, strategy=strategy)
train(fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.01)))

print("auto")
# paddle.enable_static(): JAX compiles every step; there is no mode to switch.
strategy = fleet.DistributedStrategy()
strategy.auto = True
# if set other strategy at the same time, auto will not apply
# strategy.amp = True

optimizer = optimizers.SGD(learning_rate=0.01)  # paddle.optimizer.SGD(learning_rate=0.01)
optimizer = fleet.distributed_optimizer(optimizer, strategy)
# Paddle plans when it builds the program; fleetjax.auto.search compiles the candidate layouts.
found = paddle.auto.search(PIPELINE_MLP, optimizer, pipeline_params(), next(digits(64, 1)))
print(" ", found.reason)
