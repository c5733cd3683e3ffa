"""`parallelize`'s tensor-parallel plans (Paddle's `mp_config.parallelize_plan` values), each
the layout fleetjax's own tensor-parallel layer has (`fleetjax.layers`), so that a model
parallelized by plans compiles to the program of the same model written with those layers:

* `ColWiseParallel(gather_output=False)`: a 2-D parameter `Shard(1)` on `mp` (a `[in, out]`
  kernel's output, an embedding's hidden dimension), a 1-D one `Shard(0)`; the input whole, the
  output split (gathered with `gather_output`): `ColumnParallelLinear`.
* `RowWiseParallel(is_input_parallel=True)`: a 2-D parameter `Shard(0)`; the input split, the
  partial sums summed (`RowParallelLinear`, `VocabParallelEmbedding`), or inside a
  `SequenceParallelDisable` summed and split along the sequence (`RowSequenceParallelLinear`).
* `SequenceParallelBegin(need_transpose=True)`: the output split along the sequence
  (`ScatterOp`); `SequenceParallelEnd(...)`: the input gathered (`GatherOp`).
* `SequenceParallelEnable()`: the input split along the sequence, the output gathered;
  `SequenceParallelDisable(need_transpose=True)`: the input gathered, the output split again.
* `PrepareLayerInput(fn)` / `PrepareLayerOutput(fn)`: `fn(process_mesh)`'s hook on the input /
  the output.

The sequence is dimension 1 of a `[batch, sequence, hidden]` activation where Paddle's
`need_transpose=True` (Paddle transposes to `[sequence, batch, hidden]` first), and dimension 0
where it is False; fleetjax never transposes (a layout change, which XLA makes itself).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from fleetjax.auto_parallel import ProcessMesh, Replicate, Shard, placements_of, shard_tensor
from fleetjax.distributed._hooks import PostHook, PreHook
from fleetjax.layers import GatherOp, ScatterOp, constrain

__all__ = [
    "ColWiseParallel",
    "PlanBase",
    "PrepareLayerInput",
    "PrepareLayerOutput",
    "RowWiseParallel",
    "SequenceParallelBegin",
    "SequenceParallelDisable",
    "SequenceParallelEnable",
    "SequenceParallelEnd",
]


HookPair = tuple[tuple[PreHook, ...], tuple[PostHook, ...]]


class PlanBase:
    """A parallelize plan: the parameters it places and the hooks it gives a layer."""

    def apply(
        self, layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], resplit: bool
    ) -> HookPair:
        """Place `layer`'s parameters (only `params`, if given) on `mesh` and return its
        hooks; `resplit`: an enclosing layer splits its output along the sequence again (a
        `SequenceParallelDisable`)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


def _shard_params(
    layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], dims: dict[int, int | None]
) -> None:
    """Each parameter of `layer` (those named in `params`, if any) of rank r placed with
    `Shard(dims[r])` on `mesh`'s `mp` dimension (`dims[r]` None: left as it is); one already
    `Shard`ed is left too, as Paddle leaves a distributed parameter."""
    if "mp" not in mesh.dim_names:
        raise ValueError(
            f"the tensor-parallel plans shard over the mesh dim 'mp', which {mesh} does not "
            "have (Paddle's parallelize names it so)"
        )
    index = mesh.dim_names.index("mp")
    for name, value in vars(layer).items():
        if not isinstance(value, nnx.Param) or (params and name not in params):
            continue
        held = placements_of(value[...])
        dim = dims.get(value.ndim)
        if dim is None or (held is not None and any(p.is_shard() for p in held)):
            continue
        placements = [Replicate() for _ in mesh.dim_names]
        placements[index] = Shard(dim)
        setattr(layer, name, shard_tensor(value, mesh, placements))


def _is_ids(x: Any) -> bool:
    """Whether `x` is an embedding's input (integers), which keeps its layout."""
    return jnp.issubdtype(jnp.result_type(x), jnp.integer)


class ColWiseParallel(PlanBase):
    """Paddle's `ColWiseParallel(gather_output=False)`: the weight's output dimension split over
    `mp` (a `[in, out]` kernel, an embedding's hidden dimension), as
    `fleetjax.layers.ColumnParallelLinear`."""

    def __init__(self, gather_output: bool = False) -> None:
        self.gather_output = gather_output

    def apply(
        self, layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], resplit: bool
    ) -> HookPair:
        _shard_params(layer, mesh, params, {2: 1, 1: 0})
        out = (None,) if self.gather_output else ("mlp",)

        def before(_: nnx.Module, inputs: tuple) -> tuple:
            x, *rest = inputs
            return inputs if _is_ids(x) else (constrain(x, (None,)), *rest)

        return (before,), (lambda _, inputs, y: constrain(y, out),)


