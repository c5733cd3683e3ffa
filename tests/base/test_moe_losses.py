"""A MoE layer's auxiliary losses and their gradients do not depend on the layout, and neither
gradient merge nor recompute changes or double-counts them: the merged step's losses and
gradients are the mean of its micro-batches' (the z and sequence-wise losses, means over tokens
and sequences, are then the whole batch's), and a recomputed layer's are the plain layer's."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AxisType
from moe_models import assert_close, inputs, make_layer, split

from fleetjax.transforms import grad_fn, gradient_merge, recompute

MESH = ((2, 4), ("dp", "ep"))


def losses_and_grads(layer, wrap=lambda f: f):
    """The GradFn of <output, cotangent> + the layer's aux losses, the losses as its aux."""
    graphdef, params, rest = split(layer)
    forward = wrap(lambda params, x: nnx.merge(graphdef, params, rest).call_with_stats(x))

    def loss(params, model_state, batch):
        out, stats = forward(params, batch["x"])
        value = jnp.sum(out * batch["cotangent"]) + stats.loss
        return value, grad_fn.Outputs(value, stats.losses, model_state)

    return grad_fn.value_and_grad(loss), params


def batch():
    x, cotangent = inputs()
    return {"x": x, "cotangent": cotangent}


def on_mesh(fn, *args):
    shape, names = MESH
    with jax.set_mesh(jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * 2)):
        return jax.jit(fn)(*args)


def test_gradient_merge_takes_the_mean_of_its_micro_batches():
    step, params = losses_and_grads(make_layer())
    merged = gradient_merge.microbatched(step, 2)
    (outputs, grads) = on_mesh(lambda p, b: merged(p, None, b), params, batch())
    # by hand, on one device: micro-batch i is rows i, i + 2 (gradient_merge.split_batch)
    parts = [jax.tree.map(lambda v, i=i: v[i::2], batch()) for i in range(2)]
    alone = jax.jit(lambda p, b: step(p, None, b))  # one compile for both halves
    each = [alone(params, part) for part in parts]
    mean = lambda *xs: sum(xs) / len(xs)  # noqa: E731
    assert_close(outputs.aux, jax.tree.map(mean, *[o.aux for o, _ in each]))
    assert_close(grads, jax.tree.map(mean, *[g for _, g in each]))


@pytest.mark.slow
def test_the_z_and_sequence_losses_of_micro_batches_average_to_the_whole_batchs():
    step, params = losses_and_grads(make_layer())
    merged = gradient_merge.microbatched(step, 2)
    outputs, _ = on_mesh(lambda p, b: merged(p, None, b), params, batch())
    whole, _ = jax.jit(lambda p, b: step(p, None, b))(params, batch())
    for name in ("z", "seq_aux"):  # means over tokens and sequences
        assert_close(outputs.aux[name], whole.aux[name])


@pytest.mark.parametrize(
    "wrap",
    [
        jax.checkpoint,
        pytest.param(
            lambda f: recompute.remat(f, policy="nothing_saveable"), marks=pytest.mark.slow
        ),
    ],
    ids=["jax.checkpoint", "fleetjax.transforms.recompute.remat"],
)
def test_recompute_counts_the_losses_once(wrap):
    plain, params = losses_and_grads(make_layer())
    again, _ = losses_and_grads(make_layer(), wrap)
    expected = on_mesh(lambda p, b: plain(p, None, b), params, batch())
    found = on_mesh(lambda p, b: again(p, None, b), params, batch())
    assert_close(found, expected)
