"""fleetjax.layers.MoELayer under every expert layout equals the dense one-device reference
(every expert on every token, masked by the top-k weights) in its output, its auxiliary losses
and every gradient, for uniform, Zipf-skewed and all-to-one routing, with no token dropped.

The routing is data (a `FixedGate`'s expert ids), so one compiled step per layout runs all
three routings."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from moe_models import ROUTINGS, dense_reference, inputs, make_layer

from fleetjax.layers import partition_specs

# name: (mesh shape, mesh axes, layer options)
LAYOUTS = {
    "ep1": ((8,), ("dp",), {}),
    "ep2": ((4, 2), ("dp", "ep"), {}),
    "ep4": ((2, 4), ("dp", "ep"), {}),
    "ep8": ((8,), ("ep",), {}),
    "ep2_etp2": ((2, 2, 2), ("dp", "ep", "mp"), {}),
    "ep4_folded": ((2, 2, 2), ("dp", "ep", "mp"), {"moe_group": ("ep", "mp")}),
    "allgather_ep4": ((2, 4), ("dp", "ep"), {"dispatcher": "allgather"}),
    "allgather_ep2_etp2": ((2, 2, 2), ("dp", "ep", "mp"), {"dispatcher": "allgather"}),
}
DEFAULT = ("ep1", "ep8", "ep2_etp2", "ep4_folded", "allgather_ep2_etp2")


def split(layer):
    """The layer's graph, and its parameters and other state as pure dicts (fleetjax's loss
    functions take them so; `nnx.merge` makes the variables anew in the traced function)."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(rest)


@functools.cache
def step(graphdef, forward):
    """value_and_grad of <output, cotangent> + the aux losses, by parameters and input."""

    def loss(params, x, rest, cotangent):
        out, losses = forward(nnx.merge(graphdef, params, rest), x)
        return jnp.sum(out * cotangent) + sum(losses.values()), (out, losses)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def layer_forward(layer, x):
    out, stats = layer.call_with_stats(x)
    return out, {**stats.losses, "dropped": stats.dropped, "rounds": stats.rounds}


def run(layer, x, cotangent, mesh=None, forward=layer_forward):
    """(output, losses, gradients), compiled on `mesh` with the parameters placed by their
    rules."""
    graphdef, params, rest = split(layer)
    if mesh is None:
        (_, (out, losses)), grads = step(graphdef, forward)(params, x, rest, cotangent)
        return out, losses, grads
    with jax.set_mesh(mesh):
        specs = nnx.to_pure_dict(partition_specs(nnx.state(layer, nnx.Param), mesh=mesh))
        placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        (_, (out, losses)), grads = step(graphdef, forward)(placed, x, rest, cotangent)
    return out, losses, grads


def mesh_of(layout: str) -> jax.sharding.Mesh:
    shape, names, _ = LAYOUTS[layout]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def assert_close(actual, expected):
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
    "layout", [pytest.param(n, marks=() if n in DEFAULT else pytest.mark.slow) for n in LAYOUTS]
)
def test_layer_equals_the_dense_reference(layout):
    x, cotangent = inputs()
    for routing in ROUTINGS:
        layer = make_layer(routing, **LAYOUTS[layout][2])
        out, found, grads = run(layer, x, cotangent, mesh_of(layout))
        plain = make_layer(routing)  # the same parameters and routing
        expected, losses, expected_grads = run(plain, x, cotangent, forward=dense_reference)
        assert_close(out, expected)
        assert_close({k: found[k] for k in losses}, losses)
        assert_close(grads, expected_grads)
        assert int(found["dropped"]) == 0, routing
        if routing == "all_to_one" and "allgather" not in layout and layout != "ep1":
            assert int(found["rounds"]) > 1  # past the buffer: overflow rounds, none dropped
