"""Looking at a payload's envelope without decoding it.

Pure module. A payload is a msgpack array ``[kind, seq, wall_ms, ...]``;
:func:`payload_kind` reads its kind and :func:`body_at` where the part after
the wall clock starts, each from the first bytes, so a scan over millions of
records (``replay diff``'s index, the writer's segment key) never builds
their objects. The *body* (every byte after the wall clock) is what two runs
of the same inputs write alike: equal bodies are equal events and checks.
"""

from __future__ import annotations

import zlib
from typing import Final

__all__ = ["body_at", "body_key", "payload_kind"]

_ARRAY_START: Final = {0xDC: 3, 0xDD: 5}  # array16, array32: bytes before the first item
_UINT_BYTES: Final = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xCA: 4, 0xCB: 8}


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
        first = payload[0]
        if 0x90 <= first <= 0x9F:
            items, at = first & 0x0F, 1
        elif first in _ARRAY_START:
            at = _ARRAY_START[first]
            items = int.from_bytes(payload[1:at], "big")
        else:
            return None
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
