"""`explain`: what a strategy costs, from what XLA compiled."""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any

import jax

from fleetjax import _hlo
from fleetjax.step import TrainStep

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class CollectiveUse:
    """The collectives of one kind and dtype in a compiled step."""

    op: str
    dtype: str
    count: int
    bytes: int  # their results' bytes on each device, added up


@dataclasses.dataclass(frozen=True)
class Explanation:
    """Per-device bytes of a compiled train step and the collectives in it.

    Attributes:
      params: parameter bytes each device holds (under ZeRO-3 its shards, under tensor
        parallelism its splits).
      grads: gradient bytes each device holds once reduced (under ZeRO-2 and 3, its shards).
      opt_state: optimizer-state bytes each device holds (under ZeRO, its shards).
      temp: XLA's temporaries (`memory_analysis().temp_size_in_bytes`): activations, gradient
        buffers, communication buffers.
      arguments: all argument bytes (`memory_analysis().argument_size_in_bytes`).
      outputs: all output bytes.
      host_arguments: argument bytes in pinned host memory (an offloaded optimizer state).
      collectives: by kind and dtype.
    """

    params: int
    grads: int
    opt_state: int
    temp: int
    arguments: int
    outputs: int
    host_arguments: int
    collectives: tuple[CollectiveUse, ...]

    def __str__(self) -> str:
        rows = [
            ("parameters", self.params),
            ("gradients", self.grads),
            ("optimizer state", self.opt_state),
            ("temporaries", self.temp),
            ("arguments (all)", self.arguments),
            ("outputs (all)", self.outputs),
        ]
        if self.host_arguments:
            rows.append(("pinned host arguments", self.host_arguments))
        lines = ["per-device bytes:"]
        lines += [f"  {name:<22} {value / MiB:10.3f} MiB" for name, value in rows]
        lines.append("collectives:" if self.collectives else "collectives: none")
        lines += [
            f"  {c.op:<19} {c.dtype:<5} x{c.count:<4} {c.bytes / MiB:10.3f} MiB"
            for c in self.collectives
        ]
        return "\n".join(lines)


def _device_bytes(abstract: Any, shardings: Any) -> int:
    """Bytes one device holds of `abstract` (ShapeDtypeStructs) placed with `shardings`."""

    def one(x: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding) -> int:
        return math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize

    return sum(jax.tree.leaves(jax.tree.map(one, abstract, shardings)))


def explain(step: TrainStep, batch: Any, state: Any = None, *, show: bool = True) -> Explanation:
    """Compile `step` for `batch` (nothing runs) and report what each device holds and sends.

    `state` defaults to the one `step.init` made (its shapes). Prints the report unless
    `show=False`; returns it either way.
    """
    state = state if state is not None else step.abstract_state
    if state is None:
        raise ValueError("call step.init(params) first, or pass the state")
    compiled = step.lower(state, batch).compile()
    memory = compiled.memory_analysis()
    abstract = jax.eval_shape(lambda s: s, state)
    placements = step.state_sharding
    if step._grad_sharding is None:  # per-replica optimizers: each device's own full gradient
        grads = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.params))
        if step.plan.replica_params:
            grads //= step._replicas
    else:
        grads = _device_bytes(abstract.params, step._grad_sharding)
    uses: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for c in _hlo.collectives(compiled.as_text()):
        for dtype, dims in c.arrays:
            use = uses[c.op, dtype]
            use[0] += 1
            use[1] += _hlo._itemsize(dtype) * math.prod(dims)
    report = Explanation(
        params=_device_bytes(abstract.params, placements.params),
        grads=grads,
        opt_state=_device_bytes(abstract.opt_state, placements.opt_state),
        temp=memory.temp_size_in_bytes,
        arguments=memory.argument_size_in_bytes,
        outputs=memory.output_size_in_bytes,
        host_arguments=memory.host_argument_size_in_bytes,
        collectives=tuple(
            CollectiveUse(op, dtype, count, size)
            for (op, dtype), (count, size) in sorted(uses.items())
        ),
    )
    if show:
        print(report)
    return report
