"""Reading what XLA compiled, from `compiled.as_text()` (any backend, compile-only GPUs too).

* `collectives(text)`: every collective instruction, with its result bytes, its replica groups
  (device ids) and whether XLA made it asynchronous (a ``-start`` / ``-done`` pair);
* `matmul_flops(line, shapes)`: 2 x the multiply-adds of a dot, convolution or library matmul;
* `per_call(text, measure, zero, choose)`: a per-instruction measure summed over what one call
  of the module runs: a while loop's body its known trip count times, a conditional's branch
  `choose` picks, fusions and calls once per call (XLA's own cost analysis counts a loop once);
* `computations(text)` and `while_loop(line)`: the module's computations and its loops;
* `stack_frames(text)`: the Python stacks the instructions came from (a collective's
  `Collective.frame`);
* `overlap(text, compute, communicate)`: how much of the asynchronous collectives' time the
  schedule can hide behind the computation it places between each ``-start`` and its
  ``-done``.

No maintained library reads XLA's HLO text, so this is written here; the formats it reads are
XLA's (`replica_groups` as lists, iota and mesh forms; `known_trip_count` backend configs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol, Self, TypeVar

import numpy as np

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\(")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
# An iota device list: iota(prod(dims)) reshaped to dims, transposed, reshaped to the groups.
_IOTA = r"\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?"
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]<=" + _IOTA)
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\(" + _IOTA + r"\))?"  # a transposed device order
    r"\s*\{(?P<names>[^}]*)\}"
)
_DIMENSIONS = re.compile(r"\bdimensions=\{([\d,]*)\}")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_FRAME = re.compile(r"\bstack_frame_id=(\d+)")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_BITS = {"pred": 8, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled module.

    Attributes:
      op: "all-reduce", "all-gather", "reduce-scatter", "all-to-all" or "collective-permute".
      shape: the result shape text, e.g. "f32[32,16]{1,0}" or a tuple of them.
      group_size: devices in each replica group (None if the text does not say).
      pairs: a collective-permute's (source, target) device pairs; empty for the others.
      groups: the replica groups as device ids (a collective-permute's: its pairs), or None
        where the text states none (one group of every device). The ids are positions in the
        compiled computation's device assignment: for a `jax.jit` over a mesh,
        ``mesh.devices.flat``.
      asynchronous: whether XLA scheduled it as a ``-start`` / ``-done`` pair, so that
        computation can run while it communicates.
      dimensions: the dimensions an all-gather concatenates, a reduce-scatter splits, an
        all-to-all exchanges (empty for the others).
      op_name: the JAX operation XLA says it serves (its metadata), e.g.
        "jit(train_step)/transpose(jvp())/dot_general" (a matmul's backward).
      frame: its stack frame id (`stack_frames`), or None.
    """

    op: str
    shape: str
    group_size: int | None
    pairs: tuple[tuple[int, int], ...] = ()
    groups: tuple[tuple[int, ...], ...] | None = dataclasses.field(default=None, compare=False)
    asynchronous: bool = dataclasses.field(default=False, compare=False)
    dimensions: tuple[int, ...] = dataclasses.field(default=(), compare=False)
    op_name: str = dataclasses.field(default="", compare=False)
    frame: int | None = dataclasses.field(default=None, compare=False)

    @property
    def arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, dims) of each array in the result, e.g. [("f32", (32, 16))]."""
        return [
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(self.shape)
        ]

    @property
    def result_bytes(self) -> int:
        """Bytes of the result on each device."""
        return sum(itemsize(dtype) * math.prod(dims) for dtype, dims in self.arrays)


def itemsize(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype] // 8
    digits = re.sub(r"\D", "", dtype)
    return max(int(digits) // 8, 1) if digits else 1


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = [int(d) for d in dims.split(",")]
    ids = np.arange(math.prod(shape)).reshape(shape)
    return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids


def replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    """The device ids of each replica group of a collective instruction, in any of XLA's
    forms (lists, iota, mesh axes), or None where the line states none."""
    if m := _LIST_GROUPS.search(line):
        groups = re.findall(r"\{([\d,]*)\}", m.group(1))
        found = tuple(tuple(int(x) for x in g.split(",") if x) for g in groups)
        return found if any(found) else None
    if m := _IOTA_GROUPS.search(line):
        ids = _iota(m["dims"], m["perm"]).reshape(int(m["groups"]), int(m["size"]))
        return tuple(tuple(int(x) for x in group) for group in ids)
    if m := _MESH_GROUPS.search(line):
        return _mesh_groups(m)
    return None


def _mesh_groups(m: re.Match[str]) -> tuple[tuple[int, ...], ...]:
    """The groups of XLA's mesh form: ``mesh['a'=2,'b'=4] {'b'}``, where a named axis may be
    a sub-axis, ``'b':(2)2``: the 2 devices of ``b`` after a stride of 2 (its minor half)."""
    axes = [item.split("=") for item in m["axes"].split(",")]
    names = [name.strip().strip("'") for name, _ in axes]
    sizes = [int(size) for _, size in axes]
    ids = np.arange(math.prod(sizes)) if m["dims"] is None else _iota(m["dims"], m["perm"])
    # Each axis as (major, sub-axis, minor) dimensions, so that a sub-axis is a dimension too.
    grouped = []
    dims: list[int] = []
    for n in (n.strip() for n in m["names"].split(",") if n.strip()):
        name, _, sub = n.partition(":")
        axis = names.index(name.strip("'"))
        pre, size = (1, sizes[axis]) if not sub else map(int, re.findall(r"\d+", sub))
        grouped.append((axis, pre, size))
    for axis, size in enumerate(sizes):
        subs = [(pre, n) for a, pre, n in grouped if a == axis]
        pre, n = subs[0] if subs else (size, 1)
        dims += [pre, n, size // (pre * n)]
    ids = ids.reshape(dims)
    chosen = [3 * axis + 1 for axis, _, _ in grouped]
    rest = [d for d in range(len(dims)) if d not in chosen]
    size = math.prod(dims[d] for d in chosen)
    ids = ids.transpose(rest + chosen).reshape(-1, size)
    return tuple(tuple(int(x) for x in group) for group in ids)


def _elements(tuple_shape: str) -> list[str]:
    """The top-level elements of a tuple shape's text, e.g. ["f32[2]{0}", "(f32[], s32[])"]."""
    inner, depth, start, found = tuple_shape.strip()[1:-1], 0, 0, []
    for i, char in enumerate(inner):
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        elif char == "," and depth == 0:
            found.append(inner[start:i].strip())
            start = i + 1
    return [*found, inner[start:].strip()]


