"""Megatron's column- and row-parallel linear layers (Paddle's `fleet.meta_parallel`
`ColumnParallelLinear` and `RowParallelLinear`) as flax nnx modules.

The code is the unsplit computation ``y = x W + b`` over global arrays. The weight carries
logical axis names, so `partition_specs` splits its output (column) or input (row) dimension
over ``mp``, and the activation constraints make XLA communicate as Megatron does: a
column-parallel layer computes its columns locally and gathers them only with
``gather_output``; a row-parallel layer sums its partial products over ``mp`` with one
all-reduce. A column layer with ``gather_output=False`` feeding a row layer with
``input_is_parallel=True`` (the MLP, attention's projections) costs that one all-reduce.

Of Paddle's other arguments, ``mp_group`` is the mesh axis the rules map ``"mlp"`` to,
``fuse_matmul_bias`` is left to XLA's fusion, and ``name`` has no counterpart.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fleetjax.layers._params import DEFAULT_WEIGHT_INIT, check_sizes, logical_param
from fleetjax.layers.partitioning import constrain, out_sharding

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]


class ColumnParallelLinear(nnx.Module):
    """``y = x W + b`` with W's output (column) dimension split over ``mp``.

    Paddle's ``ColumnParallelLinear(in_features, out_features, weight_attr, has_bias,
    gather_output)``. The input is whole on every ``mp`` device (Paddle's ``_c_identity``: its
    gradient is all-reduced over ``mp``); each device computes its columns. With
    ``gather_output`` (Paddle's default) the output is gathered whole (Paddle's ``_c_concat``);
    without, it stays split over ``mp``, ready for a `RowParallelLinear` with
    ``input_is_parallel=True``.

    Attributes:
      weight: ``[in_features, out_features]``, logical axes ``("embed", "mlp")``.
      bias: ``[out_features]``, ``("mlp",)``; None without ``has_bias``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        has_bias: bool = False,
        gather_output: bool = True,
        weight_init: nnx.Initializer = DEFAULT_WEIGHT_INIT,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        """Paddle's ``has_bias`` defaults to None, which adds no bias: so does the default
        False here. ``weight_init`` stands for Paddle's ``weight_attr``."""
        check_sizes(type(self).__name__, in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output = gather_output
        self.weight = logical_param(
            weight_init, ("embed", "mlp"), rngs.params(), (in_features, out_features), param_dtype
        )
        self.bias = (
            logical_param(
                nnx.initializers.zeros, ("mlp",), rngs.params(), (out_features,), param_dtype
            )
            if has_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = constrain(x, (None,))
        y = jnp.matmul(x, self.weight[...])
        if self.bias is not None:
            y = y + self.bias[...]
        return constrain(y, (None,) if self.gather_output else ("mlp",))


class RowParallelLinear(nnx.Module):
    """``y = x W + b`` with W's input (row) dimension split over ``mp``.

    Paddle's ``RowParallelLinear(in_features, out_features, weight_attr, has_bias,
    input_is_parallel)``. Each ``mp`` device multiplies its slice of the input's features by
    its rows of W, and the partial products are summed over ``mp`` (one all-reduce); the output
    is whole on every ``mp`` device, and the bias (not split) is added after the sum.

    ``input_is_parallel=False`` (Paddle's default) splits a whole input first (Paddle's
    ``_c_split``, a local slice). With ``input_is_parallel=True`` the input is taken as it
    arrives, already split over ``mp`` (from a `ColumnParallelLinear` with
    ``gather_output=False``); the arrays are global, so both give the same numbers.

    Attributes:
      weight: ``[in_features, out_features]``, logical axes ``("mlp", "embed")``.
      bias: ``[out_features]``, ``("embed",)``; None without ``has_bias``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        has_bias: bool = True,
        input_is_parallel: bool = False,
        weight_init: nnx.Initializer = DEFAULT_WEIGHT_INIT,
        param_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        """``weight_init`` stands for Paddle's ``weight_attr``."""
        check_sizes(type(self).__name__, in_features=in_features, out_features=out_features)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel = input_is_parallel
        self.weight = logical_param(
            weight_init, ("mlp", "embed"), rngs.params(), (in_features, out_features), param_dtype
        )
        self.bias = (
            logical_param(
                nnx.initializers.zeros, ("embed",), rngs.params(), (out_features,), param_dtype
            )
            if has_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        if not self.input_is_parallel:
            x = constrain(x, ("mlp",))
        # On Explicit axes the sum over the split contracting dimension needs its output's
        # sharding: whole over mp, which is the all-reduce.
        y = jnp.matmul(x, self.weight[...], out_sharding=out_sharding(x, x.ndim - 1, (None,)))
        y = self._summed(y)
        if self.bias is not None:
            y = y + self.bias[...]
        return y

    def _summed(self, y: jax.Array) -> jax.Array:
        """The partial products summed over ``mp``: whole on every device (an all-reduce)."""
        return constrain(y, (None,))
