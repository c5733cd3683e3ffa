"""Sparse tables in a train step (Paddle's parameter-server mode) on 8 devices: numerics against a
dense embedding and numpy references of Paddle's rules, the strategy switches they compose with,
Geo-SGD, what XLA compiled, memory, and bad input."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hlo import collectives
from jax.sharding import PartitionSpec as P

import fleetjax
from fleetjax import targets
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


def params(memory_kind="device"):
    table, w = start()
    return {"emb": sparse_table(table, table_name="emb", memory_kind=memory_kind), "w": w}


def train(s, batches, tx=None, memory_kind="device"):
    step = fleetjax.make_train_step(loss_fn, tx or optax.sgd(LR), s)
    state, losses = step.init(params(memory_kind)), []
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


class TestGeoSGD:
    K = 2

    def geo_reference(self, batches, replicas=8):
        """Paddle's GeoCommunicator, all trainers at once: each replica trains on its rows of
        the batch (naive SGD rows, SGD `w`), and every K steps exchanges the change of `w` and
        of the rows it touched: delta = (latest - old) / T, server = old + sum(delta),
        latest += server - (old + delta), old = server."""
        table0, w0 = (x.astype(np.float64) for x in start())
        old_t, old_w = table0.copy(), w0.copy()
        tables = [table0.copy() for _ in range(replicas)]
        ws = [w0.copy() for _ in range(replicas)]
        changed = [set() for _ in range(replicas)]
        losses, per = [], ROWS // replicas
        for step, b in enumerate(batches, 1):
            local_losses = []
            for r in range(replicas):
                local = {k: v[r * per : (r + 1) * per] for k, v in b.items()}
                dense = {"emb": tables[r].astype(np.float32), "w": ws[r].astype(np.float32)}
                loss, g = jax.value_and_grad(dense_loss)(dense, local)
                local_losses.append(float(loss))
                touched = np.unique(local["ids"])
                rows = tables[r][touched] - LR * np.asarray(g["emb"], np.float64)[touched]
                tables[r][touched] = np.clip(rows, -10, 10)
                ws[r] = ws[r] - LR * np.asarray(g["w"], np.float64)
                changed[r] |= set(touched.tolist())
            losses.append(np.mean(local_losses))
            if step % self.K:
                continue
            deltas = [(w - old_w) / replicas for w in ws]
            server = old_w + sum(deltas)
            ws = [w + server - (old_w + d) for w, d in zip(ws, deltas, strict=True)]
            old_w = server
            ids = np.array(sorted(set().union(*changed)))
            row_deltas = [
                np.where(np.isin(ids, list(c))[:, None], (t[ids] - old_t[ids]) / replicas, 0)
                for t, c in zip(tables, changed, strict=True)
            ]
            server_rows = old_t[ids] + sum(row_deltas)
            for t, d in zip(tables, row_deltas, strict=True):
                t[ids] += server_rows - (old_t[ids] + d)
            old_t[ids] = server_rows
            changed = [set() for _ in range(replicas)]
        return losses, np.stack(tables), np.stack(ws)

    def test_geo_sgd_equals_a_numpy_reference_over_two_exchanges(self):
        s = strategy()
        s.a_sync = True
        s.a_sync_configs = {"k_steps": self.K}
        batches = [batch(10 + i) for i in range(2 * self.K)]
        _, state, losses = train(s, batches)
        expected, tables, ws = self.geo_reference(batches)
        np.testing.assert_allclose(losses, expected, rtol=1e-5)
        np.testing.assert_allclose(state.params["emb"][...], tables, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.params["w"], ws, rtol=1e-5, atol=1e-6)
        # After the last exchange the servers' copy is the same on every replica.
        old = np.asarray(state.opt_state.geo["emb"].old)
        np.testing.assert_allclose(old, np.broadcast_to(old[:1], old.shape), rtol=1e-6)


# -- the switches tables compose with ---------------------------------------------------------

HIDDEN = 1024  # w1 has 4096 elements: ZeRO splits it


def mlp_loss(params, b):
    rows = lookup(params["emb"], b["ids"]).sum(1)
    return jnp.mean((jnp.tanh(rows @ params["w1"]) @ params["w2"] - b["y"]) ** 2)


def mlp_params():
    rng = np.random.RandomState(1)
    return {
        "emb": sparse_table(start()[0], table_name="emb"),
        "w1": rng.randn(D, HIDDEN).astype(np.float32) / 2,
        "w2": rng.randn(HIDDEN).astype(np.float32) / 32,
    }


def mlp_train(s, batches, tx=None):
    step = fleetjax.make_train_step(mlp_loss, tx or optax.adam(1e-2), s)
    state, losses = step.init(mlp_params()), []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return step, state, losses


class TestComposition:
    def test_zero2_and_amp_with_a_sparse_table(self):
        """ZeRO-2 (the dense gradients reduce-scattered over `sharding`) and AMP (float16,
        dynamic loss scaling) on the dense part: the same numbers as AMP alone, close to
        float32, and the table still trained by its rows alone."""
        amp = {"amp": True, "amp_configs": {"init_loss_scaling": 1024.0}}
        zero2 = {"sharding": True, "sharding_configs": {"stage": 2}}
        rule = "SparseAdaGradSGDRule"
        batches = BATCHES[:2]
        step, both, losses = mlp_train(strategy(rule, **amp, **zero2), batches)
        _, amp_only, amp_losses = mlp_train(strategy(rule, **amp), batches)
        _, _, f32_losses = mlp_train(strategy(rule), batches)
        # float16 gradients summed in another order (a reduce-scatter, not an all-reduce)
        np.testing.assert_allclose(losses, amp_losses, rtol=1e-4)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-4),
            both.params,
            amp_only.params,
        )
        np.testing.assert_allclose(losses, f32_losses, rtol=2e-2)
        text = step.lower(both, BATCHES[0]).compile().as_text()
        ops = {c.op for c in collectives(text)}
        assert "reduce-scatter" in ops  # ZeRO-2's
        touched = np.unique(np.concatenate([b["ids"].ravel() for b in batches]))
        untouched = np.setdiff1d(np.arange(V), touched)
        np.testing.assert_array_equal(both.params["emb"][...][untouched], start()[0][untouched])

    def test_a_skipped_step_leaves_the_table_and_its_slots(self):
        s = strategy("SparseAdaGradSGDRule", amp=True)
        step = fleetjax.make_train_step(mlp_loss, optax.adam(1e-2), s)
        state = step.init(mlp_params())
        bad = dict(BATCHES[0], y=np.full(ROWS, np.inf, np.float32))
        after, metrics = step(state, bad)
        assert bool(metrics["skipped"])
        np.testing.assert_array_equal(after.params["emb"][...], start()[0])
        slots = after.opt_state.slots["emb"]
        assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(slots))

    def test_in_step_gradient_merge(self):
        merge = {
            "gradient_merge": True,
            "gradient_merge_configs": {"k_steps": 2, "mode": "in_step"},
        }
        _, merged, losses = train(strategy(**merge), BATCHES)
        _, plain, plain_losses = train(strategy(), BATCHES)
        np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
        np.testing.assert_allclose(merged.params["emb"][...], plain.params["emb"][...], rtol=1e-5)

    @pytest.mark.parametrize(
        "fields, clash",
        [
            ({"localsgd": True}, "localsgd"),
            ({"gradient_merge": True, "gradient_merge_configs": {"k_steps": 2}}, "across calls"),
        ],
    )
    def test_switches_tables_do_not_combine_with_are_refused(self, fields, clash):
        step = fleetjax.make_train_step(loss_fn, optax.sgd(LR), strategy(**fields))
        message = f"a model with sparse tables does not combine with .*{clash}"
        with pytest.raises(ValueError, match=message):
            step.init(params())


# -- what XLA compiled, and memory -------------------------------------------------------------


def abstract_step(rows, dim, s=None, mesh=None, memory_kind="device"):
    step = fleetjax.make_train_step(loss_fn, optax.sgd(LR), s, mesh)
    table = jax.ShapeDtypeStruct((rows, dim), jnp.float32)
    state = step.abstract_init(
        {
            "emb": sparse_table(table, table_name="emb", memory_kind=memory_kind),
            "w": jax.ShapeDtypeStruct((dim,), jnp.float32),
        }
    )
    abstract_batch = {
        "ids": jax.ShapeDtypeStruct((ROWS, SLOTS), jnp.int32),
        "y": jax.ShapeDtypeStruct((ROWS,), jnp.float32),
    }
    return step.lower(state, abstract_batch).compile()


def test_compiled_step_has_no_dense_table_gradient():
    """Rows are [8192, 16] over 8 devices ([1024, 16] each): no array of either shape is
    communicated, no [8192, 16] array exists, and what is all-reduced is the batch's 96
    touched rows (the fetch and the gradient)."""
    text = abstract_step(8192, 16).as_text()
    assert "[8192,16]" not in text
    found = collectives(text)
    shapes = {dims for c in found for _, dims in c.arrays}
    assert not shapes & {(8192, 16), (1024, 16)}
    reduced = [dims for c in found if c.op == "all-reduce" for _, dims in c.arrays]
    assert (ROWS * SLOTS, 16) in reduced and max(map(np.prod, reduced)) == ROWS * SLOTS * 16


def test_a_ten_million_row_table_takes_an_eighth_per_device():
    """A 10^7 x 64 float32 table over 8 devices: each device's arguments are its eighth of
    the table and of the default rule's slots (one g2sum per row for the embed and the embedx
    columns), within 5%."""
    rows, dim = 10**7, 64
    memory = abstract_step(rows, dim).memory_analysis()
    expected = (rows * dim * 4 + 2 * rows * 4) / 8
    assert memory.argument_size_in_bytes == pytest.approx(expected, rel=0.05)


# -- tables in pinned host memory ----------------------------------------------------------------


class TestHostTables:
    @pytest.mark.parametrize("rule", ["SparseNaiveSGDRule", "SparseAdaGradSGDRule"])
    def test_a_host_table_trains_as_the_device_table(self, rule):
        _, on_device, device_losses = train(strategy(rule), BATCHES)
        _, on_host, losses = train(strategy(rule), BATCHES, memory_kind="pinned_host")
        np.testing.assert_allclose(losses, device_losses, rtol=1e-6)
        np.testing.assert_allclose(on_host.params["emb"][...], on_device.params["emb"][...])
        np.testing.assert_allclose(on_host.params["w"], on_device.params["w"], rtol=1e-6)
        jax.tree.map(np.testing.assert_allclose, on_host.opt_state.slots, on_device.opt_state.slots)
        kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}  # noqa: E731
        assert kinds([on_host.params["emb"], on_host.opt_state.slots]) == {"pinned_host"}
        assert kinds(on_host.params["w"]) == {"device"}

    @pytest.mark.skipif(
        not targets.plugin_installed(),
        reason="jax's CUDA plugin is not installed: pip install -e '.[aot]'",
    )
    def test_compiled_for_h100s_only_the_touched_rows_reach_the_devices(self):
        """A 10^7 x 64 float32 host table over 8 compile-only H100s: XLA:GPU keeps each
        device's eighth of the table and of the Adagrad slots in host memory (S(5)), the
        device's arguments are a few scalars, and no buffer of an eighth's rows (or more) is
        in device memory: the rows move one at a time (dynamic slices of host memory)."""
        rows, dim = 10**7, 64
        compiled = abstract_step(
            rows, dim, strategy("SparseAdaGradSGDRule"), targets.mesh("h100", 8), "pinned_host"
        )
        memory = compiled.memory_analysis()
        expected = (rows * dim * 4 + 2 * rows * 4) / 8
        assert memory.host_argument_size_in_bytes == pytest.approx(expected, rel=0.05)
        assert memory.host_alias_size_in_bytes == memory.host_argument_size_in_bytes  # in place
        assert memory.argument_size_in_bytes < 1024 and memory.temp_size_in_bytes < 2**20
        shapes = re.findall(r"\b[a-z]+\d*\[(\d+)(?:,\d+)*\]\{([^}]*)\}", compiled.as_text())
        large = {layout for first, layout in shapes if int(first) >= rows // 8}
        assert large and all(layout.endswith(":S(5)") for layout in large)

    def test_geo_sgd_is_refused(self):
        s = strategy()
        s.a_sync = True
        s.a_sync_configs = {"k_steps": 2}
        step = fleetjax.make_train_step(loss_fn, optax.sgd(LR), s)
        with pytest.raises(
            ValueError,
            match=r"sparse table 'emb' with memory_kind='pinned_host' does not combine "
            r"with Geo-SGD \(a_sync=True, a_sync_configs.k_steps=2\)",
        ):
            step.init(params("pinned_host"))

    def test_an_unknown_memory_kind(self):
        with pytest.raises(
            ValueError,
            match=r"sparse table 'emb': memory_kind='unpinned_host'; a table's rows live in one "
            r"of \('device', 'pinned_host'\)",
        ):
            SparseEmbedding(V, D, table_name="emb", memory_kind="unpinned_host", rngs=nnx.Rngs(0))


# -- bad input -----------------------------------------------------------------------------------


class TestBadInput:
    def test_an_id_outside_reads_zeros_trains_nothing_and_is_counted(self):
        ids = BATCHES[0]["ids"].copy()
        ids[3, 1], ids[5, 0] = 99, -1
        b = dict(BATCHES[0], ids=ids)
        step = fleetjax.make_train_step(loss_fn, optax.sgd(LR), strategy())
        state, metrics = step(step.init(params()), b)
        assert float(metrics["ids_outside/emb"]) == 2
        losses = [float(metrics["loss"])]
        table, w = start()

        def zero_outside(params, b):
            at = b["ids"]
            rows = params["emb"].at[at].get(mode="fill", fill_value=0, wrap_negative_indices=False)
            return jnp.mean((rows.sum(1) @ params["w"] - b["y"]) ** 2)

        loss, g = jax.value_and_grad(zero_outside)({"emb": table, "w": w}, b)
        np.testing.assert_allclose(losses, [float(loss)], rtol=1e-5)
        np.testing.assert_allclose(state.params["emb"][...], table - LR * g["emb"], rtol=1e-5)

    def test_a_table_config_that_contradicts_the_layer(self):
        s = strategy()
        s.sparse_table_configs = {"emb": {"accessor": {"embedx_dim": 8}}}
        step = fleetjax.make_train_step(loss_fn, optax.sgd(LR), s)
        with pytest.raises(
            ValueError,
            match=r"sparse_table_configs\['emb'\].accessor.embedx_dim=8 contradicts the table "
            "'emb', whose embedding_dim is 4: Paddle's SparseAccessor has embedx_dim = "
            "embedding_dim - 1 = 3",
        ):
            step.init(params())

    def test_a_table_config_for_no_table_of_the_model(self):
        s = fleetjax.DistributedStrategy()
        s.sparse_table_configs = {"embedding_0.w_0": {}}
        step = fleetjax.make_train_step(loss_fn, optax.sgd(LR), s)
        with pytest.raises(
            ValueError, match=r"names \['embedding_0.w_0'\], but the model's sparse tables are "
        ):
            step.init(params())

    def test_param_specs_that_split_no_axis_of_a_table(self):
        step = fleetjax.make_train_step(
            loss_fn, optax.sgd(LR), strategy(), param_specs={"emb": P(), "w": P()}
        )
        with pytest.raises(
            ValueError,
            match=r"^param_specs gives sparse table 'emb' P\(\), which splits none of "
            "its axes; a table's rows are split over the mesh, its spec names their axes first",
        ):
            step.init(params())

    def test_param_specs_without_a_parameter(self):
        step = fleetjax.make_train_step(loss_fn, optax.sgd(LR), strategy(), param_specs={"w": P()})
        with pytest.raises(
            ValueError,
            match=r"^param_specs must give a PartitionSpec for each parameter \(params\['emb'\], "
            r"params\['w'\]\): no spec for params\['emb'\]$",
        ):
            step.init(params())

    def test_a_ctr_accessor_is_not_modelled(self):
        s = fleetjax.DistributedStrategy()
        s.sparse_table_configs = {"emb": {"accessor": {"accessor_class": "CtrCommonAccessor"}}}
        with pytest.raises(NotImplementedError, match="accessor_class='CtrCommonAccessor'"):
            fleetjax.make_train_step(loss_fn, optax.sgd(LR), s)


# -- Paddle's table configs ---------------------------------------------------------------------


class TestTableConfigs:
    def test_paddles_dotted_configs(self):
        """Paddle's test_fleet_distributed_strategy.test_sparse_table_configs."""
        s = fleetjax.DistributedStrategy()
        s.sparse_table_configs = {
            "emb": {
                "table_parameters.emb.accessor.embed_sgd_param.adagrad.learning_rate": 0.05,
                "table_parameters.emb.accessor.table_accessor_save_param.num": 2,
                "table_parameters.emb.accessor.table_accessor_save_param.param": [1, 2],
            }
        }
        table = s.sparse_table_configs[0]
        assert table.accessor.embed_sgd_param.adagrad.learning_rate == 0.05
        saved = table.accessor.table_accessor_save_param
        assert (saved[0].param, saved[1]["param"], saved[1].converter) == (1, 2, "")  # messages
        assert table.table_name == "emb" and table.shard_num == 1000  # Paddle's defaults read
        with pytest.raises(TypeError, match=r"is a copy of an element of .*downpour_table_param"):
            table.shard_num = 10  # would not reach the strategy

    @pytest.mark.parametrize(
        ("config", "read", "expected"),
        [
            ({"sparse_optimizer": "adagrad"}, "embed_sgd_param.adagrad.learning_rate", 0.05),
            ({"sparse_optimizer": "naive"}, "embed_sgd_param.naive.learning_rate", 0.05),
            ({"sparse_optimizer": "adam"}, "embed_sgd_param.adam.beta1_decay_rate", 0.9),
            (
                {"sparse_accessor_class": "DownpourUnitAccessor",
                 "embed_sparse_optimizer": "std_adagrad"},
                "ctr_accessor_param.show_scale",
                False,
            ),
            (
                {"sparse_accessor_class": "DownpourUnitAccessor",
                 "embed_sparse_optimizer": "std_adagrad"},
                "embed_sgd_param.adagrad.initial_range",
                0,
            ),
            (
                {"sparse_accessor_class": "DownpourCtrDoubleAccessor",
                 "embed_sparse_optimizer": "std_adagrad"},
                "embed_sgd_param.adagrad.initial_range",
                0.0001,
            ),
            ({"sparse_optimizer": "shared_adam"}, "embed_sgd_param.adam.beta1_decay_rate", 0.9),
            ({}, "table_accessor_save_param[1].param", 2),
            ({"sparse_embedx_dim": 4}, "fea_dim", 7),
        ],
    )  # fmt: skip
    def test_paddles_fleet_desc_configs(self, config, read, expected):
        """Paddle's test_fleet_distributed_strategy.test_fleet_desc_configs, case by case."""
        s = fleetjax.DistributedStrategy()
        s.fleet_desc_configs = {"emb": config}
        value = eval(f"table.accessor.{read}", {"table": s.sparse_table_configs[0]})
        assert value == expected
        assert s.fleet_desc_configs == s.sparse_table_configs  # Paddle's one getter

    def test_fleet_desc_configs_refuse_what_paddle_does_not_support(self):
        s = fleetjax.DistributedStrategy()
        with pytest.raises(ValueError, match=r"\['sparse_lr'\] are not supported"):
            s.fleet_desc_configs = {"emb": {"sparse_lr": 0.1}}
        with pytest.raises(ValueError, match=r"sparse_table_class='Dense' is not one of"):
            s.fleet_desc_configs = {"emb": {"sparse_table_class": "Dense"}}
        with pytest.raises(ValueError, match=r": sparse_optimizer='sgd' is not one of naive"):
            s.fleet_desc_configs = {"emb": {"sparse_optimizer": "sgd"}}
        s.fleet_desc_configs = {"use_cvm": False, "dense_table": {}, "emb": {}}  # as Paddle
        (table,) = s.sparse_table_configs
        assert (table.table_name, table.accessor.accessor_class) == ("emb", "SparseAccessor")

    def test_unknown_dotted_keys_raise(self):
        s = fleetjax.DistributedStrategy()
        with pytest.raises(KeyError, match=r"table_parameters.emb.acessor.fea_dim'\] name no"):
            s.sparse_table_configs = {"emb": {"table_parameters.emb.acessor.fea_dim": 11}}

    def test_prototxt_round_trip(self, tmp_path):
        s = strategy("SparseAdamSGDRule")
        s.save_to_prototxt(tmp_path / "s.prototxt")
        text = (tmp_path / "s.prototxt").read_text()
        assert 'downpour_table_param {\n  table_name: "emb"' in text
        loaded = fleetjax.DistributedStrategy.from_prototxt(tmp_path / "s.prototxt")
        assert loaded.downpour_table_param == s.downpour_table_param

    def test_the_plan_reads_rules_with_paddles_defaults(self):
        plan = fleetjax.plan.read_plan(strategy("SparseAdamSGDRule"))
        (table,) = plan.parameter_server.tables
        assert table.embedx.name == "SparseAdamSGDRule"
        assert dict(table.embedx.params) == {
            "learning_rate": LR,
            "beta1_decay_rate": 0.9,
            "beta2_decay_rate": 0.999,
            "ada_epsilon": 1e-8,
            "weight_bounds": (-10.0, 10.0),  # the bounds Paddle's runtime adds
        }
        default = plan.parameter_server.table("other")
        assert default.embed.name == "SparseAdaGradSGDRule"

    def test_table_settings_without_effect_warn_once_each(self):
        s = fleetjax.DistributedStrategy()
        accessor = {"embedx_threshold": 3, "ctr_accessor_param": {"show_scale": False}}
        s.sparse_table_configs = {"emb": {"shard_num": 10, "accessor": accessor}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fleetjax.plan.read_plan(s)
        messages = sorted(str(w.message).split(" has no effect")[0] for w in caught)
        assert messages == [
            "DistributedStrategy.downpour_table_param[0].accessor.ctr_accessor_param.show_scale"
            "=False",
            "DistributedStrategy.downpour_table_param[0].accessor.embedx_threshold=3",
            "DistributedStrategy.downpour_table_param[0].shard_num=10",
        ]

    def test_a_sync_modes(self):
        s = fleetjax.DistributedStrategy(a_sync_configs={"k_steps": 5})
        s.a_sync = True  # Paddle's setter: k_steps back to 0 (async)
        assert s.a_sync_configs["k_steps"] == 0
        s.a_sync_configs = {"k_steps": 5}  # Geo-SGD
        plan = fleetjax.plan.read_plan(s)
        assert (plan.optimizer.name, plan.parameter_server.geo_k_steps) == ("geo", 5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert (
                fleetjax.plan.read_plan(fleetjax.DistributedStrategy(a_sync=False)).optimizer
                is None
            )


@pytest.mark.parametrize(
    "fields",
    [
        {"fp16_allreduce": True},
        {"use_hierarchical_allreduce": True, "hierarchical_allreduce_inter_nranks": 4},
        {"hybrid_configs": {"dp_degree": 4, "mp_degree": 2}},
    ],
    ids=["fp16-allreduce", "hierarchical", "mp2"],
)
def test_more_switches_with_a_sparse_table(fields):
    """Each switch on the dense part trains the table as the plain step does."""
    _, plain, plain_losses = train(strategy(), BATCHES[:2])
    _, state, losses = train(strategy(**fields), BATCHES[:2])
    np.testing.assert_allclose(losses, plain_losses, rtol=2e-3)
    np.testing.assert_allclose(state.params["emb"][...], plain.params["emb"][...], rtol=2e-3)


def test_recompute_with_a_sparse_table():
    def marked_loss(params, b):
        rows = lookup(params["emb"], b["ids"]).sum(1)
        hidden = fleetjax.recompute(lambda w, h: jnp.tanh(h @ w))(params["w1"], rows)
        return jnp.mean((hidden @ params["w2"] - b["y"]) ** 2)

    recompute = {"recompute": True, "recompute_configs": {"policy": "nothing_saveable"}}
    results = []
    for fields in ({}, recompute):
        step = fleetjax.make_train_step(marked_loss, optax.sgd(LR), strategy(**fields))
        state, _ = step(step.init(mlp_params()), BATCHES[0])
        results.append(state.params)
    np.testing.assert_allclose(results[1]["emb"][...], results[0]["emb"][...], rtol=1e-6)
    np.testing.assert_allclose(results[1]["w1"], results[0]["w1"], rtol=1e-6)
