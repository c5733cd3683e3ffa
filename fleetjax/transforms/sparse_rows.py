"""Sparse row updates: how Paddle's parameter-server tables train, in SPMD.

A sparse table (`fleetjax.layers.SparseTable`, ``[V, D]``) is split by rows over the mesh
axes `axes` (every device by default) and is never differentiated. A step instead:

    named = name_tables(params)                     # each table gets its table name
    touched = touched_rows(lambda: loss_fn(named, batch), tables(named), mesh)
    views = row_views(named, touched, mesh, axes)   # each table -> its touched rows [U, D]
    with lookup_scope(touched):
        loss, grads = jax.value_and_grad(loss_fn)(views, batch)  # a table's grad: [U, D]
    params, slots = apply_rows(rules, params, slots, touched, grads, mesh, axes)

(`touched_views` does the first three lines, `value_and_grad` the first four.) No gradient of
shape ``[V, D]`` exists.

* `touched_rows` traces the loss once with lookups that only record their ids (nothing of it
  is left in the compiled step but the ids), and deduplicates each table's ids over the whole
  batch: ``U = min(ids in the batch, V)`` sorted distinct ids, padded with ``V``.
* `row_views` fetches those rows from the devices that own them: every device reads the ids'
  rows it holds (zeros for the others) and one all-reduce over `axes` sums them, so every device
  has the ``[U, D]`` rows. (The ids are all-gathered for the deduplication; with a static
  ``U`` an all-to-all to the owners would move as many bytes, and this keeps the rows a plain
  replicated parameter that every other transform handles: see docs/parameter_server.md.)
* The loss reads each lookup's rows from the view; the gradient of a view is one row per
  distinct id, duplicate ids summed; data parallelism all-reduces it like any gradient.
* `apply_rows` applies a table's `SparseRule` on each device to the touched rows it owns, and
  their optimizer slots, in place: nothing is sent.
* A table in pinned host memory (``memory_kind="pinned_host"``, its slots likewise) is read
  and written a row at a time (XLA's dynamic slices of host memory): only the touched rows
  move between host and device, and no block of the table is copied to the device.

Under Geo-SGD (`a_sync_configs.k_steps`) every replica keeps its own copy of a table, as
Paddle's Geo trainers do, updates it locally (``axes=()``) and marks the rows it changed; every
k steps `geo_exchange` swaps the changes of those rows only, by Paddle's formula
(`fleetjax.optimizers.geo_merge`, as `geo_sgd` does for dense parameters).

The rules (`SparseRule`s) are Paddle's, in `fleetjax.optimizers.sparse_rules`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleetjax.layers.sparse_embedding import (
    SparseTable,
    TouchedRows,
    is_table,
    lookup_scope,
)
from fleetjax.mesh import manual_axes
from fleetjax.optimizers import geo_merge
from fleetjax.optimizers.sparse_rules import SparseRule

__all__ = [
    "GeoRows",
    "TablesState",
    "apply_rows",
    "gather_rows",
    "geo_exchange",
    "geo_init",
    "init_slots",
    "name_tables",
    "row_views",
    "scatter_rows",
    "tables",
    "touched_rows",
    "touched_views",
    "value_and_grad",
    "without_tables",
]

_DEVICE, _HOST = jax.memory.Space.Device, jax.memory.Space.Host


# -- tables in a parameter tree -----------------------------------------------------------------


def name_tables(params: Any) -> Any:
    """`params` with every `SparseTable` named: its `table_name`, else its path in `params`.

    Raises:
      ValueError: if two tables have the same name.
    """
    seen: dict[str, str] = {}

    def name(path: Any, leaf: Any) -> Any:
        if not is_table(leaf):
            return leaf
        where = jax.tree_util.keystr(path)
        named = leaf.get_metadata().get("table_name") or where
        if named in seen:
            raise ValueError(f"two sparse tables are named {named!r}: {seen[named]} and {where}")
        seen[named] = where
        return leaf.replace(table_name=named)

    return jax.tree_util.tree_map_with_path(name, params, is_leaf=is_table)


def without_tables(tree: Any, params: Any = None) -> Any:
    """`tree` (parameters, or a tree shaped like them) with None where `params` (default:
    `tree`) has tables: the dense part, which the optimizer trains."""
    if params is None:
        return jax.tree.map(lambda x: None if is_table(x) else x, tree, is_leaf=is_table)
    dense = lambda x, p: None if is_table(p) else x  # noqa: E731
    return jax.tree.map(dense, tree, params, is_leaf=lambda x: is_table(x) or x is None)


def tables(params: Any) -> dict[str, SparseTable]:
    """The named tables of `params` (see `name_tables`), by name."""
    found = [x for x in jax.tree.leaves(params, is_leaf=is_table) if is_table(x)]
    return {t.get_metadata()["table_name"]: t for t in found}


def touched_rows(
    probe: Callable[[], Any], named: Mapping[str, SparseTable], mesh: Mesh | None = None
) -> dict[str, TouchedRows]:
    """The rows of each of the `named` tables that `probe()` (a loss call on named tables)
    looks up: each table's distinct ids over every lookup, sorted, padded with its row count
    (under `mesh`, on every device), and how many ids were outside the table.

    Raises:
      ValueError: if the probe looks up a table that is not among `named`.
    """
    with lookup_scope() as seen:
        probe()
    unknown = sorted(set(seen) - set(named), key=str)
    if unknown:
        raise ValueError(
            f"the loss looks up sparse table(s) {unknown} that are not in the parameters "
            f"(tables: {sorted(named)}); a table must be a parameter to train"
        )
    touched = {}
    for name, table in named.items():
        size = table.shape[0]
        ids = [jnp.ravel(i).astype(jnp.int32) for i in seen.get(name, [])]
        flat = jnp.concatenate(ids) if ids else jnp.zeros((0,), jnp.int32)
        if mesh is not None:  # every device deduplicates the whole batch's ids
            flat = jax.lax.with_sharding_constraint(flat, NamedSharding(mesh, PartitionSpec()))
        inside = (flat >= 0) & (flat < size)
        flat = jnp.where(inside, flat, size)
        distinct = jnp.unique(flat, size=min(flat.size, size), fill_value=size) if ids else flat
        touched[name] = TouchedRows(distinct, size, jnp.sum(~inside, dtype=jnp.float32))
    return touched


# -- rows to and from their owners --------------------------------------------------------------


def _on_shards(fn: Callable[..., Any], mesh: Mesh | None, axes: Sequence[str], specs: Any) -> Any:
    """`fn` run on each device's blocks (split over `axes` as `specs` say), or as it is when
    nothing is split."""
    if not axes:
        return fn
    in_specs, out_specs = specs
    manual = manual_axes(mesh, axes)
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=manual)


def _owned(ids: jax.Array, block: jax.Array, axes: Sequence[str]) -> jax.Array:
    """The positions of `ids` in this device's block of rows; ``len(block)`` (outside the
    block: a gather reads zero there, a scatter drops it) for ids another device owns."""
    n = block.shape[0]
    at = ids - (jax.lax.axis_index(tuple(axes)) * n if axes else 0)
    return jnp.where((at >= 0) & (at < n), at, n)


def _on_host(x: jax.Array) -> bool:
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def _owned_span(ids: jax.Array, block: jax.Array, axes: Sequence[str]) -> tuple[jax.Array, ...]:
    """(first, lo, hi): the id of this device's first row, and the positions ``[lo, hi)`` in
    `ids` (sorted) of the ids its block holds."""
    first = jax.lax.axis_index(tuple(axes)) * block.shape[0] if axes else 0
    return first, jnp.searchsorted(ids, first), jnp.searchsorted(ids, first + block.shape[0])


def _varying(tree: Any, axes: Sequence[str]) -> Any:
    """`tree` marked as differing over `axes` (a loop carry that each device fills alike)."""
    if not axes:
        return tree
    return jax.tree.map(lambda x: jax.lax.pcast(x, tuple(axes), to="varying"), tree)


def _read_host_rows(blocks: Any, ids: jax.Array, axes: Sequence[str]) -> Any:
    """The rows of (sorted) `ids` that host-resident `blocks` hold, copied one at a time to
    device memory, zeros for the others: XLA moves each row by itself (a dynamic slice of host
    memory), so no block is ever copied whole to the device."""
    first, lo, hi = _owned_span(ids, jax.tree.leaves(blocks)[0], axes)

    def read(i: jax.Array, rows: Any) -> Any:
        def one(out: jax.Array, block: jax.Array) -> jax.Array:
            row = jax.lax.dynamic_slice_in_dim(block, ids[i] - first, 1)
            return jax.lax.dynamic_update_slice_in_dim(out, jax.device_put(row, _DEVICE), i, 0)

        return jax.tree.map(one, rows, blocks)

    zeros = jax.tree.map(lambda b: jnp.zeros((ids.size, *b.shape[1:]), b.dtype), blocks)
    return jax.lax.fori_loop(lo, hi, read, _varying(zeros, axes))


def _write_host_rows(blocks: Any, rows: Any, ids: jax.Array, axes: Sequence[str]) -> Any:
    """`blocks` (host-resident) with the `rows` of the (sorted) `ids` they hold written in place,
    one row at a time from device memory."""
    first, lo, hi = _owned_span(ids, jax.tree.leaves(blocks)[0], axes)

    def write(i: jax.Array, blocks: Any) -> Any:
        def one(block: jax.Array, new: jax.Array) -> jax.Array:
            row = jax.device_put(jax.lax.dynamic_slice_in_dim(new, i, 1).astype(block.dtype), _HOST)
            return jax.lax.dynamic_update_slice_in_dim(block, row, ids[i] - first, 0)

        return jax.tree.map(one, blocks, rows)

    return jax.lax.fori_loop(lo, hi, write, blocks)


def gather_rows(
    table: jax.Array, ids: jax.Array, mesh: Mesh | None = None, axes: Sequence[str] = ()
) -> jax.Array:
    """The rows of `ids` (on every device) from `table`, split by rows over `axes` of `mesh`:
    each device reads the rows it owns, zeros for the others, and a sum over `axes` (one
    all-reduce) gives every device all of them. Ids outside the table read zeros. A table in
    pinned host memory takes sorted ids (`TouchedRows.ids`), and only their rows move to the
    devices."""
    axes = tuple(axes)

    def local(block: jax.Array, ids: jax.Array) -> jax.Array:
        if _on_host(block):
            rows = _read_host_rows(block, ids, axes)
        else:
            rows = block.at[_owned(ids, block, axes)].get(mode="fill", fill_value=0)
        return jax.lax.psum(rows, axes) if axes else rows

    rows_spec = PartitionSpec(axes)
    return _on_shards(local, mesh, axes, ((rows_spec, PartitionSpec()), PartitionSpec()))(
        table, ids
    )


def scatter_rows(
    rule: SparseRule,
    table: jax.Array,
    slots: Any,
    ids: jax.Array,
    grads: jax.Array,
    mesh: Mesh | None = None,
    axes: Sequence[str] = (),
) -> tuple[jax.Array, Any]:
    """`rule` applied to the rows of `ids` (distinct; the padding id ``V`` is skipped) with
    their `grads` (both on every device), and to their `slots`, on the device that owns each
    row (`table` and `slots` split by rows over `axes`), in place. Nothing is sent. A table
    in pinned host memory (and its slots) takes sorted ids, and its touched rows move to the
    device, are updated there and are written back in place."""
    axes = tuple(axes)

    def local(block: jax.Array, slots: Any, ids: jax.Array, grads: jax.Array) -> Any:
        if _on_host(block):
            rows, own_slots = rule.update(*_read_host_rows((block, slots), ids, axes), grads)
            return _write_host_rows((block, slots), (rows, own_slots), ids, axes)
        at = _owned(ids, block, axes)
        read = lambda x: x.at[at].get(mode="fill", fill_value=0)  # noqa: E731
        rows, own_slots = rule.update(read(block), jax.tree.map(read, slots), grads)
        write = lambda x, new: x.at[at].set(new.astype(x.dtype), mode="drop")  # noqa: E731
        return write(block, rows), jax.tree.map(write, slots, own_slots)

    split, whole = PartitionSpec(axes), PartitionSpec()
    slot_specs = jax.tree.map(lambda _: split, slots)
    specs = ((split, slot_specs, whole, whole), (split, slot_specs))
    return _on_shards(local, mesh, axes, specs)(table, slots, ids, grads)


def row_views(
    params: Any,
    touched: Mapping[str, TouchedRows],
    mesh: Mesh | None = None,
    axes: Sequence[str] = (),
) -> Any:
    """`params` with each named table's value replaced by its touched rows ``[U, D]``
    (`gather_rows`), which the lookups read under ``lookup_scope(touched)``."""

    def view(leaf: Any) -> Any:
        if not is_table(leaf):
            return leaf
        ids = touched[leaf.get_metadata()["table_name"]].ids
        return leaf.replace(gather_rows(leaf[...], ids, mesh, axes))

    return jax.tree.map(view, params, is_leaf=is_table)


def init_slots(rules: Mapping[str, SparseRule], named: Mapping[str, SparseTable]) -> dict:
    """Each table's optimizer slots, by name, from its rule."""
    return {name: rules[name].init(table[...]) for name, table in named.items()}


