"""Megatron's sequence parallelism over ``mp`` (Korthikanti et al. 2022), with Paddle's names
(`paddle.distributed.fleet.utils.sequence_parallel_utils`).

Outside the tensor-parallel matmuls (LayerNorm, dropout, the residual stream) activations are
split along the sequence over ``mp`` as well, so each ``mp`` device keeps 1/mp of them; each
all-reduce of a row-parallel layer's partial sums becomes a reduce-scatter along the sequence,
and each column-parallel layer first all-gathers its input, the same bytes in two halves.

As in fleetjax's other layers the code is the unsplit computation over global arrays, and the
layouts are logical names (``"activation_norm_length"``: the sequence over ``cp``, ``sep`` and
``mp``; ``"activation_length"``: over ``cp`` and ``sep``): XLA inserts the all-gathers and
reduce-scatters, and the numbers are those of the unsplit model. Paddle's layers take
``[sequence, batch, hidden]`` activations and its ops split dimension 0; here the sequence is
dimension ``sequence_axis`` (default 0, Paddle's), so a ``[batch, sequence, hidden]`` model
passes 1.

`mp_configs.recompute_allgather` (`sequence_parallel_options`): a column layer keeps its input
as it arrives (1/mp of the sequence) and all-gathers it again in the backward pass, instead of
keeping the gathered input. `mp_configs.sp_async_reduce_scatter` overlaps the reduce-scatter of
a column layer's input gradient with its weight gradient: XLA's asynchronous collectives do.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any

import jax
from flax import nnx

from fleetjax._warnings import warn_once
from fleetjax.layers.linear import ColumnParallelLinear, RowParallelLinear
from fleetjax.layers.partitioning import constrain

__all__ = [
    "AllGatherOp",
    "ColumnSequenceParallelLinear",
    "GatherOp",
    "ReduceScatterOp",
    "RowSequenceParallelLinear",
    "ScatterOp",
    "is_sequence_parallel_parameter",
    "mark_as_sequence_parallel_parameter",
    "register_sequence_parallel_allreduce_hooks",
    "sequence_parallel_options",
]

SPLIT = "activation_norm_length"  # the sequence in sequence-parallel regions (over mp too)
GATHERED = "activation_length"  # the sequence inside the tensor-parallel matmuls

_RECOMPUTE_ALLGATHER = contextvars.ContextVar("recompute_allgather", default=False)


@contextlib.contextmanager
def sequence_parallel_options(*, recompute_allgather: bool = False) -> Iterator[None]:
    """Within the block, column sequence-parallel layers made without their own setting follow
    Paddle's `mp_configs.recompute_allgather` (the train step enters it from the strategy)."""
    token = _RECOMPUTE_ALLGATHER.set(recompute_allgather)
    try:
        yield
    finally:
        _RECOMPUTE_ALLGATHER.reset(token)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _moved(x: jax.Array, axis: int, split: bool) -> jax.Array:
    """`x` with its sequence (dimension `axis`) split over mp (`split`) or gathered; its
    cotangent goes the other way (a sharding constraint alone would give the cotangent the same
    layout: a gathered input's gradient all-reduced, where Megatron reduce-scatters it)."""
    return constrain(x, (SPLIT if split else GATHERED,), axis=axis)


def _moved_forward(x: jax.Array, axis: int, split: bool) -> tuple[jax.Array, None]:
    return _moved(x, axis, split), None


