"""Sparse embedding tables: Paddle's parameter-server `sparse_embedding` as a flax nnx layer.

A `SparseTable` is an embedding table ``[num_embeddings, embedding_dim]`` whose rows are split
over every device of the mesh (logical axes ``("table_rows", "embed")``; the rule maps
``"table_rows"`` to all mesh axes), and which trains by updating only the rows a batch touched,
with Paddle's sparse rules (`fleetjax.optimizers.sparse_rules`, applied by
`fleetjax.transforms.sparse_rows`), never by the optimizer.

    emb = fleetjax.layers.SparseEmbedding(1_000_000, 16, table_name="embedding", rngs=rngs)
    rows = emb(ids)                                   # ids.shape + (16,)

Outside a train step a lookup is a plain gather. Inside one the step has already deduplicated
the batch's ids and fetched their rows from the devices that own them (`lookup_scope`): the
lookup then reads those rows, and the gradient it leaves is one row per distinct id.

With ``memory_kind="pinned_host"`` the table's rows (and its rule's slots) live in the devices'
pinned host memory, still split by rows over every device, for tables beyond device memory: a
train step moves only the batch's rows to the devices and writes them back.

Ids must be in ``[0, num_embeddings)`` (Paddle's tables are hash maps of any 64-bit id; hash
yours into the range first). An id outside reads a zero row and trains nothing, and a train
step counts such ids in its metrics (``"ids_outside/<table name>"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax.layers._params import check_sizes

__all__ = [
    "TABLE_MEMORY_KINDS",
    "TABLE_ROWS",
    "SparseEmbedding",
    "SparseTable",
    "TouchedRows",
    "is_table",
    "lookup",
    "on_host",
    "lookup_scope",
    "sparse_table",
]

TABLE_ROWS = "table_rows"  # the logical name of a table's row dimension
TABLE_MEMORY_KINDS = ("device", "pinned_host")  # where a table's rows can live


class SparseTable(nnx.Param):
    """A sparse embedding table: a parameter that trains by row updates.

    Metadata: ``table_name``, Paddle's table name, which `sparse_table_configs` are keyed by
    (None: the train step names it by its path in the parameters), and ``memory_kind``, where
    a train step keeps its rows and slots (`TABLE_MEMORY_KINDS`). Make one with `sparse_table`.
    """


def sparse_table(
    rows: jax.Array, *, table_name: str | None = None, memory_kind: str = "device"
) -> SparseTable:
    """`rows` ``[num_embeddings, embedding_dim]`` as a `SparseTable`, for a plain pytree of
    parameters (`SparseEmbedding` makes its own). `memory_kind` is where a train step keeps
    the rows and their slots: ``"device"``, or ``"pinned_host"`` for a table beyond the
    devices' memory (`jax.sharding.NamedSharding`'s memory kinds)."""
    if jnp.ndim(rows) != 2:
        raise ValueError(
            f"a sparse table is [num_embeddings, embedding_dim], got shape {jnp.shape(rows)}"
        )
    if table_name is not None and not (isinstance(table_name, str) and table_name):
        raise ValueError(f"table_name must be a non-empty str or None, got {table_name!r}")
    if memory_kind not in TABLE_MEMORY_KINDS:
        raise ValueError(
            f"sparse table {table_name!r}: memory_kind={memory_kind!r}; a table's rows live in "
            f"one of {TABLE_MEMORY_KINDS}"
        )
    return SparseTable(
        rows,
        out_sharding=(TABLE_ROWS, "embed"),
        eager_sharding=False,
        table_name=table_name,
        memory_kind=memory_kind,
    )


def is_table(x: Any) -> bool:
    """Whether `x` is a `SparseTable` (an `is_leaf` for `jax.tree` functions)."""
    return isinstance(x, SparseTable)


def on_host(table: SparseTable) -> bool:
    """Whether a train step keeps `table`'s rows in pinned host memory."""
    return table.get_metadata().get("memory_kind") == "pinned_host"


