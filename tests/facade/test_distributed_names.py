"""`fleetjax.distributed` has Paddle 3.3.1's `paddle.distributed` auto-parallel names, each with
Paddle's parameters (names, kinds, order, defaults), as Paddle itself stated them in
tests/data/paddle3.3.1_distributed_signatures.json (written once by
tests/data/write_signatures_with_paddle.py); the members issue 31 names too. It exports
exactly those names, plus fleetjax's own listed below."""

import enum
import inspect
import json
import pathlib

import pytest

import fleetjax
import fleetjax.distributed as dist

DATA = pathlib.Path(__file__).parents[1] / "data" / "paddle3.3.1_distributed_signatures.json"
PADDLE = json.loads(DATA.read_text())["names"]
PENDING_PHASE_2: tuple[str, ...] = ()  # every name is built
FLEETJAX_OWN = ("placements_of", "process_mesh_of")  # Paddle's t.placements as functions
BUILT = sorted(set(PADDLE) - set(PENDING_PHASE_2))


def default_text(value: object) -> str:
    """A default as the signature file writes it: an enum member as `Type.member`."""
    return f"{type(value).__name__}.{value.name}" if isinstance(value, enum.Enum) else repr(value)


def parameters(obj: object) -> list[dict]:
    found = []
    for p in inspect.signature(obj).parameters.values():
        entry = {"name": p.name, "kind": p.kind.name}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = default_text(p.default)
        found.append(entry)
    return found


def paddles(overloads: list[list[dict]]) -> list[dict]:
    """One parameter list for Paddle's overloads (pybind11 classes): each named parameter once,
    in order; an overload of one positional-only `arg0` is the first parameter, positionally."""
    merged: dict[str, dict] = {}
    for overload in overloads:
        for p in overload:
            if p["kind"] != "POSITIONAL_ONLY":
                assert merged.setdefault(p["name"], p) == p, f"overloads disagree on {p}"
    return list(merged.values())


def test_the_exports_are_paddles_names():
    assert set(PENDING_PHASE_2) <= set(PADDLE)
    assert set(dist.__all__) == set(BUILT) | set(FLEETJAX_OWN)
    missing = [name for name in dist.__all__ if not hasattr(dist, name)]
    assert missing == []
    assert fleetjax.distributed is dist and "distributed" in fleetjax.__all__


@pytest.mark.parametrize("name", BUILT)
def test_paddles_parameters(name):
    paddle, ours = PADDLE[name], getattr(dist, name)
    if paddle["kind"] == "enum":
        assert {m.name: int(m.value) for m in ours} == paddle["values"]
        return
    assert isinstance(ours, type) == (paddle["kind"] == "class")
    assert parameters(ours) == paddles(paddle["signatures"])
    if any(p["kind"] == "POSITIONAL_ONLY" for s in paddle["signatures"] for p in s):
        assert parameters(ours)[0]["kind"] == "POSITIONAL_OR_KEYWORD"
    for member, described in paddle.get("members", {}).items():
        attribute = inspect.getattr_static(ours, member)
        if described["kind"] == "attribute":
            assert isinstance(attribute, property), f"{name}.{member}"
        else:
            method = getattr(ours, member)
            assert parameters(method)[1:] == paddles(described["signatures"]), f"{name}.{member}"


def test_a_differing_signature_fails():
    wrong = [[{"name": "dist_tensor", "kind": "POSITIONAL_OR_KEYWORD"}]]
    assert parameters(dist.reshard) != paddles(wrong)
    assert paddles(PADDLE["Shard"]["signatures"]) == [
        {"name": "dim", "kind": "POSITIONAL_OR_KEYWORD"},
        {"name": "split_factor", "kind": "KEYWORD_ONLY", "default": "1"},
        {"name": "shard_order", "kind": "KEYWORD_ONLY", "default": "0"},
    ]


def test_paddles_tensor_attributes():
    mesh = dist.ProcessMesh([0, 1], dim_names=["x"])
    x = dist.shard_tensor([1.0, 2.0], mesh, [dist.Shard(0)])
    assert (x.placements, x.process_mesh) == ([dist.Shard(0)], mesh)
    assert (dist.placements_of(x), dist.process_mesh_of(x)) == ([dist.Shard(0)], mesh)
