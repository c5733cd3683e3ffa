"""A train step's sparse tables (Paddle's parameter-server mode): which they are, their rules,
and the step's part for them.

Where the parameters hold `fleetjax.layers.SparseTable`s, `Tables.find` finds them once, with
the step's placement (`fleetjax.step.StepSpec`), and the step does

    params, opt_state = tables.init(optimizer, params)    # tables named, slots made
    rows = tables.touched(loss_fn, has_state, params, model_state, batch, rest)
    ... the gradient chain on rows.params (each table its touched rows) with rows.loss_fn ...
    params, opt_state = rows.apply(optimizer, grads, opt_state, params, step, loss)

so every transform of the chain (AMP, loss scaling, recompute, in-step merge, the reducers,
ZeRO) sees each table as a ``[U, D]`` parameter of the rows the batch touches, and the optimizer
sees only the dense parameters. `fleetjax.transforms.sparse_rows` does the work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fleetjax._checks import init_optimizer
from fleetjax.layers import is_table, logical_to_spec
from fleetjax.layers.sparse_embedding import TABLE_ROWS, TouchedRows, on_host
from fleetjax.mesh import data_axes, spec_axes
from fleetjax.optimizers import STEP_SWITCHES, check_combination, sparse_rules
from fleetjax.optimizers.sparse_rules import SparseRule
from fleetjax.plan import Plan, SparseTableConfig
from fleetjax.transforms import sparse_rows
from fleetjax.transforms.sparse_rows import GeoRows, TablesState

__all__ = ["Rows", "Tables", "in_host_memory"]


@dataclasses.dataclass(frozen=True)
class Rows:
    """What one step's gradient chain trains (`Tables.touched`).

    Attributes:
      params: the parameters, each table's value its touched rows ``[U, D]``.
      loss_fn: the user's loss, its lookups reading those rows.
      touched: each table's distinct ids, by name.
      tables: the step's tables.
    """

    params: Any
    loss_fn: Callable[..., Any]
    touched: dict[str, TouchedRows]
    tables: Tables

    @property
    def metrics(self) -> dict[str, jax.Array]:
        """What the step reports of its tables: ``"ids_outside/<table name>"``, how many of
        the batch's ids were outside the table (they read zero rows and train nothing; under
        Geo-SGD the replicas' mean)."""
        return {f"ids_outside/{name}": t.outside for name, t in self.touched.items()}

    def apply(
        self,
        optimizer: optax.GradientTransformationExtraArgs,
        grads: Any,
        opt_state: TablesState,
        params: Any,
        step: jax.Array,
        loss: jax.Array,
    ) -> tuple[Any, TablesState]:
        """The optimizer's step of the dense parameters (`loss` is its `value`) and each
        table's rule on its touched rows (under Geo-SGD, then the exchange every
        `geo_k_steps` steps)."""
        tables = self.tables
        dense = sparse_rows.without_tables(params)
        updates, dense_state = optimizer.update(
            sparse_rows.without_tables(grads), opt_state.dense, dense, value=loss
        )
        dense = optax.apply_updates(dense, updates)
        params = jax.tree.map(lambda p, n: p if is_table(p) else n, params, dense, is_leaf=is_table)
        mesh = None if tables.geo_k_steps else tables.mesh
        params, slots = sparse_rows.apply_rows(
            tables.rules, params, opt_state.slots, self.touched, grads, mesh, tables.axes
        )
        geo = opt_state.geo
        if geo is not None:
            params, geo = tables.geo(params, geo, self.touched, step)
        return params, TablesState(dense_state, slots, geo)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _rule(config: SparseTableConfig, dim: int) -> SparseRule:
    """The table's `SparseAccessor` rule; its config's dimensions must fit the table."""
    where = f"sparse_table_configs[{config.table_name!r}].accessor"
    expected = {"embedx_dim": (config.embedx_dim, dim - 1), "fea_dim": (config.fea_dim, dim + 2)}
    for name, (given, wanted) in expected.items():
        if given is not None and given != wanted:
            raise ValueError(
                f"{where}.{name}={given} contradicts the table {config.table_name!r}, whose "
                f"embedding_dim is {dim}: Paddle's SparseAccessor has embedx_dim = "
                f"embedding_dim - 1 = {dim - 1} and fea_dim = embedding_dim + 2 = {dim + 2}"
            )
    made = lambda r: sparse_rules.paddle_rule(r.name, **r.params)  # noqa: E731
    return sparse_rules.sparse_accessor(made(config.embed), made(config.embedx))


