"""Parameter-server mode's messages: `a_sync_configs`, `trainer_desc_configs`, the tables
(`downpour_table_param`, Paddle's `TableParameter` and its accessor, set through
`sparse_table_configs`) and `fs_client_param`."""

from __future__ import annotations

from fleetjax._config import Enum, field, message
from fleetjax._schema._shared import PS

_PS_RUNTIME = (
    "a setting of Paddle's parameter-server communicator threads and queues; fleetjax's "
    "parameter-server step is one SPMD program with no communicator"
)
_TABLE_STORE = (
    "how Paddle's servers store and cache a table; fleetjax splits a table's rows over the "
    "devices' memory"
)
_CTR = (
    "Paddle's CTR accessor bookkeeping (show/click counts, shrinking, save filters); "
    "fleetjax's tables are plain embeddings that keep every row"
)

ASYNC_CONFIG = message(
    "AsyncConfig",
    "a_sync_configs",
    [
        # a_sync=True with k_steps > 0: Geo-SGD every k_steps (fleetjax.optimizers.geo_sgd).
        field(
            1,
            "k_steps",
            int,
            -1,
            doc=(
                "Geo-SGD's exchange interval when `a_sync` is set to True "
                "(`fleetjax.optimizers.geo_sgd`, "
                "`fleetjax.transforms.sparse_rows.geo_exchange`); without that (`a_sync` "
                "left at its default, a collective strategy, or False) it warns."
            ),
        ),
        field(2, "max_merge_var_num", int, 1, note=_PS_RUNTIME),
        field(3, "send_queue_size", int, 16, note=_PS_RUNTIME),
        field(4, "independent_recv_thread", bool, False, note=_PS_RUNTIME),
        field(5, "min_send_grad_num_before_recv", int, 1, note=_PS_RUNTIME),
        field(6, "thread_pool_size", int, 1, note=_PS_RUNTIME),
        field(7, "send_wait_times", int, 1, note=_PS_RUNTIME),
        field(8, "runtime_split_send_recv", bool, False, note=_PS_RUNTIME),
        field(9, "launch_barrier", bool, True, note=_PS_RUNTIME),
        field(10, "heter_worker_device_guard", str, "cpu", note=PS),
        field(11, "lr_decay_steps", int, 10, note=PS),
        field(12, "use_ps_gpu", int, 0, note=PS),
        field(13, "use_gpu_graph", int, 0, note=PS),
    ],
)

TRAINER_DESC_CONFIG = message(
    "TrainerDescConfig",
    "trainer_desc_configs",
    [
        field(1, "dump_fields_path", str, "", note=PS),
        field(2, "dump_fields", str, [], note=PS),
        field(3, "dump_param", str, [], note=PS),
        field(4, "stat_var_names", str, [], note=PS),
        field(5, "trainer", str, "", note=PS),
        field(6, "device_worker", str, "", note=PS),
        field(7, "local_sparse", str, [], note=PS),
        field(8, "remote_sparse", str, [], note=PS),
    ],
)

# -- parameter-server tables (`downpour_table_param`, set through `sparse_table_configs`) -------
# Paddle's `TableParameter` and its accessor; fleetjax reads a table's rules (`embed_sgd_param`,
# `embedx_sgd_param`) and checks its dimensions against the `SparseEmbedding` of that name.

_NOT_MODELLED_RULE = (
    "a table starts as its SparseEmbedding initialised it (initial_range is the layer's)"
)


SPARSE_NAIVE_SGD_RULE = message(
    "SparseNaiveSGDRuleParameter",
    "naive",
    [
        field(1, "learning_rate", float, 0.05),
        field(2, "initial_range", float, 0.0001, note=_NOT_MODELLED_RULE),
        field(3, "weight_bounds", float, []),
    ],
)

SPARSE_ADAGRAD_SGD_RULE = message(
    "SparseAdagradSGDRuleParameter",
    "adagrad",
    [
        field(1, "learning_rate", float, 0.05),
        field(2, "initial_g2sum", float, 3.0),
        field(3, "initial_range", float, 0.0001, note=_NOT_MODELLED_RULE),
        field(4, "weight_bounds", float, []),
    ],
)

SPARSE_ADAM_SGD_RULE = message(
    "SparseAdamSGDParameter",
    "adam",
    [
        field(1, "learning_rate", float, 0.001),
        field(2, "initial_range", float, 0.0001, note=_NOT_MODELLED_RULE),
        field(3, "beta1_decay_rate", float, 0.9),
        field(4, "beta2_decay_rate", float, 0.999),
        field(5, "ada_epsilon", float, 1e-08),
        field(6, "weight_bounds", float, []),
    ],
)

