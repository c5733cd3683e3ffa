"""Paddle's strategy objects: `DistributedStrategy` (fleet), its `BuildStrategy` and
`ExecutionStrategy`, and the newer `Strategy` (`paddle.distributed.Strategy`).

Strategies are configuration only: they hold and validate settings and read and write
prototxt; `fleetjax.plan.read_plan` is what reads them (`fleetjax.applied_strategy(strategy)`
says what fleetjax does with one). Every field name, config key and default
is Paddle's (defaults from the seed documents where those differ from Paddle's code; see
`seed_default_differences`). Where Paddle is quirky, fleetjax is strict:

* assigning a dict to a `*_configs` field updates only the keys given; a list value replaces
  the old list (Paddle appends);
* an unknown attribute, config key or section raises `UnknownFieldError` listing the valid names
  (also a TypeError and a ValueError, what Paddle raises for it);
* a value of the wrong type raises `TypeError` (also a ValueError, as Paddle's `a_sync`) naming
  the field and the expected type, a value out of range raises `ValueError` saying what is
  allowed, and the old value stays (Paddle only warns for many fields);
* config getters return the live config, so `s.amp_configs["incr_ratio"] = 3.0` takes effect
  (in Paddle it silently does nothing);
* `repr()` shows the fields that differ from the defaults.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping
from typing import Any

from fleetjax import _prototxt, _schema
from fleetjax._config import FrozenList, Message, MessageSpec, UnknownFieldError
from fleetjax._fleet_desc import tables_from_fleet_desc
from fleetjax._prototxt import PrototxtError
from fleetjax._warnings import warn_once

__all__ = [
    "BuildStrategy",
    "DistributedStrategy",
    "ExecutionStrategy",
    "Strategy",
    "seed_default_differences",
]

seed_default_differences = _schema.seed_default_differences


class _Whole(Message):
    """A top-level strategy object; pickles by value."""

    def __reduce__(self) -> tuple[type, tuple[dict[str, Any]]]:
        return type(self), (self.set_values(),)


class BuildStrategy(_Whole):
    """`paddle.static.BuildStrategy`: graph build options (operator fusion and the like).

    Example: `fleetjax.BuildStrategy(fuse_bn_act_ops=True)`. Assigned to
    `DistributedStrategy.build_strategy` it is copied, as in Paddle.

    Besides the proto fields it has the Python-side attributes of Paddle's class
    (`nccl_comm_num`, `use_hierarchical_allreduce`, `hierarchical_allreduce_inter_nranks`,
    `sync_batch_norm`, `fuse_all_reduce_ops`, `num_trainers`, `trainer_id`,
    `trainers_endpoints`, ...), with Paddle's defaults. Paddle's fleet takes the collective ones
    from the `DistributedStrategy` fields of the same names and the trainer ones from the role
    maker, and so does fleetjax: setting one here warns once, naming where to set it.
    """

    SPEC = _schema.BUILD_STRATEGY
    ReduceStrategy = enum.IntEnum("ReduceStrategy", {"AllReduce": 0, "Reduce": 1, "_NoReduce": 2})


class ExecutionStrategy(_Whole):
    """`paddle.static.ExecutionStrategy` (Paddle 2.x): executor options.

    Paddle 3.x removed it from `DistributedStrategy`; fleetjax keeps it, reads it from 2.x
    prototxt files and writes it as extension lines that Paddle 3.x skips.
    """

    SPEC = _schema.EXECUTION_STRATEGY


# Names Paddle users write that are not proto field names: Paddle's Python-side properties, and
# three BuildStrategy fields (and the thread count) that seed 003's examples set on the strategy
# itself. Each maps to the field path that holds the value.
_ALIASES: dict[str, tuple[str, ...]] = {
    "_fuse_grad_size_in_TFLOPS": ("fuse_grad_size_in_TFLOPS",),
    "_calc_comm_same_stream": ("calc_comm_same_stream",),
    "is_with_coordinator": ("with_coordinator",),
    "hybrid_parallel_order": ("hybrid_configs", "order"),
    "sync_param_name": ("hybrid_configs", "mp_configs", "sync_param_name"),
    "fuse_all_optimizer_ops": ("build_strategy", "fuse_all_optimizer_ops"),
    "fuse_bn_act_ops": ("build_strategy", "fuse_bn_act_ops"),
    "fuse_elewise_add_act_ops": ("build_strategy", "fuse_elewise_add_act_ops"),
    "thread_num": ("execution_strategy", "num_threads"),
}


class DistributedStrategy(_Whole):
    """`paddle.distributed.fleet.DistributedStrategy`: every switch and `*_configs` block.

    Examples:
      >>> import fleetjax
      >>> s = fleetjax.DistributedStrategy()
      >>> s.hybrid_configs = {"dp_degree": 2, "mp_degree": 4}
      >>> s.amp = True
      >>> s.amp_configs = {"init_loss_scaling": 1024.0}
      >>> s
      DistributedStrategy(amp=True, amp_configs={'init_loss_scaling': 1024.0}, \
hybrid_configs={'dp_degree': 2, 'mp_degree': 4})

    Attributes are the fields of Paddle's `message DistributedStrategy` (and
    `execution_strategy`, `hybrid_parallel_order`, `sync_param_name`); `*_configs` read as live,
    validated dicts.
    """

    SPEC = _schema.DISTRIBUTED_STRATEGY

    def __getattr__(self, name: str) -> Any:
        if name in _ALIASES:
            *parents, leaf = _ALIASES[name]
            return self._descend(parents)._get(leaf)
        if name in ("sparse_table_configs", "fleet_desc_configs"):  # Paddle: one getter
            return self._sparse_table_configs()
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _ALIASES:
            *parents, leaf = _ALIASES[name]
            self._descend(parents).update({leaf: value})
        elif name == "sparse_table_configs":
            self.update({"downpour_table_param": _tables_from(value)})
        elif name == "fleet_desc_configs":
            self.update({"downpour_table_param": tables_from_fleet_desc(value)})
        elif name == "a_sync":
            # Paddle's setter: True is asynchronous and False synchronous training, so it also
            # sets a_sync_configs.k_steps to 0 (Geo-SGD is k_steps > 0, set after a_sync).
            super().__setattr__(name, value)
            self.a_sync_configs.update({"k_steps": 0})
        else:
            super().__setattr__(name, value)

    def _sparse_table_configs(self) -> FrozenList:
        """Paddle's `sparse_table_configs` (and `fleet_desc_configs`) getter: the tables of
        `downpour_table_param`, each a `TableParameter` config with every field readable
        (defaults included), its repeated messages too. They are read-only copies: assign
        `sparse_table_configs` (or `downpour_table_param`) to change them."""
        return self.downpour_table_param

    def _descend(self, path: list[str]) -> Message:
        target: Message = self
        for name in path:
            target = target._get(name)
        return target

    def save_to_prototxt(self, output: str | os.PathLike) -> None:
        """Write the strategy to `output` in Paddle's prototxt format (atomically: `output`
        holds the old text or the new, never a part; a replaced file keeps its mode).

        Records the fields that were set, plus the fields whose fleetjax default (the seeds')
        differs from Paddle's, so that Paddle reads the same strategy.

        Raises:
          OSError: if `output` cannot be written (naming `output`).
        """
        text = _prototxt.format(self.SPEC, _with_seed_defaults(self.SPEC, self.set_values()))
        _prototxt.write_file(output, text)

    def load_from_prototxt(self, pb_file: str | os.PathLike) -> DistributedStrategy:
        """Set the fields that the prototxt file `pb_file` records; returns self.

        Files written by Paddle 2.x and 3.x load. As with dict assignment, repeated fields in the
        file replace the current lists (Paddle appends, so loading twice doubled them).

        Raises:
          PrototxtError: naming the file and, for an unknown field, a malformed value or bytes
            that are not UTF-8 text, the line.
          OSError: if the file cannot be read.
        """
        text = _prototxt.read_file(pb_file)
        values = _prototxt.parse(text, self.SPEC, source=os.fspath(pb_file))
        try:
            self.update(values)
        except (KeyError, TypeError, ValueError) as e:
            raise PrototxtError(f"{os.fspath(pb_file)}: {e}") from None
        return self

    @classmethod
    def from_prototxt(cls, pb_file: str | os.PathLike) -> DistributedStrategy:
        """A new strategy with the fields the prototxt file `pb_file` records."""
        return cls().load_from_prototxt(pb_file)

    def __dir__(self) -> list[str]:
        extra = {"sparse_table_configs", "fleet_desc_configs"}
        return sorted(set(super().__dir__()) | set(_ALIASES) | extra)

    def _enable_env(self) -> None:
        """Paddle's `_enable_env`: export the strategy's process-wide tuning as Paddle's
        `FLAGS_*` environment variables (`FLAGS_cudnn_batchnorm_spatial_persistent`,
        `FLAGS_conv_workspace_size_limit`, `FLAGS_cudnn_exhaustive_search`,
        `FLAGS_sync_nccl_allreduce`, `FLAGS_fuse_parameter_memory_size`,
        `FLAGS_fuse_parameter_groups_size`), as Paddle sets its global flags from them.
        `fleet.init` reads those variables (see docs/knobs.md) and puts the XLA flags they map
        to into effect before JAX's backend starts."""
        values = {
            "FLAGS_cudnn_batchnorm_spatial_persistent": self.cudnn_batchnorm_spatial_persistent,
            "FLAGS_conv_workspace_size_limit": int(self.conv_workspace_size_limit),
            "FLAGS_cudnn_exhaustive_search": self.cudnn_exhaustive_search,
            "FLAGS_sync_nccl_allreduce": self.sync_nccl_allreduce,
            "FLAGS_fuse_parameter_memory_size": int(self.fuse_grad_size_in_MB),
            "FLAGS_fuse_parameter_groups_size": int(self.fuse_grad_size_in_TFLOPS),
        }
        for key, value in values.items():
            os.environ[key] = str(value).lower() if isinstance(value, bool) else str(value)


def _tables_from(configs: Any) -> list[dict[str, Any]]:
    """`downpour_table_param` from Paddle's `sparse_table_configs` value: ``{table_name:
    config}``, each config in Paddle's dotted form (``{"table_parameters.<name>.accessor.
    embed_sgd_param.adagrad.learning_rate": 0.05, "table_parameters.<name>.accessor.
    table_accessor_save_param.num": 2, ...}``, a list value giving each element of a repeated
    message its own) or as nested dicts (``{"accessor": {"embed_sgd_param": {...}}}``).
    Unlike Paddle, which appends the tables and skips keys it does not know, the tables replace
    the old ones and an unknown key raises."""
    if not isinstance(configs, Mapping):
        raise TypeError(
            "sparse_table_configs must be a dict of {table_name: config}, got "
            f"{type(configs).__name__}"
        )
    tables = []
    for name, config in configs.items():
        if not isinstance(name, str) or not isinstance(config, Mapping):
            raise TypeError(
                f"sparse_table_configs: {name!r} must map a table name to a dict of settings"
            )
        prefix = f"table_parameters.{name}"
        if any(str(key).startswith("table_parameters.") for key in config):
            used: set[str] = set()
            values = _dotted(_schema.TABLE_PARAMETER, prefix, config, 0, used)
            unknown = sorted(set(config) - used)
            if unknown:
                raise UnknownFieldError(
                    f"sparse_table_configs[{name!r}]: {unknown} name no TableParameter field "
                    f"(keys are {prefix}.<field path>, e.g. {prefix}.accessor.embed_sgd_param."
                    "adagrad.learning_rate)"
                )
        else:
            values = dict(config)
        tables.append({**values, "table_name": name})
    return tables


def _dotted(
    spec: MessageSpec, prefix: str, config: Mapping[str, Any], index: int, used: set[str]
) -> dict[str, Any]:
    """The values under `prefix` of Paddle's dotted table config, for element `index` of a
    repeated message (a list value gives each element its own entry)."""
    out: dict[str, Any] = {}
    for f in spec.fields:
        key = f"{prefix}.{f.name}"
        if f.is_message and f.repeated:
            if key + ".num" in config:
                used.add(key + ".num")
                count = config[key + ".num"]
                out[f.name] = [_dotted(f.type, key, config, i, used) for i in range(count)]
        elif f.is_message:
            nested = _dotted(f.type, key, config, index, used)
            if nested:
                out[f.name] = nested
        elif key in config:
            used.add(key)
            value = config[key]
            out[f.name] = value[index] if isinstance(value, list) and not f.repeated else value
    return out


def _with_seed_defaults(spec: MessageSpec, values: dict[str, Any]) -> dict[str, Any]:
    """`values` plus every unset Paddle field whose fleetjax default differs from Paddle's."""
    out = dict(values)
    for f in spec.fields:
        if not f.paddle:
            continue
        if f.is_message and not f.repeated:
            nested = _with_seed_defaults(f.type, out.get(f.name, {}))
            if nested:
                out[f.name] = nested
        elif f.paddle_default is not None and f.name not in out:
            out[f.name] = f.default
    return out


class Strategy(_Whole):
    """`paddle.distributed.Strategy` (auto-parallel): nested config sections.

    Sections: `sharding` (enable, stage 1/2/3, degree, ...), `fused_passes` (enable,
    gemm_epilogue, dropout_add), `gradient_merge` (enable, k_steps, avg), `pipeline` (enable,
    schedule_mode, micro_batch_size, accumulate_steps, ...), `amp`, `recompute`,
    `dp_optimization`, `mp_optimization` and `sp_optimization`; and Paddle's top-level keys
    (`auto_mode`, `gradient_scale`, `split_data`, `seed`, ..., `full_graph`).

    Examples:
      >>> s = fleetjax.Strategy({"sharding": {"enable": True, "stage": 2, "degree": 4}})
      >>> s.gradient_merge.k_steps = 4
      >>> s = fleetjax.Strategy(fleetjax.fleet.auto.Strategy())  # the older one, converted

    Unlike Paddle, unknown sections or keys raise `UnknownFieldError` and values are checked
    (e.g. `sharding.stage` must be 1, 2 or 3). A `config` that is not a dict raises a
    ValueError (and TypeError), as in Paddle; a `fleetjax.fleet.auto.Strategy` (Paddle's older
    auto-parallel strategy) is converted as `_from_legacy_strategy` converts it (a fleetjax
    extension: Paddle's users call that method).
    """

    SPEC = _schema.AUTO_STRATEGY

    def __init__(self, config: Mapping[str, Any] | Message | None = None) -> None:
        legacy = isinstance(config, Message) and config._spec is _schema.LEGACY_AUTO_STRATEGY
        super().__init__(None if legacy else config)
        if legacy:
            self._from_legacy_strategy(config)

    def _from_legacy_strategy(self, legacy_strategy: Message) -> None:
        """Paddle's `Strategy._from_legacy_strategy`: take every setting of a
        `fleetjax.fleet.auto.Strategy` (the older auto-parallel strategy).

        Its `fused_passes.fused_passes_list` becomes `fused_passes.gemm_epilogue` and
        `dropout_add` ("fused_gemm_epilogue_pass", "fused_dropout_add_pass"). Paddle drops the
        sections this Strategy lacks without a word; fleetjax raises for `qat.enable` (training
        would differ) and warns once for any other of them changed from its default, and for
        fused passes it has no counterpart of.
        """
        _check_legacy(legacy_strategy)
        values = legacy_strategy.set_values()
        passes = values.pop("fused_passes", {})
        names = passes.get("fused_passes_list", [])
        fused = {key: True for name, key in _LEGACY_PASSES.items() if name in names}
        for name in _LEGACY_ONLY:
            values.pop(name, None)
        self.clear_values()
        self.update({**values, "fused_passes": {"enable": passes.get("enable", False), **fused}})


# The older Strategy's fused passes that the newer one switches by name.
_LEGACY_PASSES = {
    "fused_gemm_epilogue_pass": "gemm_epilogue",
    "fused_dropout_add_pass": "dropout_add",
}
# Sections Paddle's _from_legacy_strategy leaves behind (the newer Strategy lacks all but qat).
_LEGACY_ONLY = ("qat", "tuning", "dataset", "fused_linear_promotion")


def _check_legacy(legacy: Message) -> None:
    """Raise for what `Strategy._from_legacy_strategy` cannot carry over and would change
    training; warn once for settings without effect."""

    if legacy._spec is not _schema.LEGACY_AUTO_STRATEGY:
        raise TypeError(
            f"legacy_strategy must be a fleetjax.fleet.auto.Strategy, got {type(legacy).__name__}"
        )
    if legacy.qat.enable:
        raise NotImplementedError(
            "fleet.auto.Strategy.qat.enable=True: quantization-aware training is not in "
            "fleetjax; turn it off to train without it"
        )
    for name in _LEGACY_ONLY:
        if legacy._get(name).non_defaults():
            note = legacy._spec.field(name).note
            warn_once(f"fleet.auto.Strategy.{name} has no effect in fleetjax: {note}")
    for name in legacy.fused_passes.fused_passes_list:
        if name not in _LEGACY_PASSES:
            warn_once(
                f"fleet.auto.Strategy.fused_passes.fused_passes_list: {name!r} has no "
                f"counterpart in fleetjax (it has {', '.join(_LEGACY_PASSES)}; XLA fuses "
                "elementwise operations itself)"
            )
