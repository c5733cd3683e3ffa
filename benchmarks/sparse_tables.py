"""Sparse tables (Paddle's parameter-server tables) against a dense embedding: step time,
bytes communicated and per-device memory as the table grows, and how rows reach their owners.

One model, trained by fleetjax steps on 8 devices (the accelerators where there are 8, else
simulated CPU devices): `SLOTS` ids per example summed into a `DIM`-wide embedding, a tanh
layer, a squared error; `ROWS` examples per global batch. The table has V rows:

* sparse: a `fleetjax.layers.SparseEmbedding` (rows split over the 8 devices, Paddle's naive
  SGD on the rows each batch touches);
* dense: the same table as a plain parameter, data parallel with `optax.sgd` (every device
  holds it, its gradient is `[V, DIM]` and all-reduced).

Bytes are what each device sends per step on a ring, from the compiled HLO (as
comm_bytes.py); memory is `memory_analysis()` of the compiled step; times are medians of
timed steps after a compiling one.

A second part compares three ways to bring a batch's rows to the devices that read them and
their gradients back to the devices that own them, on a table split over 8 devices:

* global dedup + all-reduce (fleetjax): the ids are all-gathered and deduplicated over the
  whole batch; each device reads the rows it owns, one all-reduce gives everyone every row; the
  rows' gradient is all-reduced like any replicated parameter's;
* local dedup + reduce-scatter: each device deduplicates its own ids; the ids are
  all-gathered, each device reads the rows it owns for everyone, a reduce-scatter gives each
  device its rows; the gradients are all-gathered back;
* local dedup + all-to-all: each device sends its ids to their owners in fixed-size buckets
  (a bucket holds all of a device's ids, as any one owner may own them all), the owners send
  the rows back, and the gradients go to the owners the same way.

    python benchmarks/sparse_tables.py [--quick]
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend starts; only affects CPU

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _report import MiB, Result, bench_devices  # noqa: E402
from comm_bytes import ring_bytes  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import fleetjax  # noqa: E402
from fleetjax import hlo  # noqa: E402

N, ROWS, SLOTS, DIM, HIDDEN = 8, 1024, 8, 16, 64
SIZES = (10**5, 10**6, 10**7)
LR = 0.05


def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
    table = params["emb"]
    if isinstance(table, fleetjax.layers.SparseTable):
        rows = fleetjax.layers.lookup(table, batch["ids"])
    else:
        rows = table[batch["ids"]]
    h = jnp.tanh(rows.sum(1) @ params["w"])
    return jnp.mean((h @ params["v"] - batch["y"]) ** 2)


def batches(size: int, count: int) -> list[dict[str, np.ndarray]]:
    """Power-law ids (a few are in most examples, most are rare), as CTR ids are."""
    rng = np.random.default_rng(0)
    return [
        {
            "ids": np.minimum(rng.zipf(1.2, (ROWS, SLOTS)) - 1, size - 1).astype(np.int32),
            "y": rng.normal(size=ROWS).astype(np.float32),
        }
        for _ in range(count)
    ]


def strategy(kind: str) -> fleetjax.DistributedStrategy:
    """Paddle's synchronous parameter-server mode, the sparse table with naive SGD."""
    s = fleetjax.DistributedStrategy(a_sync=False)
    if kind == "sparse":
        rule = {"name": "SparseNaiveSGDRule", "naive": {"learning_rate": LR}}
        accessor = {"embed_sgd_param": rule, "embedx_sgd_param": rule}
        s.sparse_table_configs = {"emb": {"accessor": accessor}}
    return s


def make_step(kind: str, size: int, devices: list[jax.Device]) -> tuple[Any, dict[str, Any]]:
    rng = np.random.default_rng(1)
    table = jax.ShapeDtypeStruct((size, DIM), jnp.float32)
    params = {
        "emb": fleetjax.layers.sparse_table(table, table_name="emb") if kind == "sparse" else table,
        "w": rng.normal(size=(DIM, HIDDEN)).astype(np.float32) / 4,
        "v": rng.normal(size=HIDDEN).astype(np.float32) / 8,
    }
    mesh = fleetjax.build_mesh(dp=N, devices=devices)
    step = fleetjax.make_train_step(loss_fn, optax.sgd(LR), strategy(kind), mesh)
    return step, params


def sent_bytes(text: str) -> float:
    return sum(
        ring_bytes(c.op, c.group_size, math.prod(dims) * hlo.itemsize(dtype))
        for c in hlo.collectives(text)
        for dtype, dims in c.arrays
    )


