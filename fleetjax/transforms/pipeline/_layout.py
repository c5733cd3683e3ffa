"""Where a pipeline's `shard_map` puts things: its manual axes (``pp``, the data axes) and the
parameters' and gradients' specs over them, what ZeRO-3 gathers, and the compiler's axes."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, PartitionSpec

from fleetjax.mesh import data_axes, manual_axes, restrict, spec_axes
from fleetjax.transforms.pipeline._model import PipelineParams

AXIS = "pp"
WHOLE = PartitionSpec()
BY_STAGE = PipelineParams(WHOLE, PartitionSpec(AXIS), WHOLE)  # the layers split over pp


class Layout(NamedTuple):
    """The pipeline's `shard_map` axes and where its parameters and gradients are on them."""

    manual: frozenset[str]  # pp, the data axes, and axes of size 1 (nothing to partition)
    data: tuple[str, ...]  # the data axes, in the batch's order
    params: PipelineParams  # the parameters' specs over the manual axes
    grads: PipelineParams  # the reduced gradients' specs over the manual axes
    gathers: PipelineParams  # per parameter, the (dimension, data axes) it is split on
    compiler: PipelineParams  # per parameter, its split over the compiler's axes (mp)
    split: tuple[str, ...]  # the compiler's axes of size > 1, which kept layer inputs split on
    split_ways: int

    @classmethod
    def of(
        cls,
        mesh: Mesh,
        params: PipelineParams,
        param_specs: PipelineParams | None,
        grad_specs: PipelineParams | None,
    ) -> Layout:
        """The layout for `params` on `mesh`, split as the specs say (see `program`).

        Raises:
          ValueError: for a layers parameter whose leading (layer) axis is split over a data
            axis (its stage's chunks would not be whole).
        """
        data = data_axes(mesh)
        manual = manual_axes(mesh, (AXIS, *data))
        specs = leaf_specs(param_specs or BY_STAGE, params)
        param_in = on_axes(manual, specs)
        others = tuple(a for a in mesh.axis_names if a not in manual)
        compiler = jax.tree.map(lambda s: restrict(s, others), specs, is_leaf=is_spec)
        grads = on_axes(manual, leaf_specs(grad_specs or BY_STAGE, params))

        def gathered(spec: PartitionSpec) -> tuple[tuple[int, tuple[str, ...]], ...]:
            return tuple(
                (d, axes)
                for d, entry in enumerate(spec)
                if (axes := tuple(a for a in spec_axes(PartitionSpec(entry)) if a in data))
            )

        gathers = jax.tree.map(gathered, param_in, is_leaf=is_spec)
        if any(
            d == 0 for split in jax.tree.leaves(gathers.layers, is_leaf=is_split) for d, _ in split
        ):
            raise ValueError(
                "a pipeline's layers parameter is split over a data axis on its leading (layer) "
                f"axis ({param_specs.layers}); split another dimension over it"
            )
        split = tuple(a for a in others if mesh.shape[a] > 1)
        ways = math.prod(mesh.shape[a] for a in split)
        return cls(manual, data, param_in, grads, gathers, compiler, split, ways)


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def is_split(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(e, tuple) for e in x)


def leaf_specs(specs: PipelineParams, params: PipelineParams) -> PipelineParams:
    """`specs` (a prefix of `params` with `PartitionSpec` leaves) as one spec per parameter."""
    return jax.tree.map(
        lambda spec, part: jax.tree.map(lambda _: spec, part), specs, params, is_leaf=is_spec
    )


def on_axes(manual: frozenset[str], specs: PipelineParams) -> PipelineParams:
    """`specs` over the `manual` axes only; the layers' leading axis split over pp."""
    restricted = jax.tree.map(lambda s: restrict(s, tuple(manual)), specs, is_leaf=is_spec)
    by_stage = lambda s: PartitionSpec(AXIS, *tuple(s)[1:])  # noqa: E731
    layers = jax.tree.map(by_stage, restricted.layers, is_leaf=is_spec)
    return restricted._replace(layers=layers)
