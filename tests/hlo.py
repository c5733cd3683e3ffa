"""Reading what XLA compiled: the collectives in `compiled.as_text()`, with their group sizes."""

import dataclasses
import math
import re

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)
_OP = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_LIST_GROUPS = re.compile(r"replica_groups=\{(\{[\d,]*\})")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[(?P<axes>[^\]]*)\]\s*\{(?P<names>[^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    shape: str  # the result shape text, e.g. "f32[32,16]{1,0}" or a tuple of them
    group_size: int | None  # devices in each replica group; None if not stated


def _group_size(line: str) -> int | None:
    if m := _LIST_GROUPS.search(line):
        return len([x for x in m.group(1).strip("{}").split(",") if x])
    if m := _IOTA_GROUPS.search(line):
        return int(m.group(2))
    if m := _MESH_GROUPS.search(line):
        sizes = dict(
            (name.strip("'"), int(size))
            for name, size in (item.split("=") for item in m.group("axes").split(","))
        )
        names = [n.strip().strip("'") for n in m.group("names").split(",") if n.strip()]
        return math.prod(sizes[n] for n in names)
    return None


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction in an HLO module's text (async starts counted once)."""
    found = []
    for line in hlo_text.splitlines():
        if (m := _OP.search(line)) and "-done(" not in line:
            found.append(Collective(m.group("op"), m.group("shape"), _group_size(line)))
    return found


_STABLEHLO_TYPE = re.compile(r"tensor<(?:[\d?]+x)*([a-z]+\d*)>")


def stablehlo_dtypes(lowered_text: str, op: str) -> set[str]:
    """The element types in the signatures of every `stablehlo.<op>` in a lowered module
    (`jit(f).lower(...).as_text()`), e.g. {"bf16"} for half-precision dots. Ops with a region
    (`"stablehlo.all_reduce"(...) ({ ... }) : (types) -> types`) are read to the region's end."""
    instruction = re.compile(rf'(?:^|=)\s*"?stablehlo\.{re.escape(op)}"?[\s(]')
    found: set[str] = set()
    lines = lowered_text.splitlines()
    for i, line in enumerate(lines):
        if not instruction.search(line.strip()):
            continue
        if line.rstrip().endswith("({"):  # the signature follows the region's closing "})"
            line = next(rest for rest in lines[i + 1 :] if rest.strip().startswith("})"))
        found.update(_STABLEHLO_TYPE.findall(line.rsplit(" : ", 1)[-1]))
    return found