def _check_combinations(plan: Plan, found: Mapping[str, Any]) -> None:
    """Sparse tables' clashes with the plan's switches (`fleetjax.optimizers.check_combination`):
    the model has tables, and perhaps some in pinned host memory (named by the first)."""
    on = {**plan.switches, "sparse_tables": STEP_SWITCHES["sparse_tables"]}
    host = sorted(name for name, table in found.items() if on_host(table))
    if host:
        on["host_tables"] = f"sparse table {host[0]!r} with memory_kind='pinned_host'"
    check_combination(on)


def _pinned(sharding: NamedSharding) -> NamedSharding:
    """`sharding` in pinned host memory. Compile-only devices have no memory spaces, so their
    shardings drop the kind; one on the mesh's abstract mesh keeps it, and a step lowered for
    them (under `jax.set_mesh`) keeps the array in host memory as XLA does for real devices."""
    host = sharding.with_memory_kind("pinned_host")
    if host.memory_kind == "pinned_host":
        return host
    return NamedSharding(sharding.mesh.abstract_mesh, sharding.spec, memory_kind="pinned_host")


def in_host_memory(params: Any, params_at: Any, opt_at: Any = None) -> tuple[Any, Any]:
    """`params_at` and `opt_at` (shardings like `params` and the optimizer state) with the rows
    and the slots of the tables made with ``memory_kind="pinned_host"`` in pinned host
    memory; as they are where `params` has no such table."""

    def rows(at: Any, p: Any) -> Any:
        if not (is_table(p) and on_host(p)):
            return at
        return at.replace(_pinned(at.get_value())) if is_table(at) else _pinned(at)

    params_at = jax.tree.map(rows, params_at, params, is_leaf=is_table)
    if isinstance(opt_at, TablesState):
        host = {name for name, table in sparse_rows.tables(params).items() if on_host(table)}
        pinned = lambda name, at: jax.tree.map(_pinned, at) if name in host else at  # noqa: E731
        opt_at = opt_at._replace(slots={n: pinned(n, at) for n, at in opt_at.slots.items()})
    return params_at, opt_at