def measure_step(kind: str, size: int, devices: list[jax.Device], timed: int) -> dict[str, Any]:
    step, params = make_step(kind, size, devices)
    abstract = step.abstract_init(params)
    data = batches(size, timed + 1)
    compiled = step.lower(abstract, data[0]).compile()
    row = {
        "table": kind,
        "V": size,
        "KiB sent per step": sent_bytes(compiled.as_text()) / 1024,
        "arguments MiB per device": compiled.memory_analysis().argument_size_in_bytes / MiB,
        "temporaries MiB per device": compiled.memory_analysis().temp_size_in_bytes / MiB,
    }
    if timed:
        table = np.zeros((size, DIM), np.float32)
        real = {**params, "emb": fleetjax.layers.sparse_table(table, table_name="emb")}
        state = step.init(real if kind == "sparse" else {**params, "emb": table})
        del table, real
        state, metrics = step(state, data[0])  # compiles
        times = []
        for batch in data[1:]:
            batch = step.shard_batch(batch)
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        row["step ms"] = 1e3 * statistics.median(times)
        del state
    return row


# -- rows to their owners, three ways ------------------------------------------------------------


def _owned(ids: jax.Array, block: jax.Array) -> jax.Array:
    n = block.shape[0]
    at = ids - jax.lax.axis_index("x") * n
    return jnp.where((at >= 0) & (at < n), at, n)


def global_allreduce(block: jax.Array, ids: jax.Array, size: int) -> jax.Array:
    """fleetjax's: dedup over the batch, rows and their gradient all-reduced."""
    every = jnp.unique(jax.lax.all_gather(ids, "x", tiled=True), size=ids.size * N, fill_value=size)
    rows = jax.lax.psum(block.at[_owned(every, block)].get(mode="fill", fill_value=0), "x")
    grads = jax.lax.psum(rows * 0.01, "x")  # a replicated parameter's gradient: all-reduced
    return block.at[_owned(every, block)].add(-grads, mode="drop")


def local_reduce_scatter(block: jax.Array, ids: jax.Array, size: int) -> jax.Array:
    """Dedup per device; rows reduce-scattered to their readers, gradients all-gathered."""
    mine = jnp.unique(ids, size=ids.size, fill_value=size)
    every = jax.lax.all_gather(mine, "x", tiled=True)
    read = block.at[_owned(every, block)].get(mode="fill", fill_value=0)
    rows = jax.lax.psum_scatter(read, "x", scatter_dimension=0, tiled=True)
    grads = jax.lax.all_gather(rows * 0.01, "x", tiled=True)
    return block.at[_owned(every, block)].add(-grads, mode="drop")


