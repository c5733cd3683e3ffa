"""`explain`: what a strategy costs, from what XLA compiled.

On a mesh of GPUs that `fleetjax.targets` knows (compile-only devices of a target, or real GPUs
of that kind) it also says what the step needs of the GPU: per-device HBM against the GPU's
memory, pinned host bytes, every collective with its mesh axis, its bytes and whether XLA made
it asynchronous, and a step time estimated with the roofline model of `fleetjax.cost`, with the
GPU's constants from `fleetjax.targets`.
"""

from __future__ import annotations

import dataclasses
import html
import math
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import flax
import jax
import numpy as np
import optax
from jax.sharding import Mesh

from fleetjax import hlo, targets
from fleetjax.auto_parallel import view_of
from fleetjax.cost import Seconds, collective_seconds, compiled_bytes, device_bytes, step_cost
from fleetjax.step import TrainStep

MiB, GiB = 2**20, 2**30


@dataclasses.dataclass(frozen=True)
class CollectiveUse:
    """The collectives of one kind and dtype in a compiled step (on a GPU target: also of one
    mesh axis and one form, asynchronous or not).

    Attributes:
      op: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or "collective-permute".
      dtype: the element type, e.g. "f32".
      count: how many times one step runs them (a loop's body once per trip).
      bytes: their results' bytes on each device, added up over those runs.
      axes: the mesh axes their replica groups span, e.g. ("sharding",) (GPU targets).
      asynchronous: whether XLA scheduled them as ``-start`` / ``-done`` pairs, which
        computation can overlap (GPU targets).
      seconds: their estimated time on the GPU (latency + wire bytes over NVLink or the
        network; GPU targets).
    """

    op: str
    dtype: str
    count: int
    bytes: int
    axes: tuple[str, ...] | None = None
    asynchronous: bool | None = None
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Reshard:
    """A layout change the compiled step holds: the collectives of one kind that move arrays
    from one placement to another over the same mesh dimensions, for one operation of the
    user's code.

    Attributes:
      op: the collective ("all-gather", "all-reduce", "reduce-scatter", "all-to-all",
        "collective-permute").
      change: the placements it moves between, on the dimensions it runs over, e.g.
        "Shard(1) -> Replicate() over mp": an all-gather, "Partial() -> Replicate()" an
        all-reduce, "Partial() -> Shard(d)" a reduce-scatter, "Shard -> Shard(d)" an
        all-to-all, "stage -> next stage" a pipeline's hop. The dimensions are the user's
        `ProcessMesh`'s where the step's mesh is a view of one (`dist.to_static`,
        `dist.shard_optimizer`), else the mesh's axes.
      count: how many such instructions the program holds (a loop's body once).
      bytes: their results' bytes on a device, added up.
      operation: the JAX operation it serves (XLA's metadata: "dot_general", its backward
        "backward of dot_general", ...; "the updated state to its placement" for what XLA
        records no operation of, the new state moved to where it lives).
      source: where the user's code made that operation, "file:line (function)": the
        innermost Python frame outside JAX, flax, optax and fleetjax ("" where XLA kept none).
    """

    op: str
    change: str
    count: int
    bytes: int
    operation: str
    source: str


@dataclasses.dataclass(frozen=True)
class AxisTraffic:
    """The payload one device's collectives carry per step over one mesh axis (or a set of
    axes), beside a formula's where one was given.

    Attributes:
      axes: the mesh axes, e.g. ("mp",) or ("dp", "sharding").
      bytes: the payload: each all-reduce's, all-gather's, all-to-all's and permute's result,
        each reduce-scatter's operand (its result times its group), every loop trip counted.
      formula: what `targets.Megatron.axis_bytes` says for these axes, or None.
    """

    axes: tuple[str, ...]
    bytes: int
    formula: float | None = None

    @property
    def ratio(self) -> float | None:
        """bytes / formula (None without a formula)."""
        return self.bytes / self.formula if self.formula else None