@dataclasses.dataclass(frozen=True)
class Tables:
    """The sparse tables of a step: each one's rule, where their rows live, Geo-SGD's interval.

    Attributes:
      rules: each table's rule, by name.
      mesh: the mesh.
      axes: the mesh axes a table's rows are split over; () under Geo-SGD, where every
        replica holds its own copy.
      geo_k_steps: Geo-SGD's exchange interval; 0 for the synchronous step.
    """

    rules: Mapping[str, SparseRule]
    mesh: Mesh
    axes: tuple[str, ...]
    geo_k_steps: int

    @classmethod
    def find(cls, plan: Plan, mesh: Mesh, params: Any) -> Tables | None:
        """The tables of `params` (arrays or shapes) under `plan`, or None if it has none.

        Raises:
          ValueError: for a table config naming no table of the model or contradicting its
            table, or a strategy switch tables do not combine with.
        """
        found = sparse_rows.tables(sparse_rows.name_tables(params))
        server = plan.parameter_server
        unknown = sorted({c.table_name for c in server.tables} - set(found))
        if unknown:
            raise ValueError(
                f"sparse_table_configs names {unknown}, but the model's sparse tables are "
                f"{sorted(found)} (a SparseEmbedding's table_name, else its parameter path)"
            )
        if not found:
            return None
        _check_combinations(plan, found)
        rules = {name: _rule(server.table(name), t.shape[1]) for name, t in found.items()}
        geo = server.geo_k_steps
        axes = () if geo else spec_axes(logical_to_spec((TABLE_ROWS, None), mesh=mesh))
        return cls(rules, mesh, axes, geo)

    def opt_specs(self, dense: Any, opt_state: TablesState, params: Any, specs: Any) -> TablesState:
        """The specs of a `TablesState`: the dense optimizer state's `dense`, and each table's
        slots (and Geo-SGD's exchange state) split as the table's rows, which `specs` (shaped
        like `params`) give.

        Raises:
          ValueError: for a table whose spec splits none of its axes.
        """
        row_axes = {}

        def note(table: Any, spec: Any) -> None:
            if is_table(table):
                spec = spec.get_value() if is_table(spec) else spec  # nnx keeps the wrapper
                name = table.get_metadata()["table_name"]
                if not isinstance(spec, PartitionSpec) or not spec:
                    raise ValueError(
                        f"param_specs gives sparse table {name!r} {spec!r}, which splits none of "
                        "its axes; a table's rows are split over the mesh, its spec names their "
                        "axes first (fleetjax.layers.partition_specs gives each table's)"
                    )
                row_axes[name] = PartitionSpec(spec[0])

        jax.tree.map(note, params, specs, is_leaf=is_table)

        def by_name(tree: dict[str, Any]) -> dict[str, Any]:
            return {n: jax.tree.map(lambda _, s=row_axes[n]: s, v) for n, v in tree.items()}

        geo = None if opt_state.geo is None else by_name(opt_state.geo)
        return TablesState(dense, by_name(opt_state.slots), geo)

    @staticmethod
    def grad_specs(specs: Any, params: Any) -> Any:
        """The gradients' `specs` with each table's gradient (its touched rows, a
        `SparseTable` of them) whole on every device."""

        def whole(spec: Any, x: Any) -> Any:
            return x.replace(PartitionSpec()) if is_table(x) else spec

        return jax.tree.map(whole, specs, params, is_leaf=lambda s: _is_spec(s) or is_table(s))

    def touched(
        self,
        loss_fn: Callable[..., Any],
        has_state: bool,
        params: Any,
        model_state: Any,
        batch: Any,
        rest: tuple[Any, ...],
    ) -> Rows:
        """The rows `loss_fn` (taking the model state too if `has_state`) touches on `batch`,
        fetched from their owners (see `Rows`)."""
        state = (model_state,) if has_state else ()
        mesh = None if self.geo_k_steps else self.mesh  # Geo: inside each replica
        views, replaying, touched = sparse_rows.touched_views(
            loss_fn, params, (*state, batch, *rest), mesh, self.axes
        )
        return Rows(views, replaying, touched, self)

    def init(self, optimizer: optax.GradientTransformation, params: Any) -> tuple[Any, TablesState]:
        """(params, optimizer state) of a fresh step: the tables named, the optimizer's state of
        the dense parameters, each table's slots and, under Geo-SGD, its exchange state."""
        params = sparse_rows.name_tables(params)
        found = sparse_rows.tables(params)
        geo = None
        if self.geo_k_steps:
            geo = {name: sparse_rows.geo_init(table[...]) for name, table in found.items()}
        dense = init_optimizer(optimizer, sparse_rows.without_tables(params))
        return params, TablesState(dense, sparse_rows.init_slots(self.rules, found), geo)

    def geo(
        self, params: Any, geo: dict[str, GeoRows], touched: dict[str, TouchedRows], step: Any
    ) -> tuple[Any, dict[str, GeoRows]]:
        """Mark this step's rows changed; every `geo_k_steps`-th step, exchange them."""
        geo = {
            name: g._replace(changed=g.changed.at[touched[name].ids].set(True, mode="drop"))
            for name, g in geo.items()
        }
        axes = data_axes(self.mesh)

        def exchange(params: Any, geo: dict[str, GeoRows]) -> tuple[Any, dict[str, GeoRows]]:
            out = dict(geo)

            def one(leaf: Any) -> Any:
                if not is_table(leaf):
                    return leaf
                name = leaf.get_metadata()["table_name"]
                capacity = self.geo_k_steps * touched[name].ids.size
                rows, out[name] = sparse_rows.geo_exchange(leaf[...], geo[name], capacity, axes)
                return leaf.replace(rows)

            return jax.tree.map(one, params, is_leaf=is_table), out

        due = (step + 1) % self.geo_k_steps == 0
        return lax.cond(due, exchange, lambda p, g: (p, g), params, geo)