def apply_rows(
    rules: Mapping[str, SparseRule],
    params: Any,
    slots: Mapping[str, Any],
    touched: Mapping[str, TouchedRows],
    grads: Any,
    mesh: Mesh | None = None,
    axes: Sequence[str] = (),
) -> tuple[Any, dict]:
    """Every named table of `params` after its rule's update of its touched rows with their
    gradients (a table's entry in `grads`: ``[U, D]``, as `value_and_grad` gives), and the
    new `slots`; the other parameters are returned as they are."""
    new_slots = dict(slots)

    def update(leaf: Any, grad: Any) -> Any:
        if not is_table(leaf):
            return leaf
        name = leaf.get_metadata()["table_name"]
        rows, new_slots[name] = scatter_rows(
            rules[name], leaf[...], slots[name], touched[name].ids, grad[...], mesh, axes
        )
        return leaf.replace(rows)

    return jax.tree.map(update, params, grads, is_leaf=is_table), new_slots


def touched_views(
    loss_fn: Callable[..., Any],
    params: Any,
    args: tuple[Any, ...],
    mesh: Mesh | None = None,
    axes: Sequence[str] = (),
) -> tuple[Any, Callable[..., Any], dict[str, TouchedRows]]:
    """(views, loss, touched): `params` with their tables named and each table's value the rows
    ``loss_fn(params, *args)`` touches (`row_views`), `loss_fn` reading its lookups from such
    views, and the `touched` rows (`touched_rows`) that `apply_rows` takes."""
    named = name_tables(params)
    touched = touched_rows(lambda: loss_fn(named, *args), tables(named), mesh)

    def replaying(*call: Any) -> Any:
        with lookup_scope(touched):
            return loss_fn(*call)

    return row_views(named, touched, mesh, axes), replaying, touched


