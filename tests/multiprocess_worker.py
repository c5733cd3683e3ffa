"""One worker of tests/facade/test_multiprocess.py: run with the PADDLE_* variables set.

Joins the other workers with fleet.init(), checks roles, the barrier and fleet.util, then
trains data-parallel on the global mesh and checks the losses against plain JAX on one device.
Prints one line per check; exits non-zero on the first failure.
"""

import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", int(os.environ["WORKER_CPU_DEVICES"]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fleetjax  # noqa: E402
from fleetjax import fleet  # noqa: E402


def loss_fn(params, batch):
    logits = jnp.tanh(batch["x"] @ params["w"]) @ params["v"]
    return jnp.mean((logits - batch["y"]) ** 2)


def main() -> None:
    if "WORKER_SELF_INIT_RANK" in os.environ:  # as under srun/mpirun: no PADDLE_* variables
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=2,
            process_id=int(os.environ["WORKER_SELF_INIT_RANK"]),
        )
    fleet.init(is_collective=True)
    rank, count = fleet.worker_index(), fleet.worker_num()
    local = int(os.environ["WORKER_CPU_DEVICES"])
    assert jax.process_count() == count and jax.process_index() == rank
    assert len(jax.devices()) == count * local, jax.devices()
    print(f"roles ok: worker {rank} of {count}, {len(jax.devices())} global devices")

    # The fastest-varying axis (mp) stays within a process (host); dp crosses processes.
    mesh = fleetjax.build_mesh(mp=local)
    owners = np.vectorize(lambda d: d.process_index)(mesh.devices).reshape(count, local)
    assert (owners == np.arange(count)[:, None]).all(), owners

    fleet.barrier_worker()
    total = fleet.util.all_reduce(rank + 1)
    assert total == count * (count + 1) // 2, total
    assert fleet.util.all_reduce([rank, 1], mode="max") == [count - 1, 1]
    assert fleet.util.all_gather(rank) == list(range(count))
    files = fleet.util.get_file_shard([f"part-{i}" for i in range(5)])
    print(f"util ok: sum {total}, files {files}")

    rng = np.random.RandomState(0)
    params = {"w": rng.randn(8, 16).astype(np.float32), "v": rng.randn(16, 1).astype(np.float32)}
    data = {"x": rng.randn(32, 8).astype(np.float32), "y": rng.randn(32, 1).astype(np.float32)}
    rows = len(data["x"]) // count
    mine = {k: v[rank * rows : (rank + 1) * rows] for k, v in data.items()}

    step = fleetjax.make_train_step(loss_fn, fleet.distributed_optimizer(optax.adam(0.05)))
    state = step.init(params)
    losses = []
    for _ in range(3):
        state, metrics = step(state, mine)
        losses.append(float(metrics["loss"]))
    hlo = step.lower(state, mine).compile().as_text()
    assert "all-reduce" in hlo

    with jax.default_device(jax.local_devices()[0]):
        tx, ref = optax.adam(0.05), params
        opt_state, expected = tx.init(ref), []
        for _ in range(3):
            loss, grads = jax.value_and_grad(loss_fn)(ref, data)
            updates, opt_state = tx.update(grads, opt_state, ref)
            ref = optax.apply_updates(ref, updates)
            expected.append(float(loss))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    print(f"train ok: losses {losses}")
    fleet.barrier_worker()


if __name__ == "__main__":
    main()
    sys.exit(0)
