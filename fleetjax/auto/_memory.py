"""Memory formulas: what one device must hold of a train step, from its placement alone (nothing
is lowered or compiled), and what a compiled step holds.

Before compiling a candidate the search adds up, from the `Placement` of its abstract state:

* the train state on the device: parameters, optimizer state (not under optimizer offload,
  which keeps it in pinned host memory) and the rest, each as its placement splits it;
* the reduced gradients, as their placement splits them (ZeRO-2 and 3: over `sharding`); a
  pipeline accumulates its stage's whole gradients before it reduces them, so under a pipeline
  they count whole over the data axes.

Both are live together when the optimizer update starts, so a candidate whose formula is over
the budget cannot fit and is not compiled. Activations and the parameters ZeRO-3 gathers for a
layer come on top; only the compiled step knows them.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
from jax.sharding import NamedSharding

from fleetjax.mesh import data_axes, restrict
from fleetjax.step import TrainStep


def _model_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """The mesh axes that split the model (all but the data axes)."""
    return tuple(a for a in mesh.axis_names if a not in data_axes(mesh))


__all__ = ["Formula", "compiled_bytes", "device_bytes", "formula"]


class Formula(NamedTuple):
    """Per-device bytes of a train step by formula.

    Attributes:
      state: the train state on the device.
      host: the optimizer state in pinned host memory (under optimizer offload).
      grads: the reduced gradients.
    """

    state: int
    host: int
    grads: int

    @property
    def floor(self) -> int:
        """Bytes the device must hold at once: its train state and gradients."""
        return self.state + self.grads


def device_bytes(abstract: Any, shardings: Any) -> int:
    """Bytes one device holds of `abstract` (ShapeDtypeStructs) placed with `shardings` (a
    prefix tree: one sharding may place a whole subtree, as the loss-scale state's)."""

    def placed(sharding: jax.sharding.Sharding, subtree: Any) -> int:
        return sum(
            math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(subtree)
        )

    return sum(jax.tree.leaves(jax.tree.map(placed, shardings, abstract)))


def formula(step: TrainStep) -> Formula:
    """The per-device bytes of `step` (after `abstract_init`) by formula."""
    placement, state, plan = step.placement, step.abstract_state, step.plan
    everything = device_bytes(state, placement.state)
    host = device_bytes(state.opt_state, placement.opt_state) if plan.optimizer_offload else 0
    grads_at = placement.grads if placement.grads is not None else placement.params
    if plan.pipeline is not None:  # whole over the data axes until the pipeline reduces them
        whole = lambda s: NamedSharding(s.mesh, restrict(s.spec, _model_axes(s.mesh)))  # noqa: E731
        grads_at = jax.tree.map(whole, placement.params)
    return Formula(everything - host, host, device_bytes(state.params, grads_at))


def compiled_bytes(memory: Any) -> int:
    """A compiled step's per-device bytes: arguments + outputs - aliased outputs + temporaries
    (`compiled.memory_analysis()`), an upper bound of XLA's peak."""
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + memory.temp_size_in_bytes
    )
