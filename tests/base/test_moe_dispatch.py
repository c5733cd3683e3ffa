"""The MoE dispatch's other modes: capacity drops exactly as configured (per device, by
probability or by position) and counts what it dropped; experts without a grouped matmul run
tile by tile; recompute changes nothing but memory."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from moe_models import (
    D_MODEL,
    EXPERTS,
    HIDDEN,
    TOP_K,
    PaddleExpert,
    assert_close,
    dense_reference,
    inputs,
    make_layer,
    routing_ids,
    run,
)

MESH = ((2, 4), ("dp", "ep"))  # 8 devices of 4 tokens each: the capacity counts a device's


def mesh():
    shape, names = MESH
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


def dropped_by_capacity(ids, weights, capacity, policy, devices=8):
    """Megatron's capacity by hand: on each device's tokens, each expert keeps its first
    `capacity` assignments by position, or those of highest weight."""
    kept = ids.copy()
    for block in np.split(np.arange(len(ids)), devices):
        flat = [(t, j) for t in block for j in range(TOP_K)]
        for expert in range(EXPERTS):
            mine = [(t, j) for t, j in flat if ids[t, j] == expert]
            if policy == "probs":
                mine.sort(key=lambda tj: -weights[tj])  # stable: ties by position
            for t, j in mine[capacity:]:
                kept[t, j] = -1
    return kept


@pytest.mark.parametrize("policy", ["probs", pytest.param("position", marks=pytest.mark.slow)])
def test_capacity_drops_exactly_as_configured_and_counts_it(policy):
    x, cotangent = inputs()
    ids = routing_ids("zipf")
    layer = make_layer(ids, capacity_factor=1.0, drop_policy=policy)
    # 4 tokens x top-2 over 8 experts a device: capacity ceil(1.0 x 8 / 8) = 1 an expert.
    weights = np.asarray(layer.gate.route(x.reshape(-1, x.shape[-1])).weights)
    kept = dropped_by_capacity(ids, weights, 1, policy)
    out, found, grads = run(layer, x, cotangent, mesh())
    reference = make_layer(ids, kept=kept)
    expected, losses, expected_grads = run(reference, x, cotangent, forward=dense_reference)
    assert int(found["dropped"]) == int(np.sum(kept < 0)) > 0
    assert_close(out, expected)
    assert_close({k: found[k] for k in losses}, losses)  # over the gate's routing, undropped
    assert_close(grads, expected_grads)


def test_experts_without_a_grouped_matmul_run_tile_by_tile_beside_a_shared_expert():
    x, cotangent = inputs()
    shared = PaddleExpert(D_MODEL, HIDDEN, rngs=nnx.Rngs(5))
    layer = make_layer("zipf", expert=PaddleExpert, shared_expert=shared)
    out, _, grads = run(layer, x, cotangent, mesh())
    expected, _, expected_grads = run(layer, x, cotangent, forward=dense_reference)
    assert_close(out, expected)
    assert_close(grads, expected_grads)


@pytest.mark.slow
def test_grouped_gemm_off_and_recompute_give_the_same_numbers():
    x, cotangent = inputs()
    out, _, grads = run(make_layer("zipf"), x, cotangent, mesh())
    for options in ({"grouped_gemm": False}, {"recompute_interval": 1}):
        other, _, other_grads = run(make_layer("zipf", **options), x, cotangent, mesh())
        assert_close(other, out)
        assert_close(other_grads, grads)
