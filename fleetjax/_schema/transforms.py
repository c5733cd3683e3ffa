"""The configs of the strategy's gradient transforms: recompute, AMP (and its loss scaling),
gradient merge, gradient scaling, and QAT (not built yet): Paddle's `*_configs` messages of
`distributed_strategy.proto`, also read by auto parallel's sections."""

from __future__ import annotations

from typing import Any

from fleetjax._config import FieldSpec, between, field, greater_than, message, one_of
from fleetjax._schema._shared import RECOMPUTE_POLICY, half, merge_mode, positive, remat_policy

_QAT_OFF = "Quantization-aware training is not implemented (`qat` raises)."


REFINED_OPS_PATTERN = message(
    "RefinedOpsPattern",
    "refined_ops_patterns",
    [
        field(1, "main_ops", str, []),
        field(2, "num", int, 0),
        field(3, "pre_ops", str, []),
        field(4, "suf_ops", str, []),
    ],
)

RECOMPUTE_CONFIG = message(
    "RecomputeConfig",
    "recompute_configs",
    [
        field(
            1,
            "checkpoints",
            str,
            [],
            doc=("The activations (named with `fleetjax.checkpoint_name`) that recompute keeps."),
        ),
        field(
            2,
            "enable_offload",
            bool,
            False,
            doc=(
                "Kept activations go to pinned host memory (`save_and_offload_only_these_names`)."
            ),
        ),
        field(
            3,
            "checkpoint_shape",
            int,
            [],
            check=positive,
            doc="The shape of the kept activations, checked against them.",
        ),
        field(4, "enable_tuning", bool, False, note=RECOMPUTE_POLICY, kind="not yet"),
        field(
            5,
            "refined_ops_patterns",
            REFINED_OPS_PATTERN,
            [],
            note=RECOMPUTE_POLICY,
            kind="not yet",
        ),
        # fleetjax: a named jax.checkpoint_policies policy, alone or with the checkpoints.
        field(
            1001,
            "policy",
            str,
            "",
            paddle=False,
            check=remat_policy,
            doc=(
                "fleetjax extension: a `jax.checkpoint_policies` name, alone or with `checkpoints`."
            ),
        ),
    ],
)


def loss_scaling(first: int, **decr_ratio: Any) -> list[FieldSpec]:
    """The loss-scaling fields both AMP sections have, numbered from `first`; `decr_ratio` is
    the default (and Paddle's default) of that one."""
    return [
        field(
            first,
            "init_loss_scaling",
            float,
            32768.0,
            check=greater_than(0),
            doc="The initial loss scale.",
        ),
        field(
            first + 1,
            "incr_every_n_steps",
            int,
            1000,
            check=positive,
            doc="Finite steps before the loss scale grows.",
        ),
        field(
            first + 2,
            "decr_every_n_nan_or_inf",
            int,
            2,
            check=positive,
            doc="Non-finite steps before the loss scale shrinks.",
        ),
        field(
            first + 3,
            "incr_ratio",
            float,
            2.0,
            check=greater_than(1),
            doc="The loss scale's growth factor.",
        ),
        field(
            first + 4,
            "decr_ratio",
            float,
            check=between(0, 1),
            doc="The loss scale's shrink factor.",
            **decr_ratio,
        ),
    ]


AMP_CONFIG = message(
    "AMPConfig",
    "amp_configs",
    [
        *loss_scaling(1, default=0.5, paddle_default=0.8),
        field(
            6,
            "use_dynamic_loss_scaling",
            bool,
            True,
            doc=("Dynamic loss scaling (skip non-finite steps); False keeps the scale fixed."),
        ),
        field(7, "custom_white_list", str, [], doc="Operations added to the half-precision list."),
        field(8, "custom_black_list", str, [], doc="Operations kept in float32."),
        field(
            9,
            "custom_black_varnames",
            str,
            [],
            doc="Named values (`checkpoint_name`) whose consumers stay float32.",
        ),
        field(
            10,
            "use_pure_fp16",
            bool,
            False,
            doc="O2: float16 parameters for compute, float32 master weights.",
        ),
        field(
            11,
            "use_fp16_guard",
            bool,
            True,
            doc=("Under pure float16, only code inside `fleetjax.fp16_guard` runs in float16."),
        ),
        field(
            12,
            "use_optimizer_fp16",
            bool,
            False,
            note="not read by Paddle's fleet either; optimizer states stay float32",
            kind="not yet",
        ),
        field(13, "use_pure_bf16", bool, False, doc="O2 in bfloat16."),
        # fleetjax: the O1 half-precision dtype (Paddle's static O1 is float16 only).
        field(
            1001,
            "dtype",
            str,
            "float16",
            paddle=False,
            check=half,
            doc=("fleetjax extension: the O1 half-precision dtype, `float16` or `bfloat16`."),
        ),
    ],
    hints={"use_bf16": "the bf16 switch is 'use_pure_bf16'"},
)

GRADIENT_MERGE_CONFIG = message(
    "GradientMergeConfig",
    "gradient_merge_configs",
    [
        field(1, "k_steps", int, 1, check=positive, doc="Micro-steps merged into one update."),
        field(
            2,
            "avg",
            bool,
            True,
            doc=(
                "Mean (True) or sum of the merged gradients. In one step under the "
                "pipeline always the mean, as in Paddle (False warns)."
            ),
        ),
        # fleetjax: "across_calls" (Paddle's: the optimizer runs every k calls) or "in_step"
        # (each call splits its batch into k micro-batches).
        field(
            1001,
            "mode",
            str,
            "across_calls",
            paddle=False,
            check=merge_mode,
            doc=(
                "fleetjax extension: `across_calls` (Paddle's: the optimizer runs every k "
                "calls) or `in_step` (each call splits its batch; under the pipeline, "
                "into its `k_steps` micro-batches, so `accumulate_steps` is 1 or "
                "`k_steps`)."
            ),
        ),
    ],
)

QAT_CONFIG = message(
    "QatConfig",
    "qat_configs",
    [
        field(
            1,
            "channel_wise_abs_max",
            bool,
            True,
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
        field(
            2,
            "weight_bits",
            int,
            8,
            check=positive,
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
        field(
            3,
            "activation_bits",
            int,
            8,
            check=positive,
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
        field(
            4,
            "not_quant_pattern",
            str,
            [],
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
        field(
            5,
            "algo",
            str,
            "",
            kind="not yet",
            when="silent",
            doc=_QAT_OFF,
        ),
    ],
)

GRADIENT_SCALE_CONFIG = message(
    "GradientScaleConfig",
    "gradient_scale_configs",
    [
        field(
            1,
            "scale_strategy",
            str,
            "avg",
            check=one_of("avg", "sum", "customized"),
            kind="not yet",
            doc=(
                "`avg` (the mean over replicas) is what the step does; `sum` and "
                "`customized` raise."
            ),
        ),
        field(
            2,
            "scale_gradient",
            bool,
            False,
            note=(
                "the step averages gradients over the replicas; scale_strategy selects anything "
                "else"
            ),
            kind="not yet",
        ),
    ],
)
