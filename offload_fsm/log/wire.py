"""Events, decisions and commands as wire tuples, and the msgpack packer.

A message travels as ``(TAG, field1, field2, ...)`` in attrs field order: no
field names on the wire, which keeps a typical event to a few dozen bytes.
Tuples travel as arrays and decode back to tuples (``use_list=False``); enums
travel as their string values. Tags are unique across events (1-99),
decisions (100-199) and commands (200-299) and are never renumbered; a changed
field list needs a new schema version and an upcaster (``records``).

Primitives:
  to_wire(message)        the wire tuple (one prebuilt converter per class)
  from_wire(item)         the message back; :class:`LogCorrupt` or
                          :class:`UnknownTag` on bad input
  outcome_wire(outcome)   an outcome's decisions and commands as wire tuples
  inputs_items(applied)   events and their recorded outcomes, as an INPUTS record holds them
  outcome_check(outcome)  the one-to-five-byte check an INPUTS record keeps
                          per event: 0 for an empty outcome, else a CRC32
                          (never 0) of its packed wire form
  packb / unpackb         msgpack with this log's options; the packer is per
                          thread (``msgpack.Packer`` is not thread-safe)
"""

from __future__ import annotations

import enum
import operator
import threading
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs
import msgpack

from offload_fsm.vocabulary.commands import COMMAND_TYPES, Command
from offload_fsm.vocabulary.decisions import DECISION_TYPES, Decision
from offload_fsm.vocabulary.errors import LogCorrupt, UnknownTag
from offload_fsm.vocabulary.events import EVENT_TYPES, Event
from offload_fsm.vocabulary.outcome import Outcome

__all__ = [
    "ENUM_FIELDS",
    "FIELD_NAMES",
    "TO_WIRE",
    "Message",
    "OutcomeWire",
    "from_wire",
    "inputs_items",
    "outcome_check",
    "outcome_wire",
    "pack_array_header",
    "packb",
    "recorded_form",
    "to_wire",
    "unpackb",
    "wire_check",
]

Message = Event | Decision | Command
OutcomeWire = tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]]

_TYPES: Final[dict[int, type[Any]]] = {}
for _cls in (*EVENT_TYPES, *DECISION_TYPES, *COMMAND_TYPES):
    assert _cls.TAG not in _TYPES, f"duplicate wire tag {_cls.TAG}"
    _TYPES[_cls.TAG] = _cls


def _enum_fields(cls: type[Any]) -> tuple[tuple[int, type[enum.Enum]], ...]:
    # Field types are strings under ``from __future__ import annotations``.
    fields = attrs.fields(attrs.resolve_types(cls))
    return tuple(
        (index, field.type)
        for index, field in enumerate(fields)
        if isinstance(field.type, type) and issubclass(field.type, enum.Enum)
    )


ENUM_FIELDS: Final[dict[int, tuple[tuple[int, type[enum.Enum]], ...]]] = {
    tag: _enum_fields(cls) for tag, cls in _TYPES.items()
}
FIELD_NAMES: Final[dict[int, tuple[str, ...]]] = {
    tag: tuple(f.name for f in attrs.fields(cls)) for tag, cls in _TYPES.items()
}


def _converter(cls: type[Any]) -> Callable[[Any], tuple[Any, ...]]:
    """``cls``'s message -> wire tuple, by one ``attrgetter`` (no ``astuple``)."""
    tag = cls.TAG
    names = FIELD_NAMES[tag]
    enum_at = tuple(index for index, _ in ENUM_FIELDS[tag])
    if not names:
        empty = (tag,)
        return lambda message: empty
    get = operator.attrgetter(*names)
    if len(names) == 1:
        if enum_at:  # ``_value_``: the member's own slot (``.value`` is a slow property)
            return lambda message: (tag, getattr(message, names[0])._value_)
        return lambda message: (tag, get(message))
    if enum_at:
        def convert(message: Any) -> tuple[Any, ...]:
            values = list(get(message))
            for index in enum_at:
                values[index] = values[index]._value_
            return (tag, *values)
        return convert
    return lambda message: (tag, *get(message))


