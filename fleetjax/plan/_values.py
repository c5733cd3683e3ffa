"""The values a `Plan` is made of: plain, frozen, and free of strategy objects."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

from fleetjax.optimizers import STEP_SWITCHES, SWITCHES, Switch
from fleetjax.transforms import amp
from fleetjax.vocabulary import PADDLE_ORDER, REQUIRED_AXES
from fleetjax.xla_flags import Flag


class Degrees(NamedTuple):
    """The mesh degrees; `dp=-1` means all devices the others leave. `sharding` is the mesh's
    `sharding` axis: with context parallelism, Paddle's `cp_sharding_degree`."""

    dp: int = -1
    sharding: int = 1
    pp: int = 1
    mp: int = 1
    sep: int = 1
    cp: int = 1


class NoEffect(NamedTuple):
    """A setting that has no effect in fleetjax, and why."""

    knob: str  # e.g. "nccl_comm_num=2"
    why: str


@dataclasses.dataclass(frozen=True)
class Recompute:
    checkpoints: tuple[str, ...]
    policy: str | None
    offload: bool
    checkpoint_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LossScaling:
    init_loss_scaling: float
    dynamic: bool
    incr_every_n_steps: int
    decr_every_n_nan_or_inf: int
    incr_ratio: float
    decr_ratio: float


@dataclasses.dataclass(frozen=True)
class Amp:
    policy: amp.Policy
    loss_scaling: LossScaling | None  # None: no scaling and no skipping (bfloat16's default)


@dataclasses.dataclass(frozen=True)
class GradientMerge:
    k_steps: int
    avg: bool
    in_step: bool  # True: micro-batches within one call; False: the optimizer runs every k calls


@dataclasses.dataclass(frozen=True)
class Pipeline:
    schedule_mode: str
    micro_batch_size: int
    accumulate_steps: int
    vpp_degree: int  # 0: the model's own num_virtual_pipeline_stages


@dataclasses.dataclass(frozen=True)
class Hierarchical:
    """`use_hierarchical_allreduce`: the gradient all-reduce in two levels, within and across
    nodes of `ranks_per_node` devices (None: each process's devices are a node)."""

    ranks_per_node: int | None


@dataclasses.dataclass(frozen=True)
class OptimizerSwitch:
    """One of Paddle's optimizer switches (a name of `fleetjax.optimizers.SWITCHES`) and its
    `*_configs`, which rebuild or wrap the user's optimizer."""

    name: str
    configs: Mapping[str, Any]

    @property
    def row(self) -> Switch:
        """The switch's facts (`fleetjax.optimizers.SWITCHES`)."""
        return SWITCHES[self.name]

    @property
    def label(self) -> str:
        """How messages name it."""
        return self.row.label.format(**self.configs)


@dataclasses.dataclass(frozen=True)
class SparseRuleConfig:
    """One of Paddle's `SGDParameter`s (a table's `embed_sgd_param` or `embedx_sgd_param`):
    the rule's name and its parameters, as `fleetjax.optimizers.sparse_rules.paddle_rule`
    takes them."""

    name: str
    params: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class SparseTableConfig:
    """One of `sparse_table_configs` (Paddle's `TableParameter`): the table's name, what its
    accessor says of the table's width (None: not set) and its two rules."""

    table_name: str
    accessor_class: str
    fea_dim: int | None
    embedx_dim: int | None
    embed: SparseRuleConfig
    embedx: SparseRuleConfig


# What a table gets that `sparse_table_configs` does not name: Paddle's default accessor rule,
# `SparseAdaGradSGDRule` with its defaults and the bounds Paddle's runtime adds.
DEFAULT_SPARSE_RULE = SparseRuleConfig(
    "SparseAdaGradSGDRule",
    types.MappingProxyType(
        {"learning_rate": 0.05, "initial_g2sum": 3.0, "weight_bounds": (-10.0, 10.0)}
    ),
)


