"""`explain`: what a strategy costs, from what XLA compiled."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax

from fleetjax import hlo
from fleetjax.step import TrainStep

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class CollectiveUse:
    """The collectives of one kind and dtype in a compiled step."""

    op: str
    dtype: str
    count: int  # how many times one step runs them (a loop's body once per trip)
    bytes: int  # their results' bytes on each device, added up over those runs


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
      collectives: by kind and dtype, each counted as often as one step runs it.
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


class _Uses(dict[tuple[str, str], tuple[int, int]]):
    """(collective, dtype) -> (times run, result bytes on each device), over some instructions."""

    @classmethod
    def of_line(cls, line: str, shapes: Mapping[str, tuple[int, ...]]) -> _Uses:
        uses = cls()
        for c in hlo.collectives(line):
            for dtype, dims in c.arrays:
                uses += cls({(c.op, dtype): (1, hlo.itemsize(dtype) * math.prod(dims))})
        return uses

    def __add__(self, other: _Uses) -> _Uses:  # type: ignore[override]
        total = _Uses(self)
        for key, (count, size) in other.items():
            before = total.get(key, (0, 0))
            total[key] = (before[0] + count, before[1] + size)
        return total

    def times(self, n: int) -> _Uses:
        return _Uses({key: (n * count, n * size) for key, (count, size) in self.items()})

    @staticmethod
    def largest(branches: list[_Uses]) -> _Uses:
        """Of a conditional's branches, the one that moves the most bytes."""
        return max(branches, key=lambda uses: sum(size for _, size in uses.values()))


def _device_bytes(abstract: Any, shardings: Any) -> int:
    """Bytes one device holds of `abstract` (ShapeDtypeStructs) placed with `shardings`."""

    def one(x: jax.ShapeDtypeStruct, sharding: jax.sharding.Sharding) -> int:
        return math.prod(sharding.shard_shape(x.shape)) * x.dtype.itemsize

    return sum(jax.tree.leaves(jax.tree.map(one, abstract, shardings)))


def explain(step: TrainStep, batch: Any, state: Any = None, *, show: bool = True) -> Explanation:
    """Compile `step` for `batch` (nothing runs) and report what each device holds and sends.

    `state` defaults to the one `step.init` made (its shapes). Prints the report unless
    `show=False`; returns it either way. Collectives are counted as often as one step runs
    them: those in a compiled loop (a pipeline's ticks, `num_iteration_per_run` steps) once per
    trip, and of a conditional's branches the one that moves the most bytes.
    """
    state = state if state is not None else step.abstract_state
    if state is None:
        raise ValueError(
            "call step.init(params) or step.abstract_init(params) first, or pass the state"
        )
    compiled = step.lower(state, batch).compile()
    memory = compiled.memory_analysis()
    abstract = jax.eval_shape(lambda s: s, state)
    placement = step.placement
    if placement.grads is None:  # per-replica optimizers: each device's own full gradient
        grads = _device_bytes(abstract.params, placement.params)
        if not step.plan.replica_params:  # replicated parameters, one full gradient
            grads = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.params))
    else:
        grads = _device_bytes(abstract.params, placement.grads)
    uses = hlo.per_call(compiled.as_text(), _Uses.of_line, _Uses(), _Uses.largest)
    report = Explanation(
        params=_device_bytes(abstract.params, placement.params),
        grads=grads,
        opt_state=_device_bytes(abstract.opt_state, placement.opt_state),
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