def _result_shape(op: str, shape: str, asynchronous: bool) -> str:
    """The collective's result: an asynchronous start's shape holds its operands, its results
    and (a permute) its contexts, as ``(operands, results, ...)``."""
    if not asynchronous or op == "all-reduce" or not shape.startswith("("):
        return shape
    return _elements(shape)[1]


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction in an HLO module's text (async pairs counted once; an
    asynchronous start's shape is its results')."""
    found = []
    for line in hlo_text.splitlines():
        if (m := _OP.search(line)) and "-done(" not in line:
            pairs = _PAIRS.search(line)
            pairs = (
                tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs[1]))
                if pairs
                else ()
            )
            groups = pairs or replica_groups(line)
            size = len(groups[0]) if groups and not pairs else None
            started = bool(m["start"])
            shape = _result_shape(m["op"], m["shape"], started)
            dims = _DIMENSIONS.search(line)
            name, frame = _OP_NAME.search(line), _FRAME.search(line)
            found.append(
                Collective(
                    m["op"],
                    shape,
                    size,
                    pairs,
                    groups,
                    asynchronous=started,
                    dimensions=tuple(int(d) for d in dims[1].split(",") if d) if dims else (),
                    op_name=name[1] if name else "",
                    frame=int(frame[1]) if frame else None,
                )
            )
    return found


class Frame(NamedTuple):
    """A Python stack frame a compiled instruction came from."""

    file: str
    function: str
    line: int


def stack_frames(hlo_text: str) -> dict[int, tuple[Frame, ...]]:
    """The module's stack frames by id (an instruction's ``stack_frame_id``), each the whole
    Python stack, innermost frame first (XLA's ``FileNames``, ``FunctionNames``,
    ``FileLocations`` and ``StackFrames`` tables; empty where the text has none)."""
    tables = {}
    for name in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
        section = hlo_text.split(f"\n{name}\n", 1)
        rows = section[1].split("\n\n", 1)[0].splitlines() if len(section) > 1 else []
        tables[name] = {int(r.split(" ", 1)[0]): r.split(" ", 1)[1] for r in rows if r.strip()}
    files, functions = tables["FileNames"], tables["FunctionNames"]

    def field(text: str, key: str) -> int:
        return int(re.search(rf"\b{key}=(\d+)", text)[1])  # type: ignore[index]

    def location(i: int) -> Frame:
        loc = tables["FileLocations"][i]
        return Frame(
            files[field(loc, "file_name_id")].strip('"'),
            functions[field(loc, "function_name_id")].strip('"'),
            field(loc, "line"),
        )

    @functools.cache
    def stack(i: int) -> tuple[Frame, ...]:
        row = tables["StackFrames"].get(i)
        if row is None:
            return ()
        parent = field(row, "parent_frame_id") - 1  # XLA writes the parent's id plus one
        return (location(field(row, "file_location_id")), *(stack(parent) if parent < i else ()))

    return {i: stack(i) for i in sorted(tables["StackFrames"])}


# -- one call of a module: every instruction, loops and branches accounted for ---------------

HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[^\s(]+)\s*\(")
ASSIGN = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[^\s=]+)\s*=\s*\(?(?P<shape>[a-z]\w*\[[\d,]*\])")
SHAPE = re.compile(r"[a-z]\w*\[(?P<dims>[\d,]*)\]")
NAME = re.compile(r"%([\w.\-]+)")
_PARAM = re.compile(r"(?P<name>[\w.\-]+):\s*(?P<shape>[a-z]\w*\[[\d,]*\])")
_CALLS = re.compile(r"\b(?:calls|to_apply|called_computations)=(\{[^}]*\}|%[\w.\-]+)")
_BRANCHES = re.compile(
    r"\b(?:branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+), "
    r"false_computation=%([\w.\-]+))"
)
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


_MATMUL = re.compile(r"\s(?P<op>dot|convolution|custom-call)\((?P<operands>[^)]*)\)")
_DOT_DIMS = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_DIMS = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_CONV_LABELS = re.compile(r"dim_labels=\w+_(\w+)->\w+")


def _operand_dims(operand: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """An operand's dims: printed inline (`f32[2,3]{1,0} %x`) or looked up by name."""
    operand = operand.strip()
    if inline := SHAPE.match(operand):
        return dims(inline.group(0))
    name = NAME.search(operand)
    return shapes.get(name.group(1)) if name else None


