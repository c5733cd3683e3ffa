"""Reading what XLA compiled: the collectives in `compiled.as_text()` and the bytes they move."""

from __future__ import annotations

import dataclasses
import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_LIST_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\})")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\(\[[\d,]*\](?:T\([\d,]*\))?\))?"  # a transposed device order
    r"\s*\{(?P<names>[^}]*)\}"
)
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
    """

    op: str
    shape: str
    group_size: int | None
    pairs: tuple[tuple[int, int], ...] = ()

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
        return sum(_itemsize(dtype) * math.prod(dims) for dtype, dims in self.arrays)


def _itemsize(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype] // 8
    digits = re.sub(r"\D", "", dtype)
    return max(int(digits) // 8, 1) if digits else 1


def _group_size(line: str) -> int | None:
    if m := _LIST_GROUPS.search(line):
        return len([x for x in m.group(1).strip("{}").split(",") if x])
    if m := _IOTA_GROUPS.search(line):
        return int(m.group(2))
    if m := _MESH_GROUPS.search(line):
        sizes = {
            name.strip("'"): int(size)
            for name, size in (item.split("=") for item in m.group("axes").split(","))
        }
        names = [n.strip().strip("'") for n in m.group("names").split(",") if n.strip()]
        return math.prod(sizes[n] for n in names)
    return None


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction in an HLO module's text (async pairs counted once)."""
    found = []
    for line in hlo_text.splitlines():
        if (m := _OP.search(line)) and "-done(" not in line:
            pairs = _PAIRS.search(line)
            found.append(
                Collective(
                    m.group("op"),
                    m.group("shape"),
                    _group_size(line),
                    tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs[1]))
                    if pairs
                    else (),
                )
            )
    return found