def value_and_grad(
    loss_fn: Callable[..., jax.Array], mesh: Mesh | None = None, axes: Sequence[str] = ()
) -> Callable[..., tuple[jax.Array, Any, dict[str, TouchedRows]]]:
    """``fn(params, *args) -> (loss, grads, touched)``: the gradients of
    ``loss_fn(params, *args)``, where each sparse table's gradient is its touched rows'
    ``[U, D]`` (with `params`' tables named by `name_tables`), and the `touched` rows that
    `apply_rows` takes."""

    def fn(params: Any, *args: Any) -> tuple[jax.Array, Any, dict[str, TouchedRows]]:
        views, replaying, touched = touched_views(loss_fn, params, args, mesh, axes)
        loss, grads = jax.value_and_grad(replaying)(views, *args)
        return loss, grads, touched

    return fn


# -- Geo-SGD -------------------------------------------------------------------------------------


class GeoRows(NamedTuple):
    """A table's Geo-SGD state on one replica.

    Attributes:
      old: the rows as the servers held them at the last exchange (Paddle's `old_scope`), the
        same on every replica.
      changed: which rows this replica updated since then (bool, one per row).
    """

    old: jax.Array
    changed: jax.Array


class TablesState(NamedTuple):
    """The optimizer state of a step with sparse tables.

    Attributes:
      dense: the optimizer's state for the dense parameters.
      slots: each table's rule slots (one row per table row), by table name.
      geo: under Geo-SGD, each table's exchange state (`GeoRows`), by name; else None.
    """

    dense: Any
    slots: dict[str, Any]
    geo: dict[str, GeoRows] | None


