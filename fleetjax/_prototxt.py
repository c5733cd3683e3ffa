"""Paddle's prototxt format for `DistributedStrategy`: protobuf text format of
`paddle.fleet.DistributedStrategy`, read and written with protobuf's own `text_format`.

The protobuf message classes are built at import time from the schema in `_schema.py`
(`descriptor_pb2` + `message_factory`), so no `.proto` file or `protoc` run is needed and the
parser is protobuf's, not ours.

Fields that Paddle 3.x's proto lacks (Python-only attributes in Paddle, such as
`hybrid_configs.order`, and 2.x-only fields such as `execution_strategy`) are written as
extension comment lines, which Paddle's parser skips:

    # fleetjax: hybrid_configs.order = ["dp", "pp", "sharding", "mp"]

and read back from them (the value is JSON). Paddle 2.x files that use those fields as real
proto fields load too.
"""

from __future__ import annotations

import functools
import json
import os
import stat
import uuid
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from google.protobuf.message import Message as ProtoMessage

from fleetjax._config import Enum, MessageSpec

PACKAGE = "paddle.fleet"  # Paddle's package, so messages and errors read as Paddle's do
EXTENSION_PREFIX = "# fleetjax: "

_FD = descriptor_pb2.FieldDescriptorProto
_SCALAR_TYPES = {
    bool: _FD.TYPE_BOOL,
    int: _FD.TYPE_INT32,
    # Paddle's proto uses float32; double keeps values exact here (0.8 stays 0.8), and the
    # text is the same for every value a float32 field can hold.
    float: _FD.TYPE_DOUBLE,
    str: _FD.TYPE_STRING,
}


class PrototxtError(ValueError):
    """A prototxt file that cannot be read: names the file, the line and the field."""


def _collect(spec: MessageSpec, seen: dict[str, MessageSpec], enums: dict[str, Enum]) -> None:
    if spec.name in seen:
        return
    seen[spec.name] = spec
    for f in spec.fields:
        if isinstance(f.type, MessageSpec):
            _collect(f.type, seen, enums)
        elif isinstance(f.type, Enum):
            enums[f.type.name] = f.type


@functools.cache
def _proto_class(root: MessageSpec) -> type[ProtoMessage]:
    """The protobuf message class for `root` (and, within it, every nested message)."""
    messages: dict[str, MessageSpec] = {}
    enums: dict[str, Enum] = {}
    _collect(root, messages, enums)
    file = descriptor_pb2.FileDescriptorProto(
        name=f"fleetjax/{root.name}.proto", package=PACKAGE, syntax="proto2"
    )
    for enum in enums.values():
        e = file.enum_type.add(name=enum.name)
        for member, number in enum.members:
            e.value.add(name=member, number=number)
    for spec in messages.values():
        m = file.message_type.add(name=spec.name)
        for f in spec.fields:
            fd = m.field.add(
                name=f.name,
                number=f.number,
                label=_FD.LABEL_REPEATED if f.repeated else _FD.LABEL_OPTIONAL,
            )
            if isinstance(f.type, MessageSpec):
                fd.type, fd.type_name = _FD.TYPE_MESSAGE, f".{PACKAGE}.{f.type.name}"
            elif isinstance(f.type, Enum):
                fd.type, fd.type_name = _FD.TYPE_ENUM, f".{PACKAGE}.{f.type.name}"
            else:
                fd.type = _SCALAR_TYPES[f.type]
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{root.name}"))


# -- reading ---------------------------------------------------------------------------------
def _proto_to_dict(msg: ProtoMessage) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fd, value in msg.ListFields():
        if fd.message_type is not None:
            out[fd.name] = (
                [_proto_to_dict(v) for v in value] if fd.is_repeated else _proto_to_dict(value)
            )
        elif fd.enum_type is not None:
            out[fd.name] = fd.enum_type.values_by_number[value].name
        else:
            out[fd.name] = list(value) if fd.is_repeated else value
    return out


def _merge_into(tree: dict[str, Any], path: list[str], value: Any) -> None:
    if not all(path):
        raise ValueError(f"{'.'.join(path)!r} is not a field name like 'amp_configs.x'")
    for depth, key in enumerate(path[:-1], start=1):
        tree = tree.setdefault(key, {})
        if not isinstance(tree, dict):
            where = ".".join(path[:depth])
            raise ValueError(f"{where} is a {type(tree).__name__} field, which has no fields")
    tree[path[-1]] = value