def matmul_flops(line: str, shapes: Mapping[str, tuple[int, ...]]) -> float:
    """2 x multiply-adds of a dot, convolution or library matmul instruction (else 0)."""
    match, result = _MATMUL.search(line), ASSIGN.match(line)
    if match is None or result is None:
        return 0.0
    # Split before each operand (a name, or an inline shape, whose dims hold commas too).
    operands = re.split(r",\s*(?=[a-z]\w*\[|%)", match["operands"])
    out = math.prod(dims(result["shape"]))
    if match["op"] == "convolution":
        labels, kernel = _CONV_LABELS.search(line), _operand_dims(operands[1], shapes)
        if labels is None or kernel is None:
            return 0.0
        return 2.0 * out * math.prod(kernel) / kernel[labels.group(1).index("o")]
    contraction = _DOT_DIMS.search(line) if match["op"] == "dot" else _GEMM_DIMS.search(line)
    lhs = _operand_dims(operands[0], shapes)
    if contraction is None or lhs is None:
        return 0.0
    contracting = [int(d) for d in re.findall(r"\d+", contraction.group(1))]
    return 2.0 * out * math.prod(lhs[d] for d in contracting)


def dims(shape: str) -> tuple[int, ...]:
    """The dimensions of an array shape's text, e.g. (32, 16) for "f32[32,16]{1,0}"."""
    return tuple(int(d) for d in SHAPE.match(shape)["dims"].split(",") if d)


def while_loop(line: str) -> tuple[str, int] | None:
    """A while instruction's body computation and its trip count (XLA's ``known_trip_count``;
    1 when XLA does not know it), or None for another instruction."""
    body = _BODY.search(line)
    if body is None:
        return None
    trips = _TRIPS.search(line)
    return body.group(1), int(trips.group(1)) if trips else 1


class Amount(Protocol):
    """What `per_call` adds up: a sum that can be scaled by a loop's trip count."""

    def __add__(self, other: Self, /) -> Self: ...

    def times(self, n: int) -> Self: ...


