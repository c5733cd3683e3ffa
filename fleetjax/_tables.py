"""A train step's sparse tables (Paddle's parameter-server mode): which they are, their rules,
and the step's part for them.

Where the parameters hold `fleetjax.layers.SparseTable`s the step (fleetjax.step) does

    params, opt_state = init_state(plan, mesh, optimizer, params)    # tables named, slots made
    rows = step_rows(plan, mesh, loss_fn, signature, state, batch, rest)
    ... the gradient chain on rows.params (each table its touched rows) with rows.loss_fn ...
    params, opt_state = rows.apply(optimizer, grads, opt_state, params, step, loss)

so every transform of the chain (AMP, loss scaling, recompute, in-step merge, the reducers,
ZeRO) sees each table as a ``[U, D]`` parameter of the rows the batch touches, and the optimizer
sees only the dense parameters. `fleetjax.transforms.sparse_rows` does the work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import optax
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from fleetjax._checks import init_optimizer
from fleetjax.layers import is_table, logical_to_spec
from fleetjax.layers.sparse_embedding import TABLE_ROWS, TouchedRows, lookup_scope, on_host
from fleetjax.mesh import data_axes, spec_axes
from fleetjax.plan import Plan, SparseTableConfig
from fleetjax.transforms import sparse_rows
from fleetjax.transforms.sparse_rows import GeoRows, SparseRule

__all__ = ["Rows", "Tables", "TablesState", "init_state", "slot_specs", "step_rows"]


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


@dataclasses.dataclass(frozen=True)
class Rows:
    """What one step's gradient chain trains (`step_rows`).

    Attributes:
      params: the parameters, each table's value its touched rows ``[U, D]``.
      loss_fn: the user's loss, its lookups reading those rows.
      touched: each table's distinct ids, by name.
      tables: the step's tables (None: the model has none, and `params` and `loss_fn` are
        the step's own).
    """

    params: Any
    loss_fn: Callable[..., Any]
    touched: dict[str, TouchedRows]
    tables: Tables | None

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


def step_rows(
    plan: Plan,
    mesh: Mesh,
    loss_fn: Callable[..., Any],
    signature: Any,
    state: Any,
    batch: Any,
    rest: tuple[Any, ...],
) -> Rows:
    """What the gradient chain of a step on `state` (a `TrainState`) trains: with sparse
    tables, each table as the rows `batch` touches (`Tables.touched`); without, the
    parameters and `loss_fn` as they are. `signature` is the loss's (`fleetjax._chain`)."""
    tables = Tables.find(plan, mesh, state.params)
    if tables is None:
        return Rows(state.params, loss_fn, {}, None)
    has_state = signature.has_state
    return tables.touched(loss_fn, has_state, state.params, state.model_state, batch, rest)


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
    made = lambda r: sparse_rows.paddle_rule(r.name, **r.params)  # noqa: E731
    return sparse_rows.sparse_accessor(made(config.embed), made(config.embedx))


def _check_combinations(plan: Plan) -> None:
    clash = (
        "the pipeline (a table is looked up in the model's first stage only)"
        if plan.pipeline is not None
        else f"{plan.optimizer.name} (it steps each replica's own optimizer)"
        if plan.per_replica and plan.optimizer.name != "geo"
        else "gradient merge across calls (a table's touched rows change from step to step; "
        "use the in-step merge, Strategy.gradient_merge or gradient_merge_configs.mode="
        "'in_step')"
        if plan.gradient_merge is not None and not plan.gradient_merge.in_step
        else None
    )
    if clash:
        raise ValueError(f"sparse tables do not combine with {clash}")


def _check_host_tables(plan: Plan, found: Mapping[str, Any]) -> None:
    """Geo-SGD keeps a whole copy of every table on each replica and exchanges it by gathers:
    host memory cannot hold that plan."""
    host = sorted(name for name, table in found.items() if on_host(table))
    k_steps = plan.parameter_server.geo_k_steps
    if host and k_steps:
        raise ValueError(
            f"sparse table {host[0]!r} has memory_kind='pinned_host', which does not combine "
            f"with Geo-SGD (a_sync=True, a_sync_configs.k_steps={k_steps}): each replica "
            "keeps and exchanges a whole copy of the table; use memory_kind='device', or the "
            "synchronous step (a_sync=False)"
        )


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
        _check_combinations(plan)
        _check_host_tables(plan, found)
        rules = {name: _rule(server.table(name), t.shape[1]) for name, t in found.items()}
        geo = server.geo_k_steps
        axes = () if geo else spec_axes(logical_to_spec((TABLE_ROWS, None), mesh=mesh))
        return cls(rules, mesh, axes, geo)

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
        named = sparse_rows.name_tables(params)
        state = (model_state,) if has_state else ()
        mesh = None if self.geo_k_steps else self.mesh  # Geo: inside each replica
        touched = sparse_rows.touched_rows(
            lambda: loss_fn(named, *state, batch, *rest), sparse_rows.tables(named), mesh
        )

        def replaying(*args: Any) -> Any:
            with lookup_scope(touched):
                return loss_fn(*args)

        views = sparse_rows.row_views(named, touched, mesh, self.axes)
        return Rows(views, replaying, touched, self)

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


def init_state(
    plan: Plan, mesh: Mesh, optimizer: optax.GradientTransformation, params: Any
) -> tuple[Any, Any]:
    """(params, optimizer state) of a fresh step: with sparse tables, the tables named and a
    `TablesState` (the optimizer's state of the dense parameters, each table's slots)."""
    tables = Tables.find(plan, mesh, params)
    if tables is None:
        return params, init_optimizer(optimizer, params)
    params = sparse_rows.name_tables(params)
    found = sparse_rows.tables(params)
    geo = None
    if tables.geo_k_steps:
        geo = {name: sparse_rows.geo_init(table[...]) for name, table in found.items()}
    dense = init_optimizer(optimizer, sparse_rows.without_tables(params))
    return params, TablesState(dense, sparse_rows.init_slots(tables.rules, found), geo)


def slot_specs(opt_state: TablesState, params: Any, specs: Any) -> tuple[dict, dict | None]:
    """(slots, geo) specs of a `TablesState`: split over the axes of their table's rows, which
    `specs` (shaped like `params`) give."""
    row_axes = {}

    def note(table: Any, spec: Any) -> None:
        if is_table(table):
            spec = spec.get_value() if is_table(spec) else spec  # nnx keeps the wrapper
            name = table.get_metadata()["table_name"]
            if not isinstance(spec, PartitionSpec) or not spec:
                raise ValueError(
                    f"param_specs gives sparse table {name!r} {spec!r}, which splits none of its "
                    "axes; a table's rows are split over the mesh, its spec names their axes "
                    "first (fleetjax.layers.partition_specs gives each table's)"
                )
            row_axes[name] = PartitionSpec(spec[0])

    jax.tree.map(note, params, specs, is_leaf=is_table)

    def by_name(tree: dict[str, Any]) -> dict[str, Any]:
        return {name: jax.tree.map(lambda _, s=row_axes[name]: s, v) for name, v in tree.items()}

    return by_name(opt_state.slots), None if opt_state.geo is None else by_name(opt_state.geo)