class RowWiseParallel(PlanBase):
    """Paddle's `RowWiseParallel(is_input_parallel=True)`: the weight's input dimension (an
    embedding's vocabulary) split over `mp`, as `fleetjax.layers.RowParallelLinear` (and
    `VocabParallelEmbedding`)."""

    def __init__(self, is_input_parallel: bool = True) -> None:
        self.is_input_parallel = is_input_parallel

    def apply(
        self, layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], resplit: bool
    ) -> HookPair:
        _shard_params(layer, mesh, params, {2: 0})
        before: tuple[PreHook, ...] = ()
        if not self.is_input_parallel:

            def split(_: nnx.Module, inputs: tuple) -> tuple:
                x, *rest = inputs
                return inputs if _is_ids(x) else (constrain(x, ("mlp",)), *rest)

            before = (split,)
        # Summed here, or (sequence parallel) summed and split by the enclosing layer.
        after = () if resplit else (lambda _, inputs, y: constrain(y, (None,)),)
        return before, after


def _axis(need_transpose: bool) -> int:
    return 1 if need_transpose else 0


def _first(fn: Any) -> PreHook:
    """A pre-hook applying `fn` to the first input."""

    def hook(_: nnx.Module, inputs: tuple) -> tuple:
        return (fn(inputs[0]), *inputs[1:])

    return hook


class SequenceParallelBegin(PlanBase):
    """Paddle's `SequenceParallelBegin(need_transpose=True)`: the layer's output split along
    the sequence over `mp` (`ScatterOp`)."""

    def __init__(self, need_transpose: bool = True) -> None:
        self.need_transpose = need_transpose

    def apply(
        self, layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], resplit: bool
    ) -> HookPair:
        axis = _axis(self.need_transpose)
        return (), (lambda _, inputs, y: ScatterOp.apply(y, axis),)


class SequenceParallelEnd(PlanBase):
    """Paddle's `SequenceParallelEnd(need_transpose=True)`: the layer's input gathered along
    the sequence (`GatherOp`)."""

    def __init__(self, need_transpose: bool = True) -> None:
        self.need_transpose = need_transpose

    def apply(
        self, layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], resplit: bool
    ) -> HookPair:
        axis = _axis(self.need_transpose)
        return (_first(lambda x: GatherOp.apply(x, axis)),), ()


class SequenceParallelEnable(PlanBase):
    """Paddle's `SequenceParallelEnable()`: the layer runs on its input split along the
    sequence, and its output is gathered."""

    def __init__(self) -> None:
        pass

    def apply(
        self, layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], resplit: bool
    ) -> HookPair:
        return (_first(lambda x: ScatterOp.apply(x, 1)),), (
            lambda _, inputs, y: GatherOp.apply(y, 1),
        )


class SequenceParallelDisable(PlanBase):
    """Paddle's `SequenceParallelDisable(need_transpose=True)`: the layer runs on its input
    gathered along the sequence, and its output is split again (a row-parallel layer inside
    it then reduce-scatters, as `RowSequenceParallelLinear`)."""

    def __init__(self, need_transpose: bool = True) -> None:
        self.need_transpose = need_transpose

    def apply(
        self, layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], resplit: bool
    ) -> HookPair:
        axis = _axis(self.need_transpose)
        return (_first(lambda x: GatherOp.apply(x, axis)),), (
            lambda _, inputs, y: ScatterOp.apply(y, axis),
        )


class PrepareLayerInput(PlanBase):
    """Paddle's `PrepareLayerInput(fn)`: `fn(process_mesh)` is a pre-hook `hook(layer,
    inputs)` returning the new inputs (it may `dist.reshard` them: inside the step, a layout
    constraint)."""

    def __init__(self, fn: Any = None) -> None:
        if not callable(fn):
            raise TypeError(f"PrepareLayerInput's fn must be callable, got {fn!r}")
        self.fn = fn

    def apply(
        self, layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], resplit: bool
    ) -> HookPair:
        return (self.fn(process_mesh=mesh),), ()


class PrepareLayerOutput(PlanBase):
    """Paddle's `PrepareLayerOutput(fn)`: `fn(process_mesh)` is a post-hook `hook(layer,
    inputs, outputs)` returning the new outputs."""

    def __init__(self, fn: Any = None) -> None:
        if not callable(fn):
            raise TypeError(f"PrepareLayerOutput's fn must be callable, got {fn!r}")
        self.fn = fn

    def apply(
        self, layer: nnx.Module, mesh: ProcessMesh, params: tuple[str, ...], resplit: bool
    ) -> HookPair:
        return (), (self.fn(process_mesh=mesh),)
