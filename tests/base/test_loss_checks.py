"""fleetjax.nn's loss layers check what Paddle's check, before anything runs: shapes, integer
class labels, labels within the classes or `ignore_index`, one weight per class; a label that
broadcasts against an input of another shape warns; inside a traced function a label out of
range gives NaN, never another class's loss."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fleetjax import nn, optimizers

LOGITS = np.random.default_rng(0).normal(size=(4, 10)).astype(np.float32)


@pytest.mark.parametrize(
    "layer, label, error, message",
    [
        # Paddle: IndexError "label value should >= 0 when label value(-1) not equal to
        # ignore_index(-100)"; fleetjax trained -1 as the last class.
        (nn.CrossEntropyLoss(), [0, 1, -1, 2], IndexError,
         "CrossEntropyLoss: label[2] is -1, not a class (0..9) nor ignore_index (-100)"),
        # Paddle: IndexError "label value should less than the shape of axis dimension"; fleetjax
        # gave NaN.
        (nn.CrossEntropyLoss(), [[0], [1], [10], [2]], IndexError,
         "CrossEntropyLoss: label[2, 0] is 10, not a class (0..9) nor ignore_index (-100)"),
        # Paddle casts 1.7 to 1, as fleetjax did.
        (nn.CrossEntropyLoss(), np.array([0, 1, 1.7, 2], np.float32), TypeError,
         "CrossEntropyLoss: label has dtype float32; hard labels are class indices, integers "
         "(cast them with .astype('int64'), probabilities per class soft_label=True)"),
        (nn.CrossEntropyLoss(), [0, 1, 2], ValueError,
         "CrossEntropyLoss: input has shape [4, 10] and label [3]: a hard label holds one class "
         "index per row: shape [4], or [4, 1] (the classes on axis=-1)"),
        (nn.CrossEntropyLoss(soft_label=True), np.full((4, 9), 1 / 9), ValueError,
         "CrossEntropyLoss: input has shape [4, 10] and label [4, 9]: with soft_label=True the "
         "label holds a probability per class, the input's shape"),
        (nn.CrossEntropyLoss(weight=np.ones(9)), [0, 1, 2, 3], ValueError,
         "CrossEntropyLoss: weight has shape [9]; it holds one weight per class: [10]"),
        (nn.NLLLoss(), [0, 1, -1, 2], ValueError,
         "NLLLoss: label[2] is -1, not a class (0..9) nor ignore_index (-100)"),
        (nn.NLLLoss(), np.array([0, 1, 1, 2], np.float32), TypeError,
         "NLLLoss: label has dtype float32; hard labels are class indices, integers (cast them "
         "with .astype('int64'))"),
        (nn.NLLLoss(), [0, 1, 2], ValueError,
         "NLLLoss: input has shape [4, 10] and label [3]: NLLLoss takes log-probabilities [N, C] "
         "or [N, C, d1, ...] and one class index per row, [N] or [N, d1, ...]"),
    ],
    ids=["ce-minus-1", "ce-past-classes", "ce-float", "ce-rows", "ce-soft", "ce-weight",
         "nll-minus-1", "nll-float", "nll-rows"],
)  # fmt: skip
def test_class_labels_are_checked(layer, label, error, message):
    with pytest.raises(error, match=f"^{re.escape(message)}$"):
        layer(LOGITS, label)


def test_ignore_index_takes_any_value_and_is_not_a_class():
    label = np.array([0, 1, -1, 2])
    ignoring = nn.CrossEntropyLoss(ignore_index=-1)(LOGITS, label)
    log_p = jax.nn.log_softmax(LOGITS)
    expected = -(log_p[0, 0] + log_p[1, 1] + log_p[3, 2]) / 4  # 'mean' over all rows (< 0)
    np.testing.assert_allclose(ignoring, expected, rtol=1e-6)


@pytest.mark.parametrize("layer", [nn.CrossEntropyLoss(), nn.NLLLoss()], ids=["ce", "nll"])
@pytest.mark.parametrize("wrong", [-1, 10])
def test_a_traced_label_out_of_range_gives_nan(layer, wrong):
    loss = jax.jit(layer)(LOGITS, jnp.array([0, 1, wrong, 2]))
    assert np.isnan(loss)
    assert np.isfinite(jax.jit(layer)(LOGITS, jnp.array([0, 1, 9, 2])))


@pytest.mark.parametrize(
    "layer, input, label, message",
    [
        (nn.MSELoss(), np.ones(32), np.ones(16),
         "MSELoss: input has shape [32] and label [16]: they must have the same shape (or "
         "shapes that broadcast)"),
        (nn.L1Loss(), np.ones((2, 3)), np.ones(2),
         "L1Loss: input has shape [2, 3] and label [2]: they must have the same shape (or "
         "shapes that broadcast)"),
        (nn.BCELoss(), np.full(32, 0.5), np.ones(16),
         "BCELoss: input has shape [32] and label [16]: they must have the same shape"),
        (nn.BCEWithLogitsLoss(), np.ones((32, 1)), np.ones(32),
         "BCEWithLogitsLoss: input has shape [32, 1] and label [32]: they must have the same "
         "shape"),
    ],
    ids=["mse", "l1", "bce", "bce-logits"],
)  # fmt: skip
def test_shapes_that_do_not_fit_name_both(layer, input, label, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        layer(input, label)


@pytest.mark.parametrize("layer", [nn.MSELoss(), nn.L1Loss()], ids=["mse", "l1"])
def test_a_label_that_broadcasts_warns_and_computes_as_paddle(layer):
    # Paddle (as PyTorch) computes [32, 1] against [32] as [32, 32]; PyTorch warns, so do we.
    output, label = np.arange(32.0)[:, None], np.arange(32.0)
    with pytest.warns(UserWarning, match=re.escape(
        f"{type(layer).__name__}: input has shape [32, 1] and label [32], which broadcast to "
        "[32, 32]: each input meets every label it broadcasts against"
    )) as caught:  # fmt: skip
        loss = layer(output, label)
    assert caught[0].filename == __file__  # the user's line
    difference = output - label
    expected = (difference**2 if isinstance(layer, nn.MSELoss) else np.abs(difference)).mean()
    np.testing.assert_allclose(loss, expected)


def test_the_dygraph_loops_label_is_checked_before_the_step(fresh_fleet):
    # The deferred loss of Paddle's loop: its label is known before the step compiles.
    f = fresh_fleet.init(is_collective=True)
    adam = f.distributed_optimizer(optimizers.Adam(learning_rate=0.01))
    dp_model = f.distributed_model(nnx.Linear(8, 10, rngs=nnx.Rngs(0)))
    x = np.ones((8, 8), np.float32)
    with pytest.raises(IndexError, match=r"^CrossEntropyLoss: label\[1\] is 10, not a class"):
        nn.CrossEntropyLoss()(dp_model(x), np.array([0, 10, 2, 3, 4, 5, 6, 7]))
    with pytest.raises(ValueError, match=r"^CrossEntropyLoss: input has shape \[8, 10\] and la"):
        nn.CrossEntropyLoss()(dp_model(x), np.array([0, 1]))
    loss = nn.CrossEntropyLoss()(dp_model(x), np.arange(8))
    adam.minimize(loss)
    assert np.isfinite(loss.item())