TO_WIRE: Final[dict[type[Any], Callable[[Any], tuple[Any, ...]]]] = {
    cls: _converter(cls) for cls in _TYPES.values()
}
"""Each message class's converter, for loops that look it up themselves."""


def to_wire(message: Message) -> tuple[Any, ...]:
    """``(TAG, *fields)`` with enums as their values."""
    return TO_WIRE[type(message)](message)


def from_wire(item: tuple[Any, ...] | list[Any]) -> Message:
    """Inverse of :func:`to_wire`; raises :class:`UnknownTag` or
    :class:`LogCorrupt` on bad input."""
    if not item:
        raise LogCorrupt("empty message")
    tag = item[0]
    cls = _TYPES.get(tag)
    if cls is None:
        raise UnknownTag(tag)
    values = list(item[1:])
    names = FIELD_NAMES[tag]
    if len(values) != len(names):
        raise LogCorrupt(
            f"tag {tag} ({cls.__name__}) has {len(values)} fields, expected {len(names)}"
        )
    for index, enum_type in ENUM_FIELDS[tag]:
        try:
            values[index] = enum_type(values[index])
        except ValueError:
            raise LogCorrupt(f"tag {tag}: bad {names[index]} value {values[index]!r}") from None
    try:
        return cls(**dict(zip(names, values, strict=True)))  # type: ignore[no-any-return]
    except TypeError as error:
        raise LogCorrupt(f"tag {tag}: {error}") from None


def outcome_wire(outcome: Outcome) -> OutcomeWire:
    table = TO_WIRE
    return (
        tuple(table[type(d)](d) for d in outcome.decisions),
        tuple(table[type(c)](c) for c in outcome.commands),
    )


_local: Final = threading.local()
_crc32: Final = zlib.crc32


def packb(obj: Any) -> bytes:
    try:
        pack = _local.pack
    except AttributeError:
        pack = _local.pack = msgpack.Packer(use_bin_type=True).pack
    return pack(obj)  # type: ignore[no-any-return]


def pack_array_header(items: int) -> bytes:
    """What :func:`packb` writes before the items of an ``items``-long tuple,
    so a tuple's items packed one by one after it are the tuple's bytes."""
    try:
        header = _local.header
    except AttributeError:
        header = _local.header = msgpack.Packer(use_bin_type=True).pack_array_header
    return header(items)  # type: ignore[no-any-return]


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=False)


def outcome_check(outcome: Outcome) -> int:
    """0 for an empty outcome, else a non-zero CRC32 of its packed wire form."""
    if not outcome.decisions and not outcome.commands:
        return 0
    return _crc32(packb(outcome_wire(outcome))) or 1


def recorded_form(outcome: Outcome | OutcomeWire | int, full: bool) -> OutcomeWire | int:
    """What an INPUTS record keeps of an outcome: its wire form (``full``) or
    its check. An outcome already in that form (the engine's hand-off sends
    it so) is kept as it is."""
    if type(outcome) is Outcome:
        return outcome_wire(outcome) if full else outcome_check(outcome)
    return outcome  # type: ignore[return-value]


def wire_check(value: OutcomeWire) -> int:
    """:func:`outcome_check` of an outcome given in wire form."""
    if not value[0] and not value[1]:
        return 0
    return _crc32(packb(value)) or 1


def inputs_items(applied: Iterable[tuple[Event, Outcome]], full_outcomes: bool) -> list[Any]:
    """``applied`` as an INPUTS record holds it: ``[ev_1, check_1, ev_2, ...]``
    (the engine's hand-off sends each record call so)."""
    table = TO_WIRE
    items: list[Any] = []
    append = items.append
    for event, outcome in applied:
        append(table[type(event)](event))
        append(recorded_form(outcome, full_outcomes))
    return items
