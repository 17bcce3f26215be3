"""Fast wire conversion and outcome checks for the event log.

Pure module: standard library, ``attrs`` and ``msgpack`` only. :func:`wire`
gives ``codec.to_wire(message)`` without ``attrs.astuple``; :func:`outcome_check`
is the one-to-five-byte check an INPUTS record keeps per event (see
``logformat``); the msgpack packer is per thread.
"""

from __future__ import annotations

import operator
import threading
import zlib
from collections.abc import Callable
from typing import Any, Final

import msgpack

from offload_fsm.codec import _ENUM_FIELDS, _FIELD_NAMES, _TYPES, Message
from offload_fsm.machine import Outcome

__all__ = ["OutcomeWire", "outcome_check", "outcome_wire", "wire", "wire_check"]

OutcomeWire = tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]]



def _make_wire(cls: type[Any]) -> Callable[[Any], tuple[Any, ...]]:
    tag = cls.TAG
    names = _FIELD_NAMES[tag]
    enum_at = tuple(index for index, _ in _ENUM_FIELDS[tag])
    if not names:
        empty = (tag,)
        return lambda message: empty
    get = operator.attrgetter(*names)
    if len(names) == 1:
        if enum_at:
            return lambda message: (tag, getattr(message, names[0]).value)
        return lambda message: (tag, get(message))
    if enum_at:
        def convert(message: Any) -> tuple[Any, ...]:
            values = list(get(message))
            for index in enum_at:
                values[index] = values[index].value
            return (tag, *values)
        return convert
    return lambda message: (tag, *get(message))


_WIRE: dict[type[Any], Callable[[Any], tuple[Any, ...]]] = {
    cls: _make_wire(cls) for cls in _TYPES.values()
}


def wire(message: Message) -> tuple[Any, ...]:
    """``codec.to_wire(message)``, faster."""
    return _WIRE[type(message)](message)


def outcome_wire(outcome: Outcome) -> OutcomeWire:
    table = _WIRE
    return (
        tuple(table[type(d)](d) for d in outcome.decisions),
        tuple(table[type(c)](c) for c in outcome.commands),
    )


_local: Final = threading.local()  # msgpack.Packer is not thread-safe
_crc32: Final = zlib.crc32


def _packb(obj: Any) -> bytes:
    try:
        pack = _local.pack
    except AttributeError:
        pack = _local.pack = msgpack.Packer(use_bin_type=True).pack
    return pack(obj)  # type: ignore[no-any-return]


def _pack_array_header(items: int) -> bytes:
    """What :func:`_packb` writes before the items of an ``items``-long tuple,
    so a tuple's items packed one by one after it are the tuple's bytes."""
    try:
        header = _local.header
    except AttributeError:
        header = _local.header = msgpack.Packer(use_bin_type=True).pack_array_header
    return header(items)  # type: ignore[no-any-return]


def outcome_check(outcome: Outcome) -> int:
    """0 for an empty outcome, else a non-zero CRC32 of its packed wire form."""
    if not outcome.decisions and not outcome.commands:
        return 0
    return _crc32(_packb(outcome_wire(outcome))) or 1


def wire_check(value: OutcomeWire) -> int:
    """:func:`outcome_check` of an outcome given in wire form."""
    if not value[0] and not value[1]:
        return 0
    return _crc32(_packb(value)) or 1


