"""Schema-driven configuration messages: the machinery behind every strategy class.

A `MessageSpec` describes one Paddle proto message (its fields, types, defaults and value
checks). A `Message` holds the values of one such message with the semantics fleetjax promises
instead of Paddle's quirks:

* assigning a dict to a message field updates only the keys given; a list replaces the old list;
* an unknown name raises `UnknownFieldError` listing the valid names (with a close match);
* a value of the wrong type raises `FieldTypeError` (a TypeError and a ValueError) naming the
  field and the expected type, and a value out of range raises `ValueError` saying what is
  allowed; either way nothing changes;
* a scalar field whose default is None (Paddle's `str | None`) also takes None;
* fields remember whether they were set (proto2 presence), which is what prototxt files record.
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import numpy as np

_INT32 = (-(2**31), 2**31 - 1)


class UnknownFieldError(KeyError, AttributeError, TypeError, ValueError):
    """An attribute, config key or section name that the message does not have.

    A KeyError and an AttributeError (so `in`, `getattr(..., default)` and `hasattr` work),
    and also what Paddle raises for the same mistake, so that code catching Paddle's errors
    catches it: TypeError (`DistributedStrategy` attributes) and ValueError
    (`paddle.distributed.Strategy`'s `fused_passes` keys).
    """

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class FieldTypeError(TypeError, ValueError):
    """A value of the wrong type for a field (or a non-dict for a message).

    A TypeError that is also a ValueError, which is what Paddle raises for some fields
    (`DistributedStrategy.a_sync`, `adam_d2sum`) and for `Strategy(config)` with a non-dict.
    """


@dataclasses.dataclass(frozen=True)
class Check:
    """A value constraint: `test(value)` must hold; `allowed` says what is allowed, for errors."""

    test: Callable[[Any], bool]
    allowed: str


def one_of(*values: Any) -> Check:
    return Check(lambda v: v in values, "one of " + ", ".join(repr(v) for v in values))


def at_least(low: float) -> Check:
    return Check(lambda v: v >= low, f">= {low}")


def greater_than(low: float) -> Check:
    return Check(lambda v: v > low, f"> {low}")


def between(low: float, high: float) -> Check:
    """Open interval (low, high)."""
    return Check(lambda v: low < v < high, f"strictly between {low} and {high}")


@dataclasses.dataclass(frozen=True)
class Enum:
    """A proto enum; Python values are the member names."""

    name: str
    members: tuple[tuple[str, int], ...]


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    """One field of a message.

    Attributes:
      name: the Paddle name (proto field name or Python-side key).
      type: bool, int, float, str, an `Enum`, or a `MessageSpec` for nested messages.
      default: the default value (a list for repeated fields, None for nested messages).
      number: the proto field number; prototxt files list fields in this order.
      paddle: True if Paddle 3.x's proto has this field. Other fields (Paddle 2.x-only or
        Python-only in Paddle, such as `hybrid_configs.order`) are written as fleetjax extension
        comment lines so that Paddle can still load our files.
      check: a value constraint, applied to each element of a repeated field.
      note: why the field has no effect in fleetjax, if it has none (a warning is given once
        when a strategy that sets it is used).
      paddle_default: Paddle's default where the seed documents (our contract) give another;
        prototxt files always record such fields, so Paddle reads the value fleetjax means.
      kind: what the field is in fleetjax (docs/knobs.md's legend: "feature", "XLA flag",
        "XLA default", "no JAX meaning", "not yet"); "" for the default, "no JAX meaning"
        with a note, else "feature".
      when: what fleetjax does when it is set ("applied", "warns", "raises", "silent"); ""
        for the default, "warns" with a note, "raises" for "not yet", else "applied".
      doc: its effect in fleetjax, as docs/knobs.md says (`fleetjax.knobs` makes the tables);
        "" with a note: the note.
    """

    name: str
    type: Any
    default: Any
    number: int
    paddle: bool = True
    check: Check | None = None
    note: str | None = None
    paddle_default: Any = None
    kind: str = ""
    when: str = ""
    doc: str = ""

    @property
    def repeated(self) -> bool:
        return isinstance(self.default, list)

    @property
    def is_message(self) -> bool:
        return isinstance(self.type, MessageSpec)


@dataclasses.dataclass(frozen=True)
class MessageSpec:
    """A message: its proto name, the label used in error messages, and its fields."""

    name: str
    label: str
    fields: tuple[FieldSpec, ...]
    hints: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {f.name: f for f in self.fields})

    def __hash__(self) -> int:
        return hash(self.name)

    def __deepcopy__(self, memo: dict) -> MessageSpec:
        return self  # immutable, and messages compare specs by identity

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.fields]

    def field(self, name: str) -> FieldSpec:
        try:
            return self._by_name[name]  # type: ignore[attr-defined]
        except KeyError:
            raise UnknownFieldError(self._unknown_message(name)) from None

    def _unknown_message(self, name: str) -> str:
        text = f"{name!r} is not a field of {self.label}"
        homes = [f.name for f in self.fields if f.is_message and name in f.type.names]
        if name in self.hints:
            text += f": {self.hints[name]}"
        elif homes:
            listed = " and ".join([", ".join(homes[:-1]), homes[-1]] if len(homes) > 1 else homes)
            text += f": it is a key of {listed} ({self._set_in(homes[0], name)})"
        else:
            close = difflib.get_close_matches(name, self.names, n=1)
            if close:
                text += f" (did you mean {close[0]!r}?)"
        return text + ". Valid names: " + ", ".join(self.names)

    def _set_in(self, home: str, name: str) -> str:
        """How `name` is set in this message's field `home`."""
        if self.label == self.name:  # a strategy object, not a config inside one
            return f"strategy.{home}[{name!r}] = ..."
        return f"{self.label}[{home!r}][{name!r}] = ..."


