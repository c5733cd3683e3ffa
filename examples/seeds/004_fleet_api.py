"""Seed 004 (the `fleet.Fleet` API): its examples with fleetjax's imports and flax nnx layers in
place of Paddle's: `init`, the role queries, `barrier_worker`, the parameter-server calls (which
warn in a process alone and raise in a launched collective job, as Paddle's do),
`distributed_optimizer`, `distributed_model` with Paddle's dygraph loop (`loss =
loss_fn(dp_layer(inputs), labels); loss.backward(); adam.step(); adam.clear_grad()`, as written),
`state_dict` / `set_state_dict`, `set_lr` / `get_lr`, `save_inference_model` and
`save_persistables`. It writes into the working directory, as the
seed does.

    python examples/seeds/004_fleet_api.py   # 2 simulated CPU devices, as fleetrun --gpus=0,1
"""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")  # the seed's `fleetrun --gpus=0,1`

import pickle

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import fleetjax.fleet as fleet  # import paddle.distributed.fleet as fleet
from fleetjax import nn, optimizers  # import paddle.nn as nn; paddle.optimizer

print("init")
fleet.init()
fleet.init(is_collective=True)
role = fleet.PaddleCloudRoleMaker()
fleet.init(role)

print("roles")
print("  is_first_worker", fleet.is_first_worker())
print("  worker_index", fleet.worker_index())
print("  worker_num", fleet.worker_num())
print("  is_worker", fleet.is_worker())
print("  worker_endpoints", fleet.worker_endpoints())
print("  server_num", fleet.server_num())
print("  server_index", fleet.server_index())
print("  server_endpoints", fleet.server_endpoints())
print("  is_server", fleet.is_server())
fleet.barrier_worker()

print("init_worker, init_server, run_server, stop_worker")
# Run alone (as here), Paddle's calls warn and return; launched in collective mode they raise.
for call in (fleet.init_worker, fleet.init_server, fleet.run_server, fleet.stop_worker):
    try:
        call()
    except ValueError as e:  # Paddle's error in collective mode (fleetjax's default)
        print(f"  {call.__name__}: {e}")

print("distributed_optimizer")
role = fleet.role_maker.PaddleCloudRoleMaker(is_collective=True)
fleet.init(role)
strategy = fleet.DistributedStrategy()
optimizer = optimizers.SGD(learning_rate=0.001)  # paddle.optimizer.SGD(learning_rate=0.001)
optimizer = fleet.distributed_optimizer(optimizer, strategy=strategy)

print("distributed_model, step, clear_grad")
# Seed 004's dygraph example as written, with only its imports (above) and its model changed:
# paddle.nn -> fleetjax.nn (Paddle's loss layers), nn.Layer -> nnx.Module, and paddle.randn ->
# numpy.


class LinearNet(nnx.Module):  # nn.Layer
    def __init__(self):
        self._linear1 = nnx.Linear(10, 10, rngs=nnx.Rngs(0))  # nn.Linear(10, 10)
        self._linear2 = nnx.Linear(10, 1, rngs=nnx.Rngs(1))

    def __call__(self, x):  # forward
        return self._linear2(self._linear1(x))

    def parameters(self):  # nn.Layer.parameters()
        return nnx.state(self, nnx.Param)


# 1. enable dynamic mode: paddle.disable_static(); JAX has one mode

# 2. initialize fleet environment
fleet.init(is_collective=True)

# 3. create layer & optimizer
layer = LinearNet()
loss_fn = nn.MSELoss()
adam = optimizers.Adam(learning_rate=0.001, parameters=layer.parameters())

# 4. get data_parallel model using fleet
adam = fleet.distributed_optimizer(adam)
dp_layer = fleet.distributed_model(layer)

# 5. run layer
inputs = np.random.randn(10, 10).astype("float32")  # paddle.randn([10, 10], 'float32')
outputs = dp_layer(inputs)
labels = np.random.randn(10, 1).astype("float32")  # paddle.randn([10, 1], 'float32')
loss = loss_fn(outputs, labels)

print("loss:", loss.numpy())

loss.backward()

adam.step()
adam.clear_grad()

print("state_dict, set_state_dict")
fleet.init(is_collective=True)

value = np.arange(26).reshape(2, 13).astype("float32")
a = jnp.asarray(value)  # paddle.fluid.dygraph.to_variable(value)

layer = nnx.Linear(13, 5, rngs=nnx.Rngs(0))  # paddle.nn.Linear(13, 5)
adam = optimizers.Adam(learning_rate=0.01, parameters=nnx.state(layer, nnx.Param))

adam = fleet.distributed_optimizer(adam)
dp_layer = fleet.distributed_model(layer)
state_dict = adam.state_dict()
with open("paddle_dy", "wb") as f:  # paddle.framework.save(state_dict, "paddle_dy")
    pickle.dump(jax.device_get(state_dict), f)
with open("paddle_dy", "rb") as f:  # para_state_dict, opti_state_dict = paddle.framework.load(...)
    opti_state_dict = pickle.load(f)
adam.set_state_dict(opti_state_dict)
print("  state_dict before the first step:", state_dict)

print("set_lr")
fleet.init(is_collective=True)
layer = nnx.Linear(13, 5, rngs=nnx.Rngs(0))
adam = optimizers.Adam(learning_rate=0.01, parameters=nnx.state(layer, nnx.Param))
adam = fleet.distributed_optimizer(adam)
dp_layer = fleet.distributed_model(layer)

lr_list = [0.2, 0.3, 0.4, 0.5, 0.6]
for i in range(5):
    adam.set_lr(lr_list[i])
    lr = adam.get_lr()
    print("current lr is {}".format(lr))  # noqa: UP032 (the seed's line)

print("get_lr")
fleet.init(is_collective=True)
layer = nnx.Linear(13, 5, rngs=nnx.Rngs(0))
adam = optimizers.Adam(learning_rate=0.01, parameters=nnx.state(layer, nnx.Param))
adam = fleet.distributed_optimizer(adam)
dp_layer = fleet.distributed_model(layer)

lr = adam.get_lr()
print(lr)  # 0.01

print("save_inference_model, save_persistables")
fleet.init()

layer = LinearNet()  # build net
adam = fleet.distributed_optimizer(optimizers.Adam(learning_rate=0.001))
dp_layer = fleet.distributed_model(layer)
adam.minimize(loss_fn(dp_layer(inputs), labels))  # a static program's minimize(loss): one step

exe = None  # fluid.Executor(fluid.CPUPlace()): JAX has none (fleetjax warns if one is given)


def predict(model, feeds):  # acc, loss: the outputs, as functions of the model and the feeds
    return model(feeds["inputs"])


def loss(model, feeds):
    return loss_fn(model(feeds["inputs"]), feeds["labels"])


# The feeds are the named arrays of a batch dict: the model's last training batch gives their
# shapes, so the loss of this section trains on {"inputs": ..., "labels": ...}.
adam.minimize(loss, {"inputs": inputs, "labels": labels})
fleet.save_inference_model(exe, "dirname", ["inputs", "labels"], [predict, loss])
fleet.save_persistables(exe, "dirname_persistables")
exported = fleet.load_inference_model("dirname")
print("  exported model, 3 rows:", [out.shape for out in exported(inputs[:3], labels[:3])])
restored = fleet.load_persistables("dirname_persistables", fleet.trainer.state)
print("  saved step", int(restored.step))