@dataclasses.dataclass(frozen=True)
class ParameterServer:
    """Paddle's parameter-server settings, for steps that train sparse tables: `a_sync` and
    `a_sync_configs.k_steps` (Geo-SGD every `geo_k_steps` steps; 0: the synchronous step) and
    the tables' configs."""

    geo_k_steps: int = 0
    tables: tuple[SparseTableConfig, ...] = ()

    def table(self, name: str) -> SparseTableConfig:
        """The config of the table `name`: from `sparse_table_configs`, else the default."""
        for config in self.tables:
            if config.table_name == name:
                return config
        return SparseTableConfig(name, "", None, None, DEFAULT_SPARSE_RULE, DEFAULT_SPARSE_RULE)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything a strategy asks for, decoded once by `read_plan`: the mesh, the transforms
    of the train step (None means off), the optimizer switch, the XLA flags and the settings
    without effect. Nothing downstream reads a strategy object."""

    strategy: str = "DistributedStrategy"  # the class it was read from, for messages
    degrees: Degrees = dataclasses.field(default_factory=Degrees)
    set_degrees: tuple[str, ...] = ()  # the axes whose degree the strategy sets explicitly
    # The mesh axes, slowest-varying first: Paddle's order of the axes every mesh has.
    order: tuple[str, ...] = tuple(a for a in PADDLE_ORDER if a in REQUIRED_AXES)
    recompute: Recompute | None = None
    amp: Amp | None = None
    gradient_merge: GradientMerge | None = None
    allreduce_dtype: str | None = None  # fp16_allreduce: the dtype gradients are summed in
    hierarchical: Hierarchical | None = None
    # ZeRO over the `sharding` axis: 0 off; 1 optimizer state, 2 + gradients, 3 + parameters.
    sharding_stage: int = 0
    optimizer_offload: bool = False  # the optimizer state lives in pinned host memory
    pipeline: Pipeline | None = None
    # execution_strategy.num_iteration_per_run: optimizer steps per `TrainStep.run` call (None:
    # any number; `Strategy` has no such knob).
    iterations_per_run: int | None = None
    optimizer: OptimizerSwitch | None = None
    parameter_server: ParameterServer = dataclasses.field(default_factory=ParameterServer)
    sync_batch_norm: bool | None = None  # None: the strategy has no such switch (`Strategy`)
    # mp_configs.recompute_allgather: sequence-parallel column layers gather their input again
    # in the backward pass (fleetjax.layers.sequence_parallel_options).
    recompute_allgather: bool = False
    auto: bool = False  # DistributedStrategy.auto: `fleetjax.auto.search` picks the layout
    xla_flags: tuple[Flag, ...] = ()
    no_effect: tuple[NoEffect, ...] = ()

    @property
    def per_replica(self) -> bool:
        """Whether each data-parallel replica steps its own optimizer state (DGC, LocalSGD)."""
        return self.optimizer is not None and self.optimizer.row.per_replica

    @property
    def replica_params(self) -> bool:
        """Whether each replica's parameters drift apart between syncs (LocalSGD)."""
        return self.optimizer is not None and self.optimizer.row.replica_params

    @property
    def switches(self) -> dict[str, str]:
        """The switches on that may clash (`fleetjax.optimizers.check_combination`): the
        optimizer switch and the step switches, each with how messages name it."""
        merge = self.gradient_merge
        on = {
            "sharding": self.sharding_stage > 0,
            "sharding_stage_2": self.sharding_stage >= 2,
            "pipeline": self.pipeline is not None,
            "fp16_allreduce": self.allreduce_dtype is not None,
            "use_hierarchical_allreduce": self.hierarchical is not None,
            "merge_across_calls": merge is not None and not merge.in_step,
        }
        found = {name: STEP_SWITCHES[name] for name, is_on in on.items() if is_on}
        if self.optimizer is not None:
            found[self.optimizer.name] = self.optimizer.label
        return found

    @property
    def in_step_merge(self) -> GradientMerge | None:
        """The gradient merge that splits one call's batch into micro-batches, if any."""
        merge = self.gradient_merge
        return merge if merge is not None and merge.in_step else None
