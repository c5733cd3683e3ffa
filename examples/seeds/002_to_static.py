"""Seed 002 (`paddle.distributed.Strategy`) through `dist.to_static`, as Paddle's docs use a
`Strategy`: the class's own example (ZeRO stage 2 over 2 devices, gradient merge over 2 steps,
summed, a 1F1B pipeline of micro-batches of 2) applied to the digits MLP, a Paddle-style
`nn.Layer` whose hidden blocks `dist.parallelize` cuts into the pipeline's stages, on a
`ProcessMesh` of 2 x 2 x 2 devices.

    python examples/seeds/002_to_static.py   # 8 simulated CPU devices
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # without an accelerator: 8 CPU devices

import numpy as np
from flax import nnx
from models import digits

import fleetjax as paddle  # import paddle
import fleetjax.distributed as dist  # import paddle.distributed as dist

strategy = dist.Strategy()
strategy.sharding.enable = True
strategy.sharding.stage = 2
strategy.sharding.degree = 2
strategy.gradient_merge.enable = True
strategy.gradient_merge.k_steps = 2
strategy.gradient_merge.avg = False
strategy.pipeline.enable = True
strategy.pipeline.schedule_mode = "1F1B"  # default is "1F1B"
strategy.pipeline.micro_batch_size = 2


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(32, 32, rngs=rngs)

    def __call__(self, x):
        return paddle.nn.functional.relu(self.linear(x))


class MLP(paddle.nn.Layer):  # class MLP(paddle.nn.Layer), with flax nnx's layers
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.embed = nnx.Linear(64, 32, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(4)])
        self.head = nnx.Linear(32, 10, rngs=rngs)

    def forward(self, x):
        x = paddle.nn.functional.relu(self.embed(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


# ZeRO over 'sharding', the batch over 'dp' (and 'sharding'), the blocks' stages over 'pp'.
mesh = dist.ProcessMesh(np.arange(8).reshape(2, 2, 2), dim_names=["dp", "sharding", "pp"])
model, _ = dist.parallelize(MLP(), mesh=mesh, config={"pp_config": {"split_spec": "blocks"}})
optimizer = dist.shard_optimizer(
    paddle.optimizers.Adam(learning_rate=0.01, parameters=model.parameters()),
    dist.ShardingStage2("sharding", mesh),
)
batches = [(b["x"], b["label"]) for b in digits(batch_size=16, steps=4)]
loader = dist.shard_dataloader(batches, meshes=mesh, shard_dims="dp")

dm = dist.to_static(model, loader, paddle.nn.CrossEntropyLoss(), optimizer, strategy=strategy)
dm.train()
losses = [float(dm(x, y)) for x, y in loader()]
step = dm.trainer.train_step
print(paddle.applied_strategy(step.strategy, step.mesh))
print("  losses", " ".join(f"{loss:.4f}" for loss in losses))
