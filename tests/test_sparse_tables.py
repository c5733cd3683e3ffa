"""Sparse tables in a train step (Paddle's parameter-server mode) on 8 devices: numerics against a
dense embedding and numpy references of Paddle's rules, the strategy switches they compose with,
Geo-SGD, what XLA compiled, memory, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fleetjax
from fleetjax.layers import SparseEmbedding, lookup, sparse_table

V, D, ROWS, SLOTS = 64, 4, 32, 3
LR = 0.1
SECTIONS = {
    "SparseNaiveSGDRule": "naive",
    "SparseAdaGradSGDRule": "adagrad",
    "SparseAdamSGDRule": "adam",
}


def batch(seed, ids=None):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, V, size=(ROWS, SLOTS)) if ids is None else ids
    return {"ids": np.asarray(ids, np.int32), "y": rng.randn(ROWS).astype(np.float32)}


def start():
    rng = np.random.RandomState(0)
    return rng.randn(V, D).astype(np.float32), rng.randn(D).astype(np.float32)


def loss_fn(params, b):
    rows = lookup(params["emb"], b["ids"]).sum(1)
    return jnp.mean((rows @ params["w"] - b["y"]) ** 2)


def dense_loss(params, b):
    return jnp.mean((params["emb"][b["ids"]].sum(1) @ params["w"] - b["y"]) ** 2)


def strategy(rule="SparseNaiveSGDRule", **fields):
    """A strategy (with `fields`) whose table `emb` has `rule` on both accessor columns."""
    sgd = {"name": rule, SECTIONS[rule]: {"learning_rate": LR}}
    s = fleetjax.DistributedStrategy(**fields)
    s.sparse_table_configs = {
        "emb": {"accessor": {"embed_sgd_param": sgd, "embedx_sgd_param": sgd}}
    }
    return s


def params():
    table, w = start()
    return {"emb": sparse_table(table, table_name="emb"), "w": w}


def train(s, batches, tx=None):
    step = fleetjax.make_train_step(loss_fn, tx or optax.sgd(LR), s)
    state, losses = step.init(params()), []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return step, state, losses


# -- numpy references of Paddle's rules (sparse_sgd_rule.cc) ---------------------------------


def adagrad_rule(w, slots, g, init=3.0, bounds=(-10.0, 10.0)):
    (g2sum,) = slots
    w = np.clip(w - LR * g * np.sqrt(init / (init + g2sum)), *bounds)
    return w, (g2sum + np.mean(g * g, axis=1, keepdims=True),)


def adam_rule(w, slots, g, b1=0.9, b2=0.999, eps=1e-8, bounds=(-10.0, 10.0)):
    m, v, p1, p2 = slots
    lr = LR * np.sqrt(1 - p2) / (1 - p1)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    return np.clip(w - lr * m / (np.sqrt(v) + eps), *bounds), (m, v, p1 * b1, p2 * b2)


def adagrad_slots(width):
    return [np.zeros((V, 1))]


def adam_slots(width):
    return [
        np.zeros((V, width)),
        np.zeros((V, width)),
        np.full((V, 1), 0.9),
        np.full((V, 1), 0.999),
    ]


def reference(batches, rule, make_slots):
    """A dense embedding on one device whose gradient `rule` applies to the rows each batch
    touches, Paddle's accessor way: column 0 and columns 1.. each with their own slots; plain
    SGD for `w`."""
    table, w = (x.astype(np.float64) for x in start())
    groups = [(slice(0, 1), make_slots(1)), (slice(1, D), make_slots(D - 1))]
    losses = []
    for b in batches:
        dense = {"emb": table.astype(np.float32), "w": w.astype(np.float32)}
        loss, g = jax.value_and_grad(dense_loss)(dense, b)
        losses.append(float(loss))
        touched, g_emb = np.unique(b["ids"]), np.asarray(g["emb"], np.float64)
        for cols, slots in groups:
            own = tuple(s[touched] for s in slots)
            table[touched, cols], new = rule(table[touched, cols], own, g_emb[touched, cols])
            for s, n in zip(slots, new, strict=True):
                s[touched] = n
        w = w - LR * np.asarray(g["w"], np.float64)
    return losses, table, w


BATCHES = [batch(i) for i in range(3)]


class TestNumerics:
    def test_naive_sgd_equals_a_dense_embedding_with_sgd(self):
        _, state, losses = train(strategy(), BATCHES)
        table, w = start()
        dense, tx, expected = {"emb": table, "w": w}, optax.sgd(LR), []
        opt = tx.init(dense)
        for b in BATCHES:
            loss, g = jax.value_and_grad(dense_loss)(dense, b)
            updates, opt = tx.update(g, opt, dense)
            dense = optax.apply_updates(dense, updates)
            expected.append(float(loss))
        np.testing.assert_allclose(losses, expected, rtol=1e-5)
        np.testing.assert_allclose(state.params["emb"][...], dense["emb"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.params["w"], dense["w"], rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize(
        "rule, paddle_rule, slots",
        [
            ("SparseAdaGradSGDRule", adagrad_rule, adagrad_slots),
            ("SparseAdamSGDRule", adam_rule, adam_slots),
        ],
        ids=["adagrad", "lazy-adam"],
    )
    def test_rules_equal_numpy_references_of_paddles(self, rule, paddle_rule, slots):
        _, state, losses = train(strategy(rule), BATCHES)
        expected, table, w = reference(BATCHES, paddle_rule, slots)
        np.testing.assert_allclose(losses, expected, rtol=1e-5)
        # Adam divides by sqrt(v): float32 sums in another order move a row by up to ~3e-6.
        np.testing.assert_allclose(state.params["emb"][...], table, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state.params["w"], w, rtol=1e-5, atol=1e-6)

    def test_duplicate_ids_are_summed_once_per_row(self):
        """Every id of the batch is the same row (on every device): one Adagrad update of it
        with the summed gradient, not one per occurrence."""
        same = [batch(7, ids=np.full((ROWS, SLOTS), 5))]
        _, state, losses = train(strategy("SparseAdaGradSGDRule"), same)
        expected, table, _ = reference(same, adagrad_rule, adagrad_slots)
        np.testing.assert_allclose(losses, expected, rtol=1e-5)
        np.testing.assert_allclose(state.params["emb"][...], table, rtol=1e-5, atol=1e-6)
        untouched = np.arange(V) != 5
        np.testing.assert_array_equal(state.params["emb"][...][untouched], start()[0][untouched])

    def test_nnx_layer_and_paddles_default_rule(self):
        """A SparseEmbedding in an nnx model, with no table config: Paddle's default rule
        (SparseAdaGradSGDRule: learning rate 0.05, initial_g2sum 3, bounds +-10) on each
        accessor column group, and Paddle's start (embed_w zero, embedx in +-initial_range)."""

        class Model(nnx.Module):
            def __init__(self, rngs):
                self.emb = SparseEmbedding(V, D, table_name="emb", rngs=rngs)
                self.out = nnx.Linear(D, 1, rngs=rngs)

            def __call__(self, ids):
                return self.out(self.emb(ids).sum(1))[:, 0]

        graphdef, state0 = nnx.split(Model(nnx.Rngs(0)))
        first = np.asarray(state0["emb"]["weight"][...])
        assert np.all(first[:, 0] == 0) and 0 < np.abs(first[:, 1:]).max() <= 1e-4

        def model_loss(p, b):
            return jnp.mean((nnx.merge(graphdef, p)(b["ids"]) - b["y"]) ** 2)

        def dense_table_loss(rows, b):  # the same model, the table a plain array
            p = jax.tree.map(lambda x: x, state0)
            p["emb"]["weight"] = p["emb"]["weight"].replace(rows)
            return model_loss(p, b)

        step = fleetjax.make_train_step(model_loss, optax.sgd(LR))
        state, metrics = step(step.init(state0), BATCHES[0])
        loss, g = jax.value_and_grad(dense_table_loss)(first, BATCHES[0])
        expected = first.astype(np.float64)
        touched = np.unique(BATCHES[0]["ids"])
        for cols in (slice(0, 1), slice(1, D)):
            rows = expected[touched, cols]
            grad = np.asarray(g, np.float64)[touched, cols]
            expected[touched, cols] = np.clip(rows - 0.05 * grad, -10, 10)  # g2sum starts at 0
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
        np.testing.assert_allclose(state.params["emb"]["weight"][...], expected, rtol=1e-5)