def parse(text: str, root: MessageSpec, source: str = "<prototxt>") -> dict[str, Any]:
    """Parse prototxt `text` into a nested dict of the fields it sets.

    Raises:
      PrototxtError: on a syntax error, an unknown field or a value of the wrong type, naming
        `source` and the line.
    """
    msg = _proto_class(root)()
    try:
        text_format.Merge(text, msg)
    except text_format.ParseError as e:
        raise PrototxtError(f"{source}: {e}") from None
    values = _proto_to_dict(msg)
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.startswith(EXTENSION_PREFIX):
            continue
        path, sep, value = line[len(EXTENSION_PREFIX) :].partition("=")
        try:
            if not sep:
                raise ValueError("expected 'name = <JSON value>'")
            _merge_into(values, path.strip().split("."), json.loads(value))
        except RecursionError:
            message = "bad fleetjax extension line: the JSON value is nested too deeply"
            raise PrototxtError(f"{source}:{lineno}: {message}") from None
        except ValueError as e:
            raise PrototxtError(f"{source}:{lineno}: bad fleetjax extension line: {e}") from None
    return values


# -- writing ---------------------------------------------------------------------------------
def _fill(msg: ProtoMessage, spec: MessageSpec, values: dict[str, Any]) -> None:
    for f in spec.fields:
        if f.name not in values:
            continue
        value = values[f.name]
        if isinstance(f.type, MessageSpec):
            if f.repeated:
                for item in value:
                    _fill(getattr(msg, f.name).add(), f.type, item)
            else:
                sub = getattr(msg, f.name)
                sub.SetInParent()
                _fill(sub, f.type, value)
        elif f.repeated:
            getattr(msg, f.name).extend(value)
        else:
            setattr(msg, f.name, value)


def _split(spec: MessageSpec, values: dict[str, Any], prefix: str = ""):
    """Split `values` into (Paddle fields, extension lines)."""
    paddle: dict[str, Any] = {}
    lines: list[str] = []
    for f in spec.fields:
        if f.name not in values:
            continue
        value = values[f.name]
        if not f.paddle:
            lines += _extension_lines(f"{prefix}{f.name}", value)
        elif isinstance(f.type, MessageSpec) and not f.repeated:
            nested, nested_lines = _split(f.type, value, f"{prefix}{f.name}.")
            lines += nested_lines
            if nested:
                paddle[f.name] = nested
        else:
            paddle[f.name] = value
    return paddle, lines


def _extension_lines(path: str, value: Any) -> list[str]:
    if isinstance(value, dict):
        return [line for k, v in value.items() for line in _extension_lines(f"{path}.{k}", v)]
    return [f"{EXTENSION_PREFIX}{path} = {json.dumps(value)}"]


def format(root: MessageSpec, values: dict[str, Any]) -> str:
    """Prototxt text for the nested dict `values` (the fields to record)."""
    paddle, lines = _split(root, values)
    msg = _proto_class(root)()
    _fill(msg, root, paddle)
    text = text_format.MessageToString(msg)
    if lines:
        text += "# Fields Paddle's proto does not have; Paddle skips these comment lines.\n"
        text += "".join(line + "\n" for line in lines)
    return text


# -- files -----------------------------------------------------------------------------------
def read_file(path: str | os.PathLike[str]) -> str:
    """The text of the prototxt file `path`.

    Raises:
      PrototxtError: if it is not UTF-8 text (naming the file and the line).
      OSError: if it cannot be read (naming the file).
    """
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise PrototxtError(
            f"{os.fspath(path)}:{line}: not a text file (byte 0x{data[e.start]:02x} is not "
            "UTF-8); a prototxt file is protobuf text format"
        ) from None


def write_file(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` atomically: into a new file beside it, renamed over it once
    complete, so `path` holds the old text or the new, never a part.

    A new file gets the mode `open()` would give it (0o666 less the umask); a replaced file
    keeps its mode. Nothing is left behind on failure.

    Raises:
      OSError: the error of writing `path` (naming `path`, never the temporary file).
    """
    path = os.fspath(path)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        mode = None
    temporary = os.path.join(os.path.dirname(os.path.abspath(path)), f".{uuid.uuid4().hex}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as e:
        raise type(e)(e.errno, e.strerror, path) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except OSError as e:
        os.unlink(temporary)
        raise type(e)(e.errno, e.strerror, path) from None