@dataclasses.dataclass(frozen=True)
class GpuEstimate:
    """What a compiled step needs of a GPU (`fleetjax.targets`): an estimate, not a measurement.

    Attributes:
      target: the GPU, e.g. "NVIDIA H100 SXM5 80 GB".
      hbm_bytes: the GPU's memory.
      peak_bytes: the step's device bytes, arguments + outputs - aliased + temporaries (an
        upper bound of XLA's peak; a real run adds the CUDA context, NCCL buffers and
        fragmentation).
      host_bytes: bytes in pinned host memory (an offloaded optimizer state).
      host_note: how `host_bytes` was found where XLA could not say.
      time: the estimated step time by part (`fleetjax.auto`'s cost model).
      matmul_flops: the matmul flops per device the estimate counts.
      bytes_accessed: the device-memory bytes XLA's HloCostAnalysis counts.
    """

    target: str
    hbm_bytes: int
    peak_bytes: int
    host_bytes: int
    host_note: str
    time: Seconds
    matmul_flops: float
    bytes_accessed: float

    @property
    def verdict(self) -> str:
        """ "fits, 23.1 of 79.1 GiB" or "over by 4.2 GiB"."""
        if self.peak_bytes <= self.hbm_bytes:
            return f"fits, {self.peak_bytes / GiB:.1f} of {self.hbm_bytes / GiB:.1f} GiB"
        return f"over by {(self.peak_bytes - self.hbm_bytes) / GiB:.1f} GiB"


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
      collectives: by kind and dtype (on a GPU target also by mesh axis and form), each
        counted as often as one step runs it.
      gpu: on a mesh of GPUs `fleetjax.targets` knows, what the step needs of them.
      traffic: on such a mesh, the payload per mesh axis (beside a formula's, if given).
      reshards: every collective of the program as a layout change, with the user's
        operation that needed it (`Reshard`).
    """

    params: int
    grads: int
    opt_state: int
    temp: int
    arguments: int
    outputs: int
    host_arguments: int
    collectives: tuple[CollectiveUse, ...]
    gpu: GpuEstimate | None = None
    traffic: tuple[AxisTraffic, ...] = ()
    reshards: tuple[Reshard, ...] = ()

    def _bytes_rows(self) -> list[tuple[str, int]]:
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
        return rows

    def __str__(self) -> str:
        lines = ["per-device bytes:"]
        lines += [f"  {name:<22} {value / MiB:10.3f} MiB" for name, value in self._bytes_rows()]
        if self.gpu is not None:
            lines += _gpu_lines(self.gpu)
        lines.append("collectives:" if self.collectives else "collectives: none")
        lines += [_collective_line(c) for c in self.collectives]
        if self.traffic:
            lines.append("payload per mesh axis and step:")
            lines += [_traffic_line(t) for t in self.traffic]
        if self.gpu is not None:
            lines += _estimate_lines(self.gpu)
        if self.reshards:
            lines.append("reshards (what moves, for which operation):")
            lines += [_reshard_line(r) for r in self.reshards]
        return "\n".join(lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        """Jupyter's view: the report as tables."""
        cell = lambda v: f"<td>{html.escape(str(v))}</td>"  # noqa: E731
        bytes_rows = [(n, f"{v / MiB:,.3f} MiB") for n, v in self._bytes_rows()]
        if self.gpu is not None:
            bytes_rows += [(n, f"{v / MiB:,.3f} MiB {c}") for n, v, c in _gpu_rows(self.gpu)]
        parts = ["<table><tr><th colspan=2>per-device bytes</th></tr>"]
        parts += [f"<tr>{cell(n)}{cell(v)}</tr>" for n, v in bytes_rows]
        parts.append("</table>")
        header = ["collective", "dtype", "runs", "MiB"]
        if self.gpu is not None:
            header += ["mesh axes", "asynchronous", "est. ms"]
        parts.append("<table><tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>")
        parts += [
            "<tr>" + "".join(cell(v) for v in _collective_cells(c)) + "</tr>"
            for c in self.collectives
        ]
        parts.append("</table>")
        if self.traffic:
            lines = ["payload per mesh axis and step:", *map(_traffic_line, self.traffic)]
            parts.append("<pre>" + html.escape("\n".join(lines)) + "</pre>")
        if self.gpu is not None:
            parts.append("<pre>" + html.escape("\n".join(_estimate_lines(self.gpu))) + "</pre>")
        return "".join(parts)


def _gpu_rows(gpu: GpuEstimate) -> list[tuple[str, int, str]]:
    """(label, bytes, comment) of what the step needs of the GPU."""
    rows = [("peak estimate", gpu.peak_bytes, f"{gpu.verdict} ({gpu.target})")]
    if gpu.host_bytes:
        rows.append(("pinned host memory", gpu.host_bytes, gpu.host_note))
    return rows


def _gpu_lines(gpu: GpuEstimate) -> list[str]:
    return [
        f"  {label:<22} {value / MiB:10.3f} MiB  {comment}".rstrip()
        for label, value, comment in _gpu_rows(gpu)
    ]


def _collective_cells(c: CollectiveUse) -> list[str]:
    cells = [c.op, c.dtype, f"x{c.count}", f"{c.bytes / MiB:.3f}"]
    if c.axes is not None:
        form = "async" if c.asynchronous else "sync"
        cells += ["+".join(c.axes) or "-", form, f"{c.seconds * 1e3:.3g}"]
    return cells


def _collective_line(c: CollectiveUse) -> str:
    line = f"  {c.op:<19} {c.dtype:<5} x{c.count:<4} {c.bytes / MiB:10.3f} MiB"
    if c.axes is None:
        return line
    _, _, _, _, axes, form, ms = _collective_cells(c)
    return f"{line}  over {axes:<14} {form:<5} ~{ms} ms"


def _reshard_line(r: Reshard) -> str:
    where = f" at {r.source}" if r.source else ""
    return (
        f"  {r.op:<18} {r.change:<40} x{r.count:<3} {r.bytes / MiB:9.3f} MiB  {r.operation}{where}"
    )


def _traffic_line(t: AxisTraffic) -> str:
    line = f"  {'+'.join(t.axes):<19} {t.bytes / GiB:14.3f} GiB"
    if t.formula is not None:
        line += f"  formula {t.formula / GiB:.3f} GiB ({t.ratio:.2f}x)"
    return line


def _estimate_lines(gpu: GpuEstimate) -> list[str]:
    t = gpu.time
    return [
        "estimated step time (a roofline model, not a measurement):",
        f"  compute   {t.compute * 1e3:10.3f} ms  {gpu.matmul_flops:.3g} matmul flops / peak",
        f"  memory    {t.memory * 1e3:10.3f} ms  {gpu.bytes_accessed:.3g} bytes / HBM bandwidth",
        f"  NVLink    {t.links * 1e3:10.3f} ms  collectives within a host",
        f"  network   {t.network * 1e3:10.3f} ms  collectives across hosts",
        f"  latency   {t.latency * 1e3:10.3f} ms  per collective",
        f"  host      {t.host * 1e3:10.3f} ms  offloaded state over PCIe",
        f"  step    ~ {t.total * 1e3:10.3f} ms  max(compute, memory) + the rest (no overlap)",
        f"  overlap ~ {t.overlapped * 1e3:10.3f} ms  with the asynchronous collectives beside "
        "the computation XLA scheduled",
    ]


class _Uses(dict[tuple, tuple[int, int, float]]):
    """key -> (times run, result bytes on each device, estimated seconds), over some
    instructions; the key is (collective, dtype), on a GPU target with its axes and form."""

    def __add__(self, other: _Uses) -> _Uses:  # type: ignore[override]
        total = _Uses(self)
        for key, value in other.items():
            before = total.get(key, (0, 0, 0.0))
            total[key] = tuple(a + b for a, b in zip(before, value, strict=True))
        return total

    def times(self, n: int) -> _Uses:
        return _Uses({key: tuple(n * a for a in value) for key, value in self.items()})

    @staticmethod
    def largest(branches: list[_Uses]) -> _Uses:
        """Of a conditional's branches, the one that moves the most bytes."""
        return max(branches, key=lambda uses: sum(size for _, size, _ in uses.values()))


def _collective_uses(text: str, mesh: Mesh, gpu: bool) -> tuple[CollectiveUse, ...]:
    """The collectives of a compiled module, each counted as often as one call runs it."""
    hosts = [d.process_index for d in mesh.devices.flat]
    spec = targets.device_spec(mesh.devices.flat[0]) if gpu else None

    def of_line(line: str, shapes: Mapping[str, tuple[int, ...]]) -> _Uses:
        uses = _Uses()
        for c in hlo.collectives(line):
            seconds = collective_seconds(c, spec, mesh.size, hosts) if gpu else 0.0
            for dtype, dims in c.arrays:
                key = (c.op, dtype, _axes(c, mesh), c.asynchronous) if gpu else (c.op, dtype)
                size = hlo.itemsize(dtype) * math.prod(dims)
                share_of_time = seconds * size / max(c.result_bytes, 1)
                uses += _Uses({key: (1, size, share_of_time)})
        return uses

    uses = hlo.per_call(text, of_line, _Uses(), _Uses.largest)
    return tuple(
        CollectiveUse(*key[:2], count, size, *key[2:], *((seconds,) if gpu else ()))
        for key, (count, size, seconds) in sorted(uses.items())
    )


# The libraries' code, whose frames are not the user's operation.
_LIBRARIES = tuple(
    str(pathlib.Path(path).parent) + os.sep
    for path in (jax.__file__, flax.__file__, optax.__file__, np.__file__, __file__)
)


def reshards(text: str, mesh: Mesh) -> tuple[Reshard, ...]:
    """Every collective of the compiled module `text` (over `mesh`) as a `Reshard`, grouped by
    kind, placement change, operation and source."""
    frames = hlo.stack_frames(text)
    view = view_of(mesh)
    found: dict[tuple[str, str, str, str], tuple[int, int]] = {}
    for c in hlo.collectives(text):
        axes = _axes(c, mesh)
        names = [view.dim_of(a) or a for a in axes] if view is not None else list(axes)
        key = (c.op, _change(c, names), _operation(c.op_name), _source(frames.get(c.frame, ())))
        count, size = found.get(key, (0, 0))
        found[key] = (count + 1, size + c.result_bytes)
    return tuple(Reshard(*key[:2], *found[key], *key[2:]) for key in sorted(found))


def _change(c: hlo.Collective, dims: list[str]) -> str:
    over = f" over {', '.join(dims)}" if dims else ""
    d = c.dimensions[0] if c.dimensions else None
    change = {
        "all-gather": f"Shard({d}) -> Replicate()",
        "all-reduce": "Partial() -> Replicate()",
        "reduce-scatter": f"Partial() -> Shard({d})",
        "all-to-all": f"Shard -> Shard({d})",
        "collective-permute": "stage -> next stage",
    }[c.op]
    return change + over


def _operation(op_name: str) -> str:
    """ "dot_general" or "backward of dot_general" from XLA's op_name; without one, the
    move of the updated state to where it lives (ZeRO's gather of the parameters)."""
    if not op_name:
        return "the updated state to its placement"
    last = op_name.split(":")[0].rstrip(")").split("/")[-1]
    return f"backward of {last}" if "transpose(" in op_name else last


def _source(frames: tuple[hlo.Frame, ...]) -> str:
    for f in frames:
        if not f.file.startswith(_LIBRARIES) and "/site-packages/" not in f.file:
            return f"{pathlib.Path(f.file).name}:{f.line} ({f.function})"
    return ""


def _axes(c: hlo.Collective, mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes along which `c`'s first replica group spans devices (all of them when
    the text states no groups)."""
    if not c.groups:
        return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    coordinates = np.array(np.unravel_index(list(c.groups[0]), mesh.devices.shape))
    varies = (coordinates != coordinates[:, :1]).any(axis=1)
    return tuple(a for a, v in zip(mesh.axis_names, varies, strict=True) if v)


def _traffic(
    uses: tuple[CollectiveUse, ...], mesh: Mesh, formula: targets.Megatron | None
) -> tuple[AxisTraffic, ...]:
    """The payload per mesh axis of `uses` (with their axes), beside `formula`'s: its "mp",
    "pp", and "data" for the data axes (dp, sharding)."""
    payload: dict[tuple[str, ...], int] = {}
    for c in uses:
        group = math.prod(mesh.shape[a] for a in c.axes)
        size = c.bytes * (group if c.op == "reduce-scatter" else 1)
        payload[c.axes] = payload.get(c.axes, 0) + size
    expected = formula.axis_bytes() if formula is not None else {}

    def formula_of(axes: tuple[str, ...]) -> float | None:
        if axes and set(axes) <= {"dp", "sharding"}:
            return expected.get("data")
        return expected.get(axes[0]) if len(axes) == 1 else None

    return tuple(AxisTraffic(a, b, formula_of(a)) for a, b in sorted(payload.items()) if a)


def _gpu_estimate(
    step: TrainStep, compiled: Any, target: targets.Target, offloaded: int
) -> GpuEstimate:
    """What `compiled` needs of `target`, whose optimizer state of `offloaded` bytes per device
    lives in pinned host memory (`optimize_offload`)."""
    memory = compiled.memory_analysis()
    peak, host, note = compiled_bytes(memory), memory.host_argument_size_in_bytes, ""
    host += memory.host_temp_size_in_bytes
    if offloaded and not memory.host_argument_size_in_bytes:
        # Compile-only devices have no host memory: XLA kept the state on the device.
        peak, host = peak - offloaded, host + offloaded
        note = "the optimizer state's placement: compile-only devices cannot show it"
    spec = targets.device_spec(step.mesh.devices.flat[0], half_precision=step.plan.amp is not None)
    cost = step_cost(compiled, spec, step.mesh)._replace(host_bytes=2.0 * offloaded)
    return GpuEstimate(
        target.description,
        target.spec.hbm_bytes,
        peak,
        host,
        note,
        cost.time(spec),
        cost.matmul_flops,
        cost.bytes_accessed,
    )


def explain(
    step: TrainStep,
    batch: Any,
    state: Any = None,
    *,
    show: bool = True,
    formula: targets.Megatron | None = None,
) -> Explanation:
    """Compile `step` for `batch` (nothing runs) and report what each device holds and sends.

    `state` defaults to the one `step.init` or `step.abstract_init` made (its shapes); `batch`
    may be arrays or `jax.ShapeDtypeStruct`s. Prints the report unless `show=False`; returns
    it either way (Jupyter shows it as tables). Collectives are counted as often as one step
    runs them: those in a compiled loop (a pipeline's ticks, `num_iteration_per_run` steps)
    once per trip, and of a conditional's branches the one that moves the most bytes. On a
    mesh of GPUs that `fleetjax.targets` knows, the report also has `Explanation.gpu` and the
    payload per mesh axis, `Explanation.traffic`, beside `formula`'s where one is given (a
    `targets.Megatron` describing the model and layout).
    """
    state = state if state is not None else step.abstract_state
    if state is None:
        raise ValueError(
            "call step.init(params) or step.abstract_init(params) first, or pass the state"
        )
    compiled = step.lower(state, batch).compile()
    memory = compiled.memory_analysis()
    abstract = jax.eval_shape(lambda s: s, state)
    placement = step.spec(state).placement
    if placement.grads is None:  # per-replica optimizers: each device's own full gradient
        grads = device_bytes(abstract.params, placement.params)
        if not placement.stacked.params:  # replicated parameters, one full gradient
            grads = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.params))
    else:
        grads = device_bytes(abstract.params, placement.grads)
    offloaded = 0
    if step.plan.optimizer_offload:
        offloaded = device_bytes(abstract.opt_state, placement.opt_state)
    target = targets.of(step.mesh.devices.flat[0])
    uses = _collective_uses(compiled.as_text(), step.mesh, target is not None)
    report = Explanation(
        params=device_bytes(abstract.params, placement.params),
        grads=grads,
        opt_state=device_bytes(abstract.opt_state, placement.opt_state),
        temp=memory.temp_size_in_bytes,
        arguments=memory.argument_size_in_bytes,
        outputs=memory.output_size_in_bytes,
        host_arguments=memory.host_argument_size_in_bytes,
        collectives=uses,
        gpu=None if target is None else _gpu_estimate(step, compiled, target, offloaded),
        traffic=() if target is None else _traffic(uses, step.mesh, formula),
        reshards=reshards(compiled.as_text(), step.mesh),
    )
    if show:
        print(report)
    return report
