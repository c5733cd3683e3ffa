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

import os
from typing import NamedTuple

import jax
from jax.sharding import NamedSharding

from fleetjax import targets
from fleetjax.cost import bytes_text, device_bytes
from fleetjax.mesh import data_axes, restrict
from fleetjax.step import TrainStep


def _model_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """The mesh axes that split the model (all but the data axes)."""
    return tuple(a for a in mesh.axis_names if a not in data_axes(mesh))


__all__ = ["Formula", "default_memory_budget", "formula"]


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


def default_memory_budget(device: jax.Device | None = None) -> tuple[int, str]:
    """(bytes, where from): the allocator's limit of `device` (`memory_stats()["bytes_limit"]`);
    for a compile-only GPU, its memory (`fleetjax.targets`); where the device reports none
    (CPU), the host's physical memory shared evenly by this process's devices."""
    device = device if device is not None else jax.devices()[0]
    try:
        stats = device.memory_stats() or {}
    except jax.errors.JaxRuntimeError:  # a compile-only device has none
        stats = {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"memory_stats()['bytes_limit'] of {device}"
    target = targets.of(device)
    if target is not None:
        return target.spec.hbm_bytes, f"the memory of an {target.description}"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = jax.local_device_count()
    return host // local, f"host memory {bytes_text(host)} / {local} local devices"