SGD_PARAMETER = message(
    "SGDParameter",
    "sgd_param",
    [
        field(1, "name", str, ""),
        field(2, "naive", SPARSE_NAIVE_SGD_RULE),
        field(3, "adagrad", SPARSE_ADAGRAD_SGD_RULE),
        field(4, "adam", SPARSE_ADAM_SGD_RULE),
    ],
)

CTR_ACCESSOR_PARAMETER = message(
    "CtrAccessorParameter",
    "ctr_accessor_param",
    [
        field(1, "nonclk_coeff", float, 0.1, note=_CTR),
        field(2, "click_coeff", float, 1.0, note=_CTR),
        field(3, "base_threshold", float, 1.5, note=_CTR),
        field(4, "delta_threshold", float, 0.25, note=_CTR),
        field(5, "delta_keep_days", float, 16.0, note=_CTR),
        field(6, "show_click_decay_rate", float, 0.98, note=_CTR),
        field(7, "delete_threshold", float, 0.8, note=_CTR),
        field(8, "delete_after_unseen_days", float, 30.0, note=_CTR),
        field(9, "ssd_unseenday_threshold", int, 1, note=_CTR),
        field(10, "show_scale", bool, True, note=_CTR),
        field(11, "zero_init", bool, True, note=_NOT_MODELLED_RULE),
        field(12, "load_filter_slots", float, [], note=_CTR),
        field(13, "save_filter_slots", float, [], note=_CTR),
    ],
)

TABLE_ACCESSOR_SAVE_PARAMETER = message(
    "TableAccessorSaveParameter",
    "table_accessor_save_param",
    [
        field(1, "param", int, 0),
        field(2, "converter", str, ""),
        field(3, "deconverter", str, ""),
    ],
)

GRAPH_SGD_PARAMETER = message(
    "GraphSGDParameter",
    "graph_sgd_param",
    [
        field(1, "nodeid_slot", int, 9008),
        field(2, "feature_learning_rate", float, 0.05),
    ],
)

_GRAPH = "graph-learning tables; fleetjax has sparse embedding tables only"

TABLE_ACCESSOR_PARAMETER = message(
    "TableAccessorParameter",
    "accessor",
    [
        # "" or SparseAccessor; Paddle's CTR accessors add show/click columns (not modelled).
        field(1, "accessor_class", str, ""),
        field(4, "fea_dim", int, 11),  # checked: embedding_dim + 2 (show, click, embed, embedx)
        field(5, "embedx_dim", int, 8),  # checked: embedding_dim - 1
        field(
            6,
            "embedx_threshold",
            int,
            10,
            note="Paddle trains a row's embedx columns once its show/click score reaches it; "
            "fleetjax trains every column from a row's first lookup",
        ),
        field(7, "ctr_accessor_param", CTR_ACCESSOR_PARAMETER),
        field(8, "table_accessor_save_param", TABLE_ACCESSOR_SAVE_PARAMETER, [], note=_CTR),
        field(10, "embed_sgd_param", SGD_PARAMETER),
        field(11, "embedx_sgd_param", SGD_PARAMETER),
        field(12, "graph_sgd_param", GRAPH_SGD_PARAMETER, note=_GRAPH),
    ],
)

TABLE_TYPE = Enum("TableType", (("PS_SPARSE_TABLE", 0), ("PS_DENSE_TABLE", 1)))

TABLE_PARAMETER = message(
    "TableParameter",
    "downpour_table_param",
    [
        field(1, "table_id", int, 0, note="fleetjax identifies a table by its table_name"),
        field(2, "table_name", str, ""),
        field(3, "table_class", str, "", note=_TABLE_STORE),
        field(4, "shard_num", int, 1000, note=_TABLE_STORE),
        field(
            5,
            "type",
            TABLE_TYPE,
            "PS_SPARSE_TABLE",
            note="dense parameters train data parallel; only sparse tables are tables",
        ),
        field(6, "accessor", TABLE_ACCESSOR_PARAMETER),
        field(7, "compress_in_save", bool, False, note=_TABLE_STORE),
        field(10, "enable_sparse_table_cache", bool, True, note=_TABLE_STORE),
        field(11, "sparse_table_cache_rate", float, 0.00055, note=_TABLE_STORE),
        field(12, "sparse_table_cache_file_num", int, 16, note=_TABLE_STORE),
        field(13, "enable_revert", bool, False, note=_TABLE_STORE),
        field(14, "shard_merge_rate", float, 1.0, note=_TABLE_STORE),
        field(15, "use_gpu_graph", bool, False, note=_GRAPH),
    ],
)

FS_CLIENT_PARAMETER = message(
    "FsClientParameter",
    "fs_client_param",
    [
        field(1, "uri", str, "", note=PS),
        field(2, "user", str, "", note=PS),
        field(3, "passwd", str, "", note=PS),
        field(4, "hadoop_bin", str, "", note=PS),
    ],
)