def _paddle_init(initial_range: float) -> nnx.Initializer:
    """Paddle's `SparseAccessor` start: the first column (`embed_w`) zero (`zero_init`), the
    others (`embedx`) uniform in ``[-initial_range, initial_range]``; a one-column table is
    uniform (Paddle turns `zero_init` off when `embedx_dim` is 0)."""

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        rows = jax.random.uniform(key, shape, dtype, -initial_range, initial_range)
        return rows if shape[1] == 1 else rows.at[:, 0].set(0)

    return init


class SparseEmbedding(nnx.Module):
    """Paddle's `paddle.static.nn.sparse_embedding(input, size=[num_embeddings, embedding_dim])`:
    an embedding table sharded by rows over every device, trained by sparse row updates.

    Attributes:
      weight: the `SparseTable`.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        table_name: str | None = None,
        memory_kind: str = "device",
        initial_range: float = 1e-4,
        weight_init: nnx.Initializer | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        """`memory_kind` is where a train step keeps the rows and their slots: ``"device"``,
        or ``"pinned_host"`` for a table beyond the devices' memory (see `sparse_table`).
        `initial_range` is Paddle's sparse rule `initial_range` (the default start is Paddle's,
        see `_paddle_init`); `weight_init` replaces that start."""
        check_sizes(type(self).__name__, num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        init = weight_init if weight_init is not None else _paddle_init(initial_range)
        rows = init(rngs.params(), (num_embeddings, embedding_dim), param_dtype)
        self.weight = sparse_table(rows, table_name=table_name, memory_kind=memory_kind)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """The rows of `ids` (an integer array): ``ids.shape + (embedding_dim,)``."""
        return lookup(self.weight, ids)


# -- what a train step tells the lookups --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TouchedRows:
    """The rows of one table that a train step touches.

    Attributes:
      ids: the distinct ids the step looks up, sorted, padded with `num_embeddings` (int32,
        static size).
      num_embeddings: the table's row count.
      outside: how many of the looked-up ids are outside ``[0, num_embeddings)`` (float32,
        a metric).
    """

    ids: jax.Array
    num_embeddings: int
    outside: jax.Array


@dataclasses.dataclass
class _Recording:
    """Lookups seen while a train step probes its loss: ids per table name."""

    ids: dict[str, list[jax.Array]] = dataclasses.field(default_factory=dict)


_SCOPE: contextvars.ContextVar[Mapping[str, TouchedRows] | _Recording | None] = (
    contextvars.ContextVar("fleetjax_sparse_lookups", default=None)
)


@contextlib.contextmanager
def lookup_scope(
    touched: Mapping[str, TouchedRows] | None = None,
) -> Iterator[dict[str, list[jax.Array]]]:
    """How the lookups traced inside behave (the train step's side of a lookup).

    With `touched`, each table's value is its touched rows, ``[len(ids), embedding_dim]`` in
    the order of `touched[name].ids`, and a lookup reads its ids' rows there. Without, lookups
    only record their ids (by table name, in the dict this yields) and return zeros: the step
    traces the loss once that way to learn which rows it touches.
    """
    recording = _Recording() if touched is None else None
    token = _SCOPE.set(recording if touched is None else dict(touched))
    try:
        yield {} if recording is None else recording.ids
    finally:
        _SCOPE.reset(token)


def lookup(table: SparseTable, ids: jax.Array) -> jax.Array:
    """The rows of `ids` in `table`: ``ids.shape + (embedding_dim,)``; an id outside the table
    reads zeros."""
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise TypeError(f"sparse table lookup: ids must be integers, got {jnp.result_type(ids)}")
    if not is_table(table):
        raise TypeError(
            f"sparse table lookup: the table must be a SparseTable, got {type(table).__name__}"
        )
    name, rows = table.get_metadata().get("table_name"), table[...]
    scope = _SCOPE.get()
    if isinstance(scope, _Recording):
        scope.ids.setdefault(name, []).append(ids)
        return jnp.zeros((*jnp.shape(ids), rows.shape[1]), rows.dtype)
    if scope is not None and name in scope:
        touched = scope[name]
        ids = jnp.where((ids >= 0) & (ids < touched.num_embeddings), ids, touched.num_embeddings)
        at = jnp.searchsorted(touched.ids, ids.astype(touched.ids.dtype))
    else:
        at = ids
    return rows.at[at].get(mode="fill", fill_value=0, wrap_negative_indices=False)
