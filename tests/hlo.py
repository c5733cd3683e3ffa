"""Reading what XLA compiled, for tests: the collectives (fleetjax's own reader) and the element
types of operations in a lowered (StableHLO) module."""

import re

from fleetjax.hlo import Collective, collectives  # noqa: F401 (re-exported for the tests)

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


def computations(hlo_text: str) -> dict[str, str]:
    """An HLO module's computations by name (the entry computation as "ENTRY")."""
    found: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0].lstrip("%")
            found[name] = []
        elif name is not None:
            found[name].append(line)
    return {n: "\n".join(lines) for n, lines in found.items()}