def field(
    number: int,
    name: str,
    type: Any,
    default: Any = None,
    *,
    paddle: bool = True,
    check: Check | None = None,
    note: str | None = None,
    paddle_default: Any = None,
    kind: str = "",
    when: str = "",
    doc: str = "",
) -> FieldSpec:
    """Shorthand for `FieldSpec`; a list default makes the field repeated."""
    return FieldSpec(
        name, type, default, number, paddle, check, note, paddle_default, kind, when, doc
    )


def message(
    name: str, label: str, fields: Sequence[FieldSpec], hints: Mapping[str, str] | None = None
) -> MessageSpec:
    return MessageSpec(name, label, tuple(fields), dict(hints or {}))


class FrozenList(list):
    """A list read from a config: compares like a list, but refuses in-place changes.

    Changing it in place could not reach the config it came from, so instead of doing nothing
    it raises; assign a new list to the config key instead.
    """

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "this list is a copy of a config value; assign a new list to the config key instead"
        )

    append = extend = insert = remove = pop = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]


def _type_name(t: Any) -> str:
    if isinstance(t, MessageSpec):
        return f"a dict of {t.label} keys"
    if isinstance(t, Enum):
        return "one of " + ", ".join(repr(m) for m, _ in t.members)
    return t.__name__


def _coerce_scalar(spec: FieldSpec, value: Any, where: str) -> Any:
    t = spec.type
    if value is None and spec.default is None:  # an optional field (Paddle's `str | None`)
        return None
    if t is bool:
        ok = isinstance(value, (bool, np.bool_))
    elif t is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    elif t is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    elif t is str or isinstance(t, Enum):
        ok = isinstance(value, str)
    else:  # pragma: no cover - schema error
        raise AssertionError(f"bad field type {t!r}")
    if not ok:
        expected = _type_name(t) + (" or None" if spec.default is None else "")
        raise FieldTypeError(f"{where} must be {expected}, got {type(value).__name__} {value!r}")
    value = t(value) if t in (bool, int, float) else value
    if t is int and not _INT32[0] <= value <= _INT32[1]:
        raise ValueError(f"{where} must fit in int32, got {value}")
    if isinstance(t, Enum) and value not in dict(t.members):
        raise ValueError(f"{where} must be {_type_name(t)}, got {value!r}")
    if spec.check is not None and not spec.check.test(value):
        raise ValueError(f"{where} must be {spec.check.allowed}, got {value!r}")
    return value


_CLASS_FOR_SPEC: dict[str, type[Message]] = {}