def local_all_to_all(block: jax.Array, ids: jax.Array, size: int) -> jax.Array:
    """Dedup per device; ids and rows (and gradients back) through fixed-size all-to-all
    buckets, one per owner, each as large as a device's ids."""
    mine = jnp.unique(ids, size=ids.size, fill_value=size)  # sorted, so grouped by owner
    owner = jnp.minimum(mine // block.shape[0], N - 1)
    slot = jnp.arange(mine.size) - jnp.searchsorted(owner, owner)
    send = jnp.full((N, mine.size), size, mine.dtype).at[owner, slot].set(mine)
    asked = jax.lax.all_to_all(send, "x", 0, 0, tiled=True)
    rows = block.at[_owned(asked, block)].get(mode="fill", fill_value=0)
    got = jax.lax.all_to_all(rows, "x", 0, 0, tiled=True)[owner, slot]
    back = jnp.zeros_like(rows).at[owner, slot].set(got * 0.01)
    grads = jax.lax.all_to_all(back, "x", 0, 0, tiled=True)
    return block.at[_owned(asked, block)].add(-grads, mode="drop")


ROUTES = {
    "global dedup + all-reduce (fleetjax)": global_allreduce,
    "local dedup + reduce-scatter": local_reduce_scatter,
    "local dedup + all-to-all": local_all_to_all,
}


def measure_route(name: str, size: int, devices: list[jax.Device], timed: int) -> dict[str, Any]:
    mesh = jax.sharding.Mesh(np.array(devices), ("x",))
    route = ROUTES[name]
    fn = jax.jit(
        jax.shard_map(
            lambda b, i: route(b, i.ravel(), size), mesh=mesh, in_specs=(P("x"), P("x")),
            out_specs=P("x"),
        ),
        donate_argnums=0,
    )  # fmt: skip
    table = jax.device_put(jnp.zeros((size, DIM)), NamedSharding(mesh, P("x")))
    ids = [jax.device_put(b["ids"], NamedSharding(mesh, P("x"))) for b in batches(size, timed + 1)]
    text = fn.lower(table, ids[0]).compile().as_text()
    table = fn(table, ids[0]).block_until_ready()
    times = []
    for batch in ids[1:]:
        start = time.perf_counter()
        table = fn(table, batch).block_until_ready()
        times.append(time.perf_counter() - start)
    found = hlo.collectives(text)
    return {
        "route": name,
        "collectives": ", ".join(sorted({c.op for c in found})),
        "KiB sent per step": sent_bytes(text) / 1024,
        "ms": 1e3 * statistics.median(times),
    }


def _figure(rows: list[dict[str, Any]]) -> Figure:
    fig = Figure(figsize=(9, 3.4))
    left, right = fig.subplots(1, 2)
    for kind, marker in (("sparse", "o"), ("dense", "s")):
        mine = [r for r in rows if r["table"] == kind]
        timed = [r for r in mine if "step ms" in r]
        left.plot([r["V"] for r in timed], [r["step ms"] for r in timed], marker=marker, label=kind)
        right.plot([r["V"] for r in mine], [r["KiB sent per step"] for r in mine], marker=marker,
                   label=kind)  # fmt: skip
    for ax, label in ((left, "step ms"), (right, "KiB each device sends per step")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("table rows V")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    left.set_title(f"Step time, {ROWS} rows x {SLOTS} ids, N = {N}")
    right.set_title("Bytes sent per step (ring)")
    return fig


def run(quick: bool = False) -> Result:
    devices = bench_devices(N)
    timed = 3 if quick else 8
    rows = []
    for size in SIZES:
        rows.append(measure_step("sparse", size, devices, timed))
        # The dense table's step moves V x DIM floats per device and step; 10^7 rows is only
        # compiled (its bytes and memory) on simulated CPU devices.
        dense_timed = timed if size < 10**7 or devices[0].platform != "cpu" else 0
        rows.append(measure_step("dense", size, devices, dense_timed))
    routes = [measure_route(name, SIZES[1], devices, timed) for name in ROUTES]
    sparse = [r for r in rows if r["table"] == "sparse"]
    dense = [r for r in rows if r["table"] == "dense" and "step ms" in r]
    growth = sparse[-1]["step ms"] / sparse[0]["step ms"]
    dense_growth = dense[-1]["step ms"] / dense[0]["step ms"]
    notes = _notes(rows, routes, growth, dense_growth, dense[-1]["V"])
    title = "Sparse tables vs a dense embedding: step time, bytes and memory as V grows"
    return Result(title, rows + routes, notes, _figure(rows), devices)


def _power(n: int) -> str:
    return f"10^{round(math.log10(n))}"


def _notes(rows: list, routes: list, growth: float, dense_growth: float, dense_max: int) -> str:
    sent = {r["table"]: r["KiB sent per step"] for r in rows if r["V"] == SIZES[-1]}
    fastest = min(routes, key=lambda r: r["ms"])["route"]
    ours = routes[0]["ms"] / min(r["ms"] for r in routes)
    return f"""
The model: {SLOTS} power-law ids per example (Zipf, exponent 1.2) summed into a {DIM}-wide
embedding, a tanh layer of {HIDDEN}, a squared error; {ROWS} examples per global batch, plain
SGD, data parallel over N = {N} devices. "sparse" is a `SparseEmbedding` (rows split over the
devices, the rows a batch touches fetched and updated), "dense" the same table as a plain
parameter (replicated, its `[V, {DIM}]` gradient all-reduced). From V = {_power(SIZES[0])} to
{_power(SIZES[-1])} rows the sparse step's time grows {growth:.2f}x; the dense step's grows
{dense_growth:.1f}x from {_power(SIZES[0])} to {_power(dense_max)} rows (at 10^7 rows its
{sent["dense"] / 1024:.0f} MiB all-reduce per step was only compiled on simulated CPU devices,
not timed). Each device sends {sent["sparse"]:.0f} KiB per step with the sparse table at any V
(the batch's ids, its touched rows and their gradient), against {sent["dense"] / 1024:.0f} MiB
for the dense one at 10^7 rows. Per-device arguments: the sparse table's eighth (and the
dense parameters) against the whole table on every device.

The route rows compare three ways to move the rows of one batch (V = {_power(SIZES[1])}, the
lookup, the gradient's push and the update, nothing else). With static shapes every way moves
buffers sized for the worst case, N x (ids per device) rows: the all-reduces send about twice
the bytes of a reduce-scatter, and the all-to-all as much as the reduce-scatter (a bucket per
owner must hold all of a device's ids). Fastest here: {fastest}; fleetjax's takes {ours:.1f}x
its time (it also sorts N times more ids per device). fleetjax uses the all-reduce form all the
same: the touched rows are then one more replicated parameter, so AMP, loss scaling, the
in-step merge, fp16 all-reduce and ZeRO's reducers apply to them unchanged, and duplicate ids
of the whole batch are summed before the sparse rule runs (Paddle's merge). A ragged
all-to-all (bytes as the ids, not the worst case) is not available on XLA:CPU.
"""


if __name__ == "__main__":
    from _report import main

    main("sparse_tables", run)
