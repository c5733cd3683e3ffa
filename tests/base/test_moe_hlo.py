"""A MoE layer's all-to-all bytes, read from the compiled HLO on the CPU mesh, equal
`all_to_all_bytes` (the first round at the top level; overflow rounds in a loop of their own),
and only the allgather dispatcher all-gathers the tokens."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from hlo import collectives, computations
from jax.sharding import AxisType
from moe_models import D_MODEL, EXPERTS, TOP_K, make_layer, split

from fleetjax.layers import all_to_all_bytes

TOKENS = 128  # global: [8, 16]
ITEMSIZE = 4


def compiled(layer, mesh, grad):
    graphdef, params, rest = split(layer)
    x = jnp.zeros((8, TOKENS // 8, D_MODEL))

    def loss(params, x):
        return jnp.sum(nnx.merge(graphdef, params, rest).call_with_stats(x)[0])

    fn = jax.grad(loss, argnums=(0, 1)) if grad else loss
    with jax.set_mesh(mesh):
        return jax.jit(fn).lower(params, x).compile().as_text()


def all_to_alls(text):
    """(the top level's float all-to-alls' bytes sent to other devices, the int32 ones', the
    loops' float all-to-all result shapes)."""
    parts = computations(text)
    top = [c for c in collectives(parts["ENTRY"]) if c.op == "all-to-all"]
    looped = [
        c
        for name, body in parts.items()
        if name != "ENTRY"
        for c in collectives(body)
        if c.op == "all-to-all"
    ]
    sent = lambda found, kind: [  # noqa: E731
        c.result_bytes * (c.group_size - 1) // c.group_size for c in found if c.arrays[0][0] == kind
    ]
    return sent(top, "f32"), sent(top, "s32"), sent(looped, "f32")


def mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))


@pytest.mark.parametrize(
    "grad", [pytest.param(False, marks=pytest.mark.slow), True], ids=["forward", "step"]
)
def test_dropless_sends_the_buffer_each_way_and_overflow_rounds_in_a_loop(grad):
    text = compiled(make_layer("router"), mesh((8,), ("ep",)), grad)
    assert not [c for c in collectives(text) if c.op == "all-gather"]
    found, counts, looped = all_to_alls(text)
    each_way = all_to_all_bytes(TOKENS // 8, D_MODEL, TOP_K, EXPERTS, 8, itemsize=ITEMSIZE)
    # 16 tokens x top-2 a device: 32 rows, a buffer of 8 x ceil(1.25 x 32 / 8) = 40 rows
    assert each_way == 40 * D_MODEL * ITEMSIZE * 7 // 8
    assert found == [each_way] * (4 if grad else 2)  # dispatch, combine (and their gradients)
    assert counts == [EXPERTS * 4 * 7 // 8]  # the experts' counts, once
    # the overflow rounds: forward 2 a round; backward the rows with their gradients (2 H
    # wide) and the rows' gradients back
    assert sorted(looped) == sorted([each_way] * 2 + ([2 * each_way, each_way] if grad else []))


@pytest.mark.parametrize(
    "grad", [pytest.param(False, marks=pytest.mark.slow), True], ids=["forward", "step"]
)
def test_capacity_sends_cf_t_k_h_b_each_way(grad):
    layer = make_layer("router", capacity_factor=1.5)
    found, counts, looped = all_to_alls(compiled(layer, mesh((8,), ("ep",)), grad))
    each_way = all_to_all_bytes(
        TOKENS // 8, D_MODEL, TOP_K, EXPERTS, 8, itemsize=ITEMSIZE, capacity_factor=1.5
    )
    assert each_way == 1.5 * (TOKENS // 8) * TOP_K * D_MODEL * ITEMSIZE * 7 // 8
    assert found == [each_way] * (4 if grad else 2)
    assert counts == [] and looped == []


@pytest.mark.slow
def test_folded_and_expert_tensor_axes_split_the_tokens_and_gather_no_tokens():
    """Experts over ep x mp, or over ep with mp splitting their hidden units: each device
    dispatches an eighth of the tokens either way, and nothing gathers them (the gate routes
    each device's own; expert tensor parallelism all-gathers the received buffer over mp)."""
    tokens = TOKENS // 8
    for options, ranks in (({"moe_group": ("ep", "mp")}, 8), ({}, 4)):
        text = compiled(make_layer("router", **options), mesh((4, 2), ("ep", "mp")), False)
        found, _, _ = all_to_alls(text)
        each_way = all_to_all_bytes(tokens, D_MODEL, TOP_K, EXPERTS, ranks, itemsize=ITEMSIZE)
        assert found == [each_way] * 2
        everything = TOKENS * D_MODEL * ITEMSIZE
        gathers = [c.result_bytes for c in collectives(text) if c.op == "all-gather"]
        assert all(g < everything for g in gathers), gathers


def test_only_the_allgather_dispatcher_gathers_the_tokens():
    text = compiled(make_layer("router", dispatcher="allgather"), mesh((8,), ("ep",)), False)
    found = collectives(text)
    assert not [c for c in found if c.op == "all-to-all"]
    gathered = [c for c in found if c.op == "all-gather" and c.arrays[0][0] == "f32"]
    assert [c.arrays[0][1] for c in gathered] == [(TOKENS, D_MODEL)]  # every device's tokens
