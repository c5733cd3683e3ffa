"""A worker for tests/base/test_export.py, started by fleetjax.launch with 2 processes x 2 devices.

    export_worker.py DIR

Exports `tanh(x @ w)` with `w` split over a mesh axis that spans both processes (so no process
holds all of it) into DIR.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from fleetjax import fleet
from fleetjax.export import save_inference_model
from fleetjax.mesh import build_mesh

W = np.arange(32, dtype=np.float32).reshape(4, 8) / 32


def main(dirname: str) -> None:
    fleet.init(is_collective=True)
    sharding = NamedSharding(build_mesh(dp=1, mp=4), PartitionSpec(None, "mp"))
    w = jax.make_array_from_callback(W.shape, sharding, lambda index: W[index])
    assert not w.is_fully_addressable
    save_inference_model(dirname, lambda p, x: jnp.tanh(x @ p["w"]), {"w": w}, (W[:2, :4],))
    print("exported", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
