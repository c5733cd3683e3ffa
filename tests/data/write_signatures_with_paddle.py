"""Writes paddle<version>_distributed_signatures.json here: the parameters (names, kinds, order,
defaults) of every `paddle.distributed` name issue 31 lists, and of the members it names, read
from the installed Paddle with `inspect.signature` (pybind11 classes: from their docstrings,
one signature per overload).

pip install paddlepaddle==3.3.1 "numpy<2.4"
python tests/data/write_signatures_with_paddle.py tests/data
"""

import enum
import inspect
import json
import re
import sys

import paddle
import paddle.distributed as dist
from paddle.distributed.auto_parallel import api

# name -> (where Paddle keeps it, the members issue 31 names or uses)
PLACEMENT_METHODS = ["is_shard", "is_replicated", "is_partial"]
NAMES = {
    "ProcessMesh": (
        dist,
        [
            *("mesh", "shape", "dim_names", "process_ids", "ndim"),
            *("get_dim_size", "get_mesh_with_dim", "get_submesh_with_dim"),
        ],
    ),
    "Placement": (dist, PLACEMENT_METHODS),
    "Shard": (dist, [*PLACEMENT_METHODS, "get_dim", "get_split_factor", "get_co_shard_order"]),
    "Replicate": (dist, PLACEMENT_METHODS),
    "Partial": (dist, [*PLACEMENT_METHODS, "reduce_type"]),
    "ReduceType": (dist, []),
    "shard_tensor": (dist, []),
    "dtensor_from_fn": (dist, []),
    "dtensor_from_local": (api, []),
    "dtensor_to_local": (api, []),
    "reshard": (dist, []),
    "unshard_dtensor": (dist, []),
    "local_map": (dist, []),
    "set_mesh": (dist, []),
    "get_mesh": (dist, []),
    "save_state_dict": (dist, []),
    "load_state_dict": (dist, []),
    "Strategy": (dist, []),
    "shard_layer": (dist, []),
    "shard_optimizer": (dist, []),
    "ShardingStage1": (dist, []),
    "ShardingStage2": (dist, []),
    "ShardingStage3": (dist, []),
    "shard_scaler": (dist, []),
    "shard_dataloader": (dist, []),
    "to_static": (dist, []),
    "DistModel": (dist, ["train", "eval", "predict", "__call__", "state_dict", "set_state_dict"]),
    "parallelize": (dist, []),
    "ColWiseParallel": (dist, []),
    "RowWiseParallel": (dist, []),
    "SequenceParallelBegin": (dist, []),
    "SequenceParallelEnd": (dist, []),
    "SequenceParallelEnable": (dist, []),
    "SequenceParallelDisable": (dist, []),
    "PrepareLayerInput": (dist, []),
    "PrepareLayerOutput": (dist, []),
    "SplitPoint": (dist, []),
}
_ENUM_REPR = re.compile(r"^<(\w+)\.(\w+): -?\d+>$")


def default_text(value: object) -> str:
    """A default as the test compares it: an enum member as `Type.member`, else its repr."""
    if isinstance(value, enum.Enum) or type(value).__name__ in ("ReduceType",):
        return f"{type(value).__name__}.{value.name}"
    text = repr(value)
    return re.sub(_ENUM_REPR, r"\1.\2", text)


def from_signature(signature: inspect.Signature) -> list[dict]:
    found = []
    for p in signature.parameters.values():
        if p.name == "self":
            continue
        entry = {"name": p.name, "kind": p.kind.name}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = default_text(p.default)
        found.append(entry)
    return found


def _split(text: str) -> list[str]:
    """Top-level comma-separated items of a parameter list."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char in "([<") - (char in ")]>")
        if char == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    return [*items, text[start:].strip()] if text.strip() else items


def from_pybind(doc: str, name: str) -> list[list[dict]]:
    """One parameter list per overload in a pybind11 docstring's `name(self: T, ...) -> R`."""
    overloads = []
    for params in re.findall(rf"^\s*(?:\d+\. )?{name}\((.*)\) -> ", doc, re.M):
        found, kind = [], "POSITIONAL_OR_KEYWORD"
        for item in _split(params):
            if item == "*":
                kind = "KEYWORD_ONLY"
                continue
            head, _, default = item.partition(" = ")
            param = head.split(":")[0].strip()
            if param == "self":
                continue
            entry = {"name": param, "kind": "POSITIONAL_ONLY" if param == "arg0" else kind}
            if default:
                entry["default"] = re.sub(_ENUM_REPR, r"\1.\2", default.strip())
            found.append(entry)
        overloads.append(found)
    return overloads


def signatures(obj: object, name: str) -> list[list[dict]]:
    """The parameter lists of calling `obj` (a class: its constructor)."""
    try:
        return [from_signature(inspect.signature(obj))]
    except ValueError:  # a pybind11 builtin
        target = obj.__init__ if isinstance(obj, type) else obj
        return from_pybind(target.__doc__ or "", "__init__" if isinstance(obj, type) else name)


def describe(name: str, owner: object, members: list[str]) -> dict:
    obj = getattr(owner, name)
    entry = {"path": f"{owner.__name__}.{name}"}
    if isinstance(obj, enum.EnumMeta) or hasattr(obj, "__members__"):
        entry["kind"] = "enum"
        entry["values"] = {m: int(v.value) for m, v in obj.__members__.items()}
        return entry
    entry["kind"] = "class" if isinstance(obj, type) else "function"
    entry["signatures"] = signatures(obj, name)
    described = {}
    for member in members:
        attribute = inspect.getattr_static(obj, member)
        if isinstance(attribute, property) or type(attribute).__name__ == "property":
            described[member] = {"kind": "attribute"}
        else:
            described[member] = {
                "kind": "method",
                "signatures": signatures(getattr(obj, member), member),
            }
    if described:
        entry["members"] = described
    return entry


if __name__ == "__main__":
    out = sys.argv[1]
    table = {name: describe(name, owner, members) for name, (owner, members) in NAMES.items()}
    path = f"{out}/paddle{paddle.__version__}_distributed_signatures.json"
    with open(path, "w") as f:
        json.dump({"paddle": paddle.__version__, "names": table}, f, indent=1, sort_keys=True)
        f.write("\n")
    print(path)