_A = TypeVar("_A", bound=Amount)


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Each computation's lines (its header first) and the entry computation's name."""
    found: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None:
            if header := HEADER.match(line):
                current = header["name"]
                found[current] = [line]
                entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        else:
            found[current].append(line)
    return found, entry


def per_call(
    hlo_text: str,
    measure: Callable[[str, Mapping[str, tuple[int, ...]]], _A],
    zero: _A,
    choose: Callable[[list[_A]], _A],
) -> _A:
    """The sum of `measure(line, shapes)` over the instructions one call of a module runs.

    `shapes` maps the names defined so far in the line's computation to their dimensions. A
    while loop's body counts its known trip count (XLA's ``known_trip_count``; once when XLA
    does not know it), a conditional the branch that `choose` picks from the branches'
    amounts, and a fusion or call its computation once per call.
    """
    computations_, entry = computations(hlo_text)

    @functools.cache
    def amount(name: str) -> _A:
        lines = computations_.get(name)
        if lines is None:
            return zero
        shapes = {m["name"]: dims(m["shape"]) for m in _PARAM.finditer(lines[0])}
        total = zero
        for line in lines[1:]:
            if assigned := ASSIGN.match(line):
                shapes[assigned["name"]] = dims(assigned["shape"])
            total += measure(line, shapes)
            if loop := while_loop(line):
                total += amount(loop[0]).times(loop[1])
            elif branches := _BRANCHES.search(line):
                names = NAME.findall(branches.group(1) or "") or list(branches.group(2, 3))
                total += choose([amount(b) for b in names])
            else:
                for group in _CALLS.findall(line):
                    for callee in NAME.findall(group):
                        total += amount(callee)
        return total

    return amount(entry)


class Overlap(NamedTuple):
    """Seconds of one call of a computation: computing, communicating, and how much of the
    communication runs beside computation (asynchronous collectives only)."""

    compute: float = 0.0
    communicate: float = 0.0
    hidden: float = 0.0

    def __add__(self, other: tuple) -> Overlap:  # type: ignore[override]
        return Overlap(*(a + b for a, b in zip(self, other, strict=True)))

    def times(self, n: float) -> Overlap:
        return Overlap(*(n * a for a in self))


def overlap(
    hlo_text: str,
    compute: Callable[[str, Mapping[str, tuple[int, ...]]], float],
    communicate: Callable[[Collective], float],
) -> Overlap:
    """What one call of a scheduled module computes and communicates, in seconds, and how much
    of the communication it can hide: an asynchronous collective (a ``-start`` / ``-done``
    pair) hides up to the computation the schedule places between its start and its done
    (`compute(line, shapes)` seconds per instruction, loops, branches and calls included as in
    `per_call`); a synchronous one hides nothing. The text's instruction order is the schedule
    (XLA prints a scheduled module in order)."""
    computations_, entry = computations(hlo_text)

    @functools.cache
    def seconds(name: str) -> Overlap:
        lines = computations_.get(name)
        if lines is None:
            return Overlap()
        shapes = {m["name"]: dims(m["shape"]) for m in _PARAM.finditer(lines[0])}
        total, elapsed = Overlap(), 0.0
        started: dict[str, tuple[float, float]] = {}  # start -> (its seconds, compute before)
        for line in lines[1:]:
            assigned = ASSIGN.match(line)
            if assigned:
                shapes[assigned["name"]] = dims(assigned["shape"])
            inner = _called(line, seconds)
            for c in collectives(line):
                if c.asynchronous and assigned:
                    started[assigned["name"]] = (communicate(c), elapsed)
                else:
                    inner += Overlap(communicate=communicate(c))
            if (done := _DONE.search(line)) and done.group(1) in started:
                comm, before = started.pop(done.group(1))
                inner += Overlap(0.0, comm, min(comm, elapsed - before))
            step = compute(line, shapes) + inner.compute
            elapsed += step
            total += inner._replace(compute=step)
        leftover = sum(comm for comm, _ in started.values())
        return total + Overlap(communicate=leftover)

    return seconds(entry)


_DONE = re.compile(r"-done\(%([\w.\-]+)")


def _called(line: str, seconds: Callable[[str], Overlap]) -> Overlap:
    """The seconds of what `line` calls: a loop's body per trip, a conditional's costliest
    branch, or its called computations."""
    if loop := while_loop(line):
        return seconds(loop[0]).times(loop[1])
    if branches := _BRANCHES.search(line):
        names = NAME.findall(branches.group(1) or "") or list(branches.group(2, 3))
        return max((seconds(b) for b in names), key=lambda o: o.compute + o.communicate)
    total = Overlap()
    for group in _CALLS.findall(line):
        for callee in NAME.findall(group):
            total += seconds(callee)
    return total