def geo_init(table: jax.Array) -> GeoRows:
    """The Geo-SGD state of a freshly initialised `table` ``[V, D]``."""
    return GeoRows(jnp.asarray(table), jnp.zeros(table.shape[:1], bool))


def geo_exchange(
    table: jax.Array, geo: GeoRows, capacity: int, axes: Sequence[str]
) -> tuple[jax.Array, GeoRows]:
    """Paddle's Geo exchange of the rows the replicas changed (`geo.changed`, at most
    `capacity` per replica), inside `jax.shard_map` over the replica `axes`: each replica's
    ids are gathered, and every changed row is exchanged by `fleetjax.optimizers.geo_merge`
    (a replica sends only the rows it changed, as Paddle does)."""
    axes, size = tuple(axes), table.shape[0]
    mine = jnp.nonzero(geo.changed, size=min(capacity, size), fill_value=size)[0]
    every = jax.lax.all_gather(mine, axes, tiled=True)
    ids = jnp.unique(every, size=min(every.size, size), fill_value=size)
    read = lambda x: x.at[ids].get(mode="fill", fill_value=0)  # noqa: E731
    latest, server = geo_merge(read(table), read(geo.old), axes, read(geo.changed)[:, None])
    write = lambda x, new: x.at[ids].set(new.astype(x.dtype), mode="drop")  # noqa: E731
    return write(table, latest), GeoRows(write(geo.old, server), jnp.zeros_like(geo.changed))