def _moved_backward(axis: int, split: bool, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (constrain(g, (GATHERED if split else SPLIT,), axis=axis),)


_moved.defvjp(_moved_forward, _moved_backward)


def _split(x: jax.Array, axis: int) -> jax.Array:
    return _moved(x, axis, True)


def _gathered(x: jax.Array, axis: int) -> jax.Array:
    return _moved(x, axis, False)


class ScatterOp:
    """Paddle's `ScatterOp`: a tensor whole over ``mp`` split along its sequence (dimension
    `axis`, Paddle's 0) over ``mp``; its gradient is all-gathered."""

    @staticmethod
    def apply(x: jax.Array, axis: int = 0) -> jax.Array:
        return _split(x, axis)


class GatherOp:
    """Paddle's `GatherOp`: a sequence split over ``mp`` all-gathered; its gradient is split
    (on global arrays, as `AllGatherOp`'s: XLA reduce-scatters where it is a partial sum)."""

    @staticmethod
    def apply(x: jax.Array, axis: int = 0) -> jax.Array:
        return _gathered(x, axis)


class AllGatherOp:
    """Paddle's `AllGatherOp`: a sequence split over ``mp`` all-gathered; its gradient, a
    partial sum on each ``mp`` device, is reduce-scattered. On global arrays the two gathers
    are one layout change: XLA reduce-scatters where the gradient is a partial sum."""

    @staticmethod
    def apply(x: jax.Array, axis: int = 0) -> jax.Array:
        return _gathered(x, axis)


class ReduceScatterOp:
    """Paddle's `ReduceScatterOp`: partial sums on each ``mp`` device summed and split along
    the sequence (a reduce-scatter); its gradient is all-gathered."""

    @staticmethod
    def apply(x: jax.Array, axis: int = 0) -> jax.Array:
        return _split(x, axis)


def mark_as_sequence_parallel_parameter(parameter: Any) -> None:
    """Paddle's mark on a parameter used on sequence-split activations (a LayerNorm's, a row
    layer's bias). Paddle all-reduces their gradients over ``mp`` with hooks; on global arrays
    XLA sums a parameter's gradient over the devices its activations are split on, so the mark
    is only kept (`is_sequence_parallel_parameter`) for code that reads it."""
    if isinstance(parameter, nnx.Variable):
        parameter.set_metadata(sequence_parallel=True)
    else:
        parameter.sequence_parallel = True


def is_sequence_parallel_parameter(parameter: Any) -> bool:
    """Whether `mark_as_sequence_parallel_parameter` marked `parameter`."""
    if isinstance(parameter, nnx.Variable):
        return bool(parameter.get_metadata().get("sequence_parallel", False))
    return bool(getattr(parameter, "sequence_parallel", False))


def register_sequence_parallel_allreduce_hooks(
    model: Any, accumulation_steps: int, fuse_sequence_parallel_allreduce: bool
) -> None:
    """Paddle registers hooks that all-reduce the marked parameters' gradients over ``mp``;
    XLA sums them in the step already, so this only warns once that it has nothing to do."""
    warn_once(
        "register_sequence_parallel_allreduce_hooks has no effect in fleetjax: the gradients "
        "of sequence-parallel parameters are summed over mp by XLA in the train step"
    )


class ColumnSequenceParallelLinear(ColumnParallelLinear):
    """Paddle's `ColumnSequenceParallelLinear`: `ColumnParallelLinear` whose input arrives
    split along the sequence (dimension `sequence_axis`) over ``mp`` and is all-gathered first.

    Args (beyond `ColumnParallelLinear`'s):
      gather_output: must be False, as Paddle asserts (the output stays split over ``mp``).
      sequence_axis: the input's sequence dimension (Paddle's ``[s, b, h]``: 0).
      recompute_allgather: keep the split input and all-gather it again in the backward pass
        (None: `sequence_parallel_options`, i.e. `mp_configs.recompute_allgather`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        gather_output: bool = True,
        sequence_axis: int = 0,
        recompute_allgather: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if gather_output:
            raise ValueError(
                "ColumnSequenceParallelLinear needs gather_output=False: under sequence "
                "parallelism its output stays split over mp (Paddle asserts the same)"
            )
        super().__init__(in_features, out_features, gather_output=False, **kwargs)
        self.sequence_axis = sequence_axis
        self.recompute_allgather = recompute_allgather

    def __call__(self, x: jax.Array) -> jax.Array:
        recompute = self.recompute_allgather
        recompute = _RECOMPUTE_ALLGATHER.get() if recompute is None else recompute
        if not recompute:
            return super().__call__(_gathered(x, self.sequence_axis))

        def gathered_then_linear(layer: ColumnParallelLinear, x: jax.Array) -> jax.Array:
            return ColumnParallelLinear.__call__(layer, _gathered(x, self.sequence_axis))

        # Nothing inside is kept: the backward pass gathers the input again (the matmul's
        # output, which its backward does not need, is not recomputed).
        policy = jax.checkpoint_policies.nothing_saveable
        return nnx.remat(gathered_then_linear, policy=policy)(self, x)


class RowSequenceParallelLinear(RowParallelLinear):
    """Paddle's `RowSequenceParallelLinear`: `RowParallelLinear` whose partial sums are
    reduce-scattered along the sequence (dimension `sequence_axis`) over ``mp`` instead of
    all-reduced; the bias is added to the split output.

    Args (beyond `RowParallelLinear`'s):
      input_is_parallel: must be True, as Paddle asserts.
      sequence_axis: the output's sequence dimension (Paddle's ``[s, b, h]``: 0).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        input_is_parallel: bool = False,
        sequence_axis: int = 0,
        **kwargs: Any,
    ) -> None:
        if not input_is_parallel:
            raise ValueError(
                "RowSequenceParallelLinear needs input_is_parallel=True: under sequence "
                "parallelism its input arrives split over mp (Paddle asserts the same)"
            )
        super().__init__(in_features, out_features, input_is_parallel=True, **kwargs)
        self.sequence_axis = sequence_axis
        if self.bias is not None:
            mark_as_sequence_parallel_parameter(self.bias)

    def _summed(self, y: jax.Array) -> jax.Array:
        """The partial products summed and split along the sequence (a reduce-scatter)."""
        return _split(y, self.sequence_axis)
