"""Paddle's `DistributedStrategy.fleet_desc_configs`: parameter-server tables from flat
`sparse_*` keys, as Paddle's setter builds its `TableParameter`s (accessor, CTR settings, the
two save parameters, the embed and embedx rules with Paddle's defaults per rule)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["tables_from_fleet_desc"]

_RULE_KEYS = (
    "sparse_optimizer", "sparse_learning_rate", "sparse_initial_range", "sparse_initial_g2sum",
    "sparse_weight_bounds", "sparse_beta1_decay_rate", "sparse_beta2_decay_rate",
)  # fmt: skip
_KEYS = frozenset(
    (
        "sparse_table_class", "sparse_compress_in_save", "sparse_shard_num",
        "sparse_accessor_class", "sparse_fea_dim", "sparse_embedx_dim",
        "sparse_embedx_threshold", "sparse_nonclk_coeff", "sparse_click_coeff",
        "sparse_base_threshold", "sparse_delta_threshold", "sparse_delta_keep_days",
        "sparse_delete_after_unseen_days", "sparse_show_click_decay_rate",
        "sparse_delete_threshold", "sparse_converter", "sparse_deconverter",
        "sparse_enable_cache", "sparse_cache_rate", "sparse_cache_file_num",
        "sparse_ada_epsilon", "sparse_ssd_unseenday_threshold", "feature_learning_rate",
        "nodeid_slot", "sparse_load_filter_slots", "sparse_save_filter_slots",
        *_RULE_KEYS,
        *(prefix + key for prefix in ("embed_", "embedx_") for key in _RULE_KEYS),
    )
)  # fmt: skip
_TABLE_CLASSES = {
    "DownpourSparseTable": "MemorySparseTable",
    "DownpourSparseSSDTable": "SSDSparseTable",
}
_ACCESSORS = (
    "DownpourSparseValueAccessor", "DownpourCtrAccessor", "DownpourCtrDoubleAccessor",
    "DownpourUnitAccessor", "DownpourDoubleUnitAccessor", "DownpourCtrDymfAccessor",
)  # fmt: skip
# Paddle's rule names, the SGDParameter section each fills, its defaults.
_ADAGRAD = {"learning_rate": 0.05, "initial_range": 1e-4, "initial_g2sum": 3}
_ADAM = {
    "learning_rate": 0.001, "initial_range": 1e-4, "beta1_decay_rate": 0.9,
    "beta2_decay_rate": 0.999, "ada_epsilon": 1e-8,
}  # fmt: skip
_RULES = {
    "naive": ("SparseNaiveSGDRule", "naive", {"learning_rate": 0.05, "initial_range": 1e-4}),
    "adagrad": ("SparseAdaGradSGDRule", "adagrad", _ADAGRAD),
    "adagrad_v2": ("SparseAdaGradV2SGDRule", "adagrad", _ADAGRAD),
    "std_adagrad": ("StdAdaGradSGDRule", "adagrad", _ADAGRAD),
    "adam": ("SparseAdamSGDRule", "adam", _ADAM),
    "shared_adam": ("SparseSharedAdamSGDRule", "adam", _ADAM),
}
# CtrAccessorParameter field <- (key, Paddle's default)
_CTR = {
    "nonclk_coeff": ("sparse_nonclk_coeff", 0.1),
    "click_coeff": ("sparse_click_coeff", 1),
    "base_threshold": ("sparse_base_threshold", 1.5),
    "delta_threshold": ("sparse_delta_threshold", 0.25),
    "delta_keep_days": ("sparse_delta_keep_days", 16),
    "show_click_decay_rate": ("sparse_show_click_decay_rate", 0.98),
    "delete_threshold": ("sparse_delete_threshold", 0.8),
    "delete_after_unseen_days": ("sparse_delete_after_unseen_days", 30),
    "ssd_unseenday_threshold": ("sparse_ssd_unseenday_threshold", 1),
    "load_filter_slots": ("sparse_load_filter_slots", []),
    "save_filter_slots": ("sparse_save_filter_slots", []),
}


def tables_from_fleet_desc(configs: Any) -> list[dict[str, Any]]:
    """`downpour_table_param` entries from Paddle's `fleet_desc_configs` value,
    ``{table_name: {"sparse_optimizer": "adam", ...}}``: one per table (Paddle skips the
    ``dense_table`` and ``datanorm_table`` entries and values that are not dicts; a top-level
    ``use_cvm: False`` makes every accessor a `SparseAccessor`).

    Raises:
      TypeError: if `configs` is not a dict.
      ValueError: for a key, table class, accessor class or rule Paddle does not support,
        naming it and the table.
    """
    if not isinstance(configs, Mapping):
        raise TypeError(f"fleet_desc_configs must be a dict, got {type(configs).__name__}")
    use_cvm = configs.get("use_cvm", True)
    return [
        {"table_name": name, **_table(name, config, use_cvm)}
        for name, config in configs.items()
        if name not in ("dense_table", "datanorm_table") and isinstance(config, Mapping)
    ]


def _table(name: str, config: Mapping[str, Any], use_cvm: bool) -> dict[str, Any]:
    where = f"fleet_desc_configs[{name!r}]"
    unknown = sorted(set(config) - _KEYS)
    if unknown:
        raise ValueError(f"{where}: strategy keys {unknown} are not supported (Paddle's either)")
    table = _one_of(where, "sparse_table_class", config, "DownpourSparseTable", _TABLE_CLASSES)
    accessor = _one_of(where, "sparse_accessor_class", config, "DownpourCtrAccessor", _ACCESSORS)
    return {
        "table_class": _TABLE_CLASSES[table],
        "shard_num": config.get("sparse_shard_num", 1000),
        "enable_sparse_table_cache": config.get("sparse_enable_cache", True),
        "sparse_table_cache_rate": config.get("sparse_cache_rate", 0.00055),
        "sparse_table_cache_file_num": config.get("sparse_cache_file_num", 16),
        "accessor": _accessor(where, accessor, config, use_cvm),
    }


def _accessor(where: str, accessor: str, config: Mapping[str, Any], use_cvm: bool) -> dict:
    if not use_cvm:
        accessor_class = "SparseAccessor"
    elif "Double" in accessor:
        accessor_class = "CtrDoubleAccessor"
    else:
        accessor_class = "CtrDymfAccessor" if "Dymf" in accessor else "CtrCommonAccessor"
    embedx_dim = config.get("sparse_embedx_dim", 8)
    ctr = {field: config.get(key, default) for field, (key, default) in _CTR.items()}
    save = {
        "converter": config.get("sparse_converter", ""),
        "deconverter": config.get("sparse_deconverter", ""),
    }
    # The CTR accessors train both parts with the unprefixed rule, the others each its own.
    ctr_rule = accessor in ("DownpourCtrAccessor", "DownpourCtrDoubleAccessor")
    return {
        "accessor_class": accessor_class,
        "embedx_dim": embedx_dim,
        "fea_dim": embedx_dim + 3,
        "embedx_threshold": config.get("sparse_embedx_threshold", 10),
        "ctr_accessor_param": {**ctr, "show_scale": accessor != "DownpourUnitAccessor"},
        "table_accessor_save_param": [{"param": 1, **save}, {"param": 2, **save}],
        "embed_sgd_param": _rule(where, config, "" if ctr_rule else "embed_"),
        "embedx_sgd_param": _rule(where, config, "" if ctr_rule else "embedx_"),
        "graph_sgd_param": {
            "feature_learning_rate": config.get("feature_learning_rate", 0.05),
            "nodeid_slot": config.get("nodeid_slot", 9008),
        },
    }


def _rule(where: str, config: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """An `SGDParameter`: the rule `<prefix>sparse_optimizer` names, with Paddle's defaults
    (an embed rule's initial_range is 0 for the adagrad family, as in Paddle)."""
    key = prefix + "sparse_optimizer"
    optimizer = _one_of(where, key, config, "adagrad", _RULES)
    name, section, defaults = _RULES[optimizer]
    values = {k: config.get(f"{prefix}sparse_{k}", v) for k, v in defaults.items()}
    if section == "adagrad" and prefix == "embed_":
        values["initial_range"] = 0
    values["weight_bounds"] = list(config.get(prefix + "sparse_weight_bounds", [-10, 10]))
    return {"name": name, section: values}


def _one_of(where: str, key: str, config: Mapping[str, Any], default: str, allowed: Any) -> str:
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(f"{where}: {key}={value!r} is not one of {', '.join(allowed)}")
    return value