class Message:
    """The values of one `MessageSpec`, with attribute access and validated updates.

    Subclasses set `SPEC`; `Subclass(**values)` builds one with those values set. Only fields
    that were set are stored; others read as their defaults.
    """

    SPEC: MessageSpec

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "SPEC" in cls.__dict__:
            _CLASS_FOR_SPEC[cls.SPEC.name] = cls

    def __init__(self, values: Mapping[str, Any] | None = None, /, **kwargs: Any) -> None:
        self._setup(type(self).SPEC, type(self).SPEC.label)
        self.update(values, **kwargs)

    @classmethod
    def _make(cls, spec: MessageSpec, path: str) -> Message:
        """An empty message for `spec`, of the class registered for it (else `Config`)."""
        obj = object.__new__(_CLASS_FOR_SPEC.get(spec.name, Config))
        obj._setup(spec, path)
        return obj

    def _setup(self, spec: MessageSpec, path: str) -> None:
        object.__setattr__(self, "_spec", spec)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_copy_of", None)  # set on an element of a repeated field
        children = {
            f.name: Message._make(f.type, f"{path}.{f.name}")
            for f in spec.fields
            if f.is_message and not f.repeated
        }
        object.__setattr__(self, "_children", children)

    # -- reading -------------------------------------------------------------------------
    def _get(self, name: str) -> Any:
        spec = self._spec.field(name)
        if name in self._children:
            return self._children[name]
        value = self._values.get(name, spec.default)
        if spec.repeated and spec.is_message:  # messages, as Paddle's repeated fields hold
            return FrozenList(self._element(name, i, v) for i, v in enumerate(value))
        if spec.repeated:
            return FrozenList(value)
        return value

    def _element(self, name: str, index: int, values: Mapping[str, Any]) -> Message:
        """Element `index` of the repeated message field `name`: a read-only copy."""
        element = Message._make(self._spec.field(name).type, f"{self._path}.{name}[{index}]")
        element._apply(element._checked(values))
        element._mark_copy(f"{self._path}.{name}")
        return element

    def _mark_copy(self, source: str) -> None:
        object.__setattr__(self, "_copy_of", source)
        for child in self._children.values():
            child._mark_copy(source)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # keeps copy/pickle from recursing before _setup ran
            raise AttributeError(name)
        return self._get(name)

    def is_set(self, name: str) -> bool:
        """Whether `name` was set explicitly (what a prototxt file records)."""
        self._spec.field(name)
        if name in self._children:
            return self._children[name].has_values()
        return name in self._values

    def has_values(self) -> bool:
        """Whether any field, here or nested, was set explicitly."""
        return bool(self._values) or any(c.has_values() for c in self._children.values())

    def to_dict(self) -> dict[str, Any]:
        """Every field's value (defaults included), nested messages as dicts."""
        return {f.name: self._plain(f.name) for f in self._spec.fields}

    def set_values(self) -> dict[str, Any]:
        """Only the fields that were set explicitly, nested messages as dicts."""
        out = {}
        for f in self._spec.fields:
            if f.name in self._children:
                if self._children[f.name].has_values():
                    out[f.name] = self._children[f.name].set_values()
            elif f.name in self._values:
                out[f.name] = self._plain(f.name)
        return out

    def non_defaults(self) -> dict[str, Any]:
        """The fields whose value differs from the default, nested messages as dicts."""
        out = {}
        for f in self._spec.fields:
            if f.name in self._children:
                nested = self._children[f.name].non_defaults()
                if nested:
                    out[f.name] = nested
            elif self._plain(f.name) != f.default:
                out[f.name] = self._plain(f.name)
        return out

    def _plain(self, name: str) -> Any:
        """The value of `name` as plain Python data (dicts and lists; a repeated message's
        elements as the dicts of their set values)."""
        if self._spec.field(name).repeated:
            value = self._values.get(name, self._spec.field(name).default)
            return [dict(v) if isinstance(v, Mapping) else v for v in value]
        value = self._get(name)
        return value.to_dict() if isinstance(value, Message) else value

    # -- writing -------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        self.update({name: value})

    def __delattr__(self, name: str) -> None:
        self.reset(name)

    def reset(self, name: str) -> None:
        """Return `name` to its default and clear its presence."""
        self._check_writable()
        self._spec.field(name)
        if name in self._children:
            self._children[name].clear_values()
        self._values.pop(name, None)

    def clear_values(self) -> None:
        """Return every field to its default."""
        self._check_writable()
        self._values.clear()
        for child in self._children.values():
            child.clear_values()

    def update(self, values: Mapping[str, Any] | None = None, /, **kwargs: Any) -> None:
        """Merge `values` in: only the keys given change; lists replace old lists.

        Everything is checked before anything changes, so on error the message is untouched.
        Nested messages accept a dict (merged) or a message of the same kind (replaces).
        """
        self._check_writable()
        if values is not None and not isinstance(values, Mapping):
            raise FieldTypeError(
                f"{self._path} must be set from a dict, got {type(values).__name__} {values!r}"
            )
        self._apply(self._checked({**(values or {}), **kwargs}))

    def _check_writable(self) -> None:
        if self._copy_of is not None:
            raise TypeError(
                f"{self._path} is a copy of an element of {self._copy_of}, so a change to it "
                f"could not reach the strategy; assign {self._copy_of} a new list instead"
            )

    def _checked(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Validate `values` against the spec without changing anything."""
        checked: dict[str, Any] = {}
        for name, value in values.items():
            spec = self._spec.field(name)
            where = f"{self._path}.{name}"
            if name in self._children:
                checked[name] = self._children[name]._checked_message(value, where)
            elif spec.repeated:
                checked[name] = _checked_list(spec, value, where)
            else:
                checked[name] = _coerce_scalar(spec, value, where)
        return checked

    def _checked_message(self, value: Any, where: str) -> tuple[bool, dict[str, Any]]:
        """(replace?, checked values) for assigning `value` to this nested message."""
        if isinstance(value, Message):
            if value._spec is not self._spec:
                raise FieldTypeError(
                    f"{where} must be {_type_name(self._spec)}, got {type(value).__name__}"
                )
            return True, self._checked(value.set_values())
        if not isinstance(value, Mapping):
            raise FieldTypeError(
                f"{where} must be {_type_name(self._spec)}, got {type(value).__name__} {value!r}"
            )
        return False, self._checked(value)

    def _apply(self, checked: Mapping[str, Any]) -> None:
        for name, value in checked.items():
            if name in self._children:
                replace, nested = value
                if replace:
                    self._children[name].clear_values()
                self._children[name]._apply(nested)
            else:
                self._values[name] = value

    def __copy__(self) -> Message:
        """An independent copy with the same values set (a copy is always deep)."""
        new = Message._make(self._spec, self._path)
        new._apply(new._checked(self.set_values()))
        return new

    def __deepcopy__(self, memo: dict) -> Message:
        return self.__copy__()

    # -- comparison and display ----------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if isinstance(other, Message):
            return self._spec is other._spec and self.to_dict() == other.to_dict()
        if isinstance(other, Mapping) and isinstance(self, Config):
            return self.to_dict() == dict(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self.non_defaults().items())
        return f"{type(self).__name__}({shown})"

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self._spec.names))


def _checked_list(spec: FieldSpec, value: Any, where: str) -> list[Any]:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (Sequence, np.ndarray)):
        raise FieldTypeError(
            f"{where} must be a list of {_type_name(spec.type)}, "
            f"got {type(value).__name__} {value!r}"
        )
    if not spec.is_message:
        return [_coerce_scalar(spec, item, f"{where}[{i}]") for i, item in enumerate(value)]
    items = []
    for i, item in enumerate(value):
        element = Message._make(spec.type, f"{where}[{i}]")
        element.update(item.set_values() if isinstance(item, Message) else item)
        items.append(element.set_values())
    return items


class Config(Message, MutableMapping):
    """A `*_configs` block or strategy section: a validated dict that also has attributes.

    Unlike Paddle, whose getters return a detached copy, this is the live config: both
    `strategy.amp_configs["init_loss_scaling"] = 1024.0` and
    `strategy.hybrid_configs["mp_configs"].sync_param = False` change the strategy.
    Deleting a key returns it to its default.
    """

    def __getitem__(self, name: str) -> Any:
        return self._get(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.update({name: value})

    def __delitem__(self, name: str) -> None:
        self.reset(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._spec.names)

    def __len__(self) -> int:
        return len(self._spec.fields)

    def clear(self) -> None:
        self.clear_values()

    def __repr__(self) -> str:
        return repr(self.to_dict())
