"""fleetjax.layers.MoELayer under every expert layout equals the dense one-device reference
(every expert on every token, masked by the top-k weights) in its output, its auxiliary losses
and every gradient, for uniform, Zipf-skewed and all-to-one routing, with no token dropped.

The routing is data (a `FixedGate`'s expert ids), so one compiled step per layout runs all
three routings."""

import jax
import pytest
from jax.sharding import AxisType
from moe_models import ROUTINGS, assert_close, dense_reference, inputs, make_layer, run

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
    "ep2_etp2_explicit": ((2, 2, 2), ("dp", "ep", "mp"), {}),
}
# One layout of each form in the default run (ep = 1 runs in the other tests' steps too).
DEFAULT = ("ep8", "ep4_folded", "allgather_ep2_etp2", "ep2_etp2_explicit")


def mesh_of(layout: str) -> jax.sharding.Mesh:
    shape, names, _ = LAYOUTS[layout]
    kind = AxisType.Explicit if layout.endswith("explicit") else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape))


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
