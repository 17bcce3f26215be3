"""Looking at a payload's envelope without decoding it.

Pure module. A payload is a msgpack array ``[kind, seq, wall_ms, ...]``;
:func:`payload_kind` reads its kind, :func:`payload_seq` its seq,
:func:`snapshot_head` a snapshot's seq and digest, and :func:`body_at` where
the part after the wall clock starts, each from the first bytes, so a scan
over millions of records (``replay diff``'s index, ``replay.seek``'s
segments, the writer's segment key) never builds their objects. Each
returns None (kind: -1) for an envelope it cannot read: the caller counts
that record as damage or passes it by, never trusts it. The *body* (every
byte after the wall clock) is what two runs of the same inputs write alike:
equal bodies are equal events and checks.
"""

from __future__ import annotations

import zlib
from typing import Final

__all__ = ["body_at", "body_key", "payload_kind", "payload_seq", "snapshot_head"]

_ARRAY_START: Final = {0xDC: 3, 0xDD: 5}  # array16, array32: bytes before the first item
_UINT_BYTES: Final = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xCA: 4, 0xCB: 8}
_INT_BYTES: Final = {0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
                     0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True)}
_STR_BYTES: Final = {0xD9: 1, 0xDA: 2, 0xDB: 4}  # str8, str16, str32: bytes of the length


def payload_kind(payload: bytes) -> int:
    """The envelope kind of a payload (-1 if odd)."""
    if not payload:
        return -1
    first = payload[0]
    at = 1 if 0x90 <= first <= 0x9F else _ARRAY_START.get(first, -1)
    if at < 0 or at >= len(payload):
        return -1
    return payload[at] if payload[at] < 0x80 else -1


def _uint(payload: bytes, at: int) -> tuple[int, int]:
    """A msgpack unsigned int (or a float, value 0) at ``at``: (value, next)."""
    first = payload[at]
    if first < 0x80:
        return first, at + 1
    size = _UINT_BYTES[first]
    if first in (0xCA, 0xCB):
        return 0, at + 1 + size
    return int.from_bytes(payload[at + 1 : at + 1 + size], "big"), at + 1 + size


def body_at(payload: bytes) -> tuple[int, int, int] | None:
    """``(items, seq, at)``: the envelope's item count, its seq, and where
    its body starts; None if the envelope is odd."""
    try:
        head = _items_at(payload)
        if head is None:
            return None
        items, at = head
        seq, at = _uint(payload, at + 1)  # after the kind
        _, at = _uint(payload, at)  # the wall clock: not part of the body
    except (IndexError, KeyError):
        return None
    return items, seq, at


def body_key(payload: bytes, chain: int = 0) -> int | None:
    """CRC-32 of the payload's body, continuing ``chain``; None if odd."""
    head = body_at(payload)
    if head is None:
        return None
    return zlib.crc32(memoryview(payload)[head[2]:], chain)


def _items_at(payload: bytes) -> tuple[int, int] | None:
    """The envelope's item count and where its first item (the kind) starts."""
    first = payload[0]
    if 0x90 <= first <= 0x9F:
        return first & 0x0F, 1
    if first in _ARRAY_START:
        at = _ARRAY_START[first]
        return int.from_bytes(payload[1:at], "big"), at
    return None


def _int(payload: bytes, at: int) -> tuple[int, int] | None:
    """A msgpack integer at ``at``: (value, next); None for any other type."""
    first = payload[at]
    if first < 0x80 or first >= 0xE0:
        return (first if first < 0x80 else first - 0x100), at + 1
    if first not in _INT_BYTES:
        return None
    size, signed = _INT_BYTES[first]
    raw = payload[at + 1 : at + 1 + size]
    if len(raw) < size:
        return None
    return int.from_bytes(raw, "big", signed=signed), at + 1 + size


def _seq(payload: bytes) -> tuple[int, int] | None:
    """The envelope's seq (which must be an integer), and where the wall clock starts."""
    head = _items_at(payload)
    if head is None or head[0] < 2 or payload[head[1]] >= 0x80:  # no fixint kind
        return None
    return _int(payload, head[1] + 1)


def payload_seq(payload: bytes) -> int | None:
    """The envelope's seq (the second item), or None if it is odd."""
    try:
        found = _seq(payload)
    except IndexError:
        return None
    return None if found is None else found[0]


def snapshot_head(payload: bytes) -> tuple[int, str] | None:
    """A SNAPSHOT's ``(seq, digest)``: its envelope's seq and its first body
    item, the digest of the state before ``seq`` (``""`` if that is not a
    string); None if the seq is odd."""
    try:
        found = _seq(payload)
    except IndexError:
        return None
    if found is None:
        return None
    seq, at = found
    try:
        _, at = _uint(payload, at)  # the wall clock
        first = payload[at]
        if 0xA0 <= first <= 0xBF:
            length, at = first & 0x1F, at + 1
        elif first in _STR_BYTES:
            size = _STR_BYTES[first]
            length, at = int.from_bytes(payload[at + 1 : at + 1 + size], "big"), at + 1 + size
        else:
            return seq, ""
        text = payload[at : at + length]
        return seq, (text.decode() if len(text) == length else "")
    except (IndexError, KeyError, UnicodeDecodeError):
        return seq, ""
