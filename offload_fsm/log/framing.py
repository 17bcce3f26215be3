"""Record framing and validating reader for the offload event log.

Pure module: standard library and ``attrs`` only; no clock, no I/O of its own,
no logging.  It frames payload bytes given by the caller and parses bytes or a
binary stream handed in by the caller; it never opens paths.

Record format (all integers little-endian)::

    offset  size  field
    0       4     MAGIC            b"LOF1"
    4       4     payload length   uint32, 0 <= length <= MAX_PAYLOAD_BYTES
    8       4     CRC32            zlib.crc32(payload) & 0xFFFFFFFF
    12      n     payload          opaque bytes (a ``log.records`` payload)

A log is a plain concatenation of records; there is no file header at the
framing level (the connector writes a *header payload* as the first record
of every file, see ``connector.recorder.writer``).

Reader contract (:func:`scan`, :func:`scan_stream`):

* Yields :class:`Record` for every record whose magic, length and CRC
  validate, in file order, with its absolute byte offset.
* Anything else is reported as exactly one :class:`Damage` per contiguous
  skipped span, then the reader *resynchronises*: it searches forward, byte by
  byte from just after the start of the bad span, for the next position where
  MAGIC is followed by a length <= MAX_PAYLOAD_BYTES, a payload fully present,
  and a matching CRC, and continues from there.  Hence every intact record
  after arbitrary corruption is recovered.  The one unavoidable exception:
  bytes of a *damaged* record may themselves form a frame that validates
  (a payload embedding a complete frame, or a deletion that leaves a header
  followed by bytes equal to its old payload); such a frame is reported as a
  Record and may shadow intact records it overlaps.  Random corruption
  reaches this only through a 4-byte magic *and* a 32-bit CRC match.  The
  damage kind is the failure observed at the start of the span.
* A truncated last record (torn tail, e.g. after a crash) is reported as one
  ``SHORT_HEADER`` / ``SHORT_PAYLOAD`` damage that runs to the end of the data,
  and the scan stops.  A cut exactly on a record boundary yields no damage.
* ``scan_stream`` yields exactly the same items as ``scan`` over the whole
  stream content, for any chunk size, holding at most one chunk plus one
  maximal record in memory.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Generator, Iterator
from typing import BinaryIO, Final

import attrs

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "MAX_PAYLOAD_BYTES",
    "Damage",
    "DamageKind",
    "Record",
    "frame",
    "scan",
    "scan_stream",
]

MAGIC: Final[bytes] = b"LOF1"
HEADER_BYTES: Final[int] = 12
MAX_PAYLOAD_BYTES: Final[int] = 16 * 1024 * 1024

_HEADER: Final = struct.Struct("<III")
_HEADER_PACK: Final = struct.Struct("<4sII").pack
_MAGIC_INT: Final[int] = int.from_bytes(MAGIC, "little")


@attrs.frozen(slots=True)
class Record:
    """One valid record: absolute offset of its header, and its payload."""

    offset: int
    payload: bytes


# Fast construction for the hot path of the reader.  Record has no validators,
# converters or defaults, so filling its two slots directly yields an object
# indistinguishable from ``Record(offset, payload)``.
_new_record: Final = object.__new__
_set_record_offset: Final = Record.__dict__["offset"].__set__
_set_record_payload: Final = Record.__dict__["payload"].__set__


class DamageKind(enum.Enum):
    SHORT_HEADER = "short_header"  # torn tail: fewer than HEADER_BYTES left
    SHORT_PAYLOAD = "short_payload"  # torn tail: payload runs past the end
    BAD_MAGIC = "bad_magic"
    BAD_LENGTH = "bad_length"
    CRC_MISMATCH = "crc_mismatch"


@attrs.frozen(slots=True)
class Damage:
    """A skipped span ``[offset, offset + length_bytes)`` of the input."""

    offset: int
    kind: DamageKind
    length_bytes: int
    detail: str

    @property
    def is_torn_tail(self) -> bool:
        return self.kind in (DamageKind.SHORT_HEADER, DamageKind.SHORT_PAYLOAD)


def frame(payload: bytes) -> bytes:
    """Return the framed record for ``payload``.

    Raises ValueError if the payload exceeds MAX_PAYLOAD_BYTES.
    """
    n = len(payload)
    if n > MAX_PAYLOAD_BYTES:
        raise ValueError(f"payload of {n} bytes exceeds MAX_PAYLOAD_BYTES={MAX_PAYLOAD_BYTES}")
    return _HEADER_PACK(MAGIC, n, zlib.crc32(payload)) + payload


# --------------------------------------------------------------------------- core

# Pending damage carried across stream chunks: (absolute start, kind, detail).
_Pending = tuple[int, DamageKind, str]
# What the core returns when it stops: (index in buf to keep from, pending damage).
_Stop = tuple[int, _Pending | None]


RESYNC_SLACK_BYTES: Final[int] = 4 * MAX_PAYLOAD_BYTES
"""Resynchronising checks a CRC at each candidate magic over the length its
header claims; over a whole scan those checks may cover the data's size plus
this, so a file crafted with many magics claiming 16 MiB each costs O(size),
not O(size x 16 MiB). A candidate past the budget is taken as damage."""


def _find_valid(buf: bytes, start: int, final: bool, budget: list[int]) -> tuple[int, bool]:
    """Search ``buf`` from ``start`` (inclusive) for the next valid record,
    spending at most ``budget[0]`` bytes of CRC work (what it spends is taken
    off).

    Returns ``(q, True)`` when a valid record starts at ``q``.
    Returns ``(q, False)`` when the search cannot continue without more data:
    everything before ``q`` is known not to start a valid record (with
    ``final`` this means none exists and ``q == len(buf)``).
    """
    n = len(buf)
    find = buf.find
    unpack_from = _HEADER.unpack_from
    crc32 = zlib.crc32
    q = start
    while True:
        q = find(MAGIC, q)
        if q < 0:
            # A magic may straddle the end of a non-final buffer.
            return (n, False) if final else (max(start, n - (len(MAGIC) - 1)), False)
        if n - q < HEADER_BYTES:
            # No complete header fits any more; with final data nothing follows.
            return (n, False) if final else (q, False)
        _, length, crc = unpack_from(buf, q)
        if length <= MAX_PAYLOAD_BYTES:
            end = q + HEADER_BYTES + length
            if end > n:
                if not final:
                    return q, False
            elif length <= budget[0]:
                budget[0] -= length
                if crc32(buf[q + HEADER_BYTES : end]) == crc:
                    return q, True
        q += 1


def _scan_core(
    buf: bytes, base: int, final: bool, pending: _Pending | None, budget: list[int]
) -> Generator[Record | Damage, None, _Stop]:
    """Scan ``buf`` (whose first byte is at absolute offset ``base``).

    With ``final=False`` the core stops (returning where to resume and any
    damage still open) wherever a decision needs bytes beyond ``buf``.
    """
    n = len(buf)
    pos = 0
    search_from = 0
    while True:
        if pending is None:
            pos = yield from _valid_run(buf, base, pos)
            if pos == n:
                return pos, None
            failure = _classify(buf, base, pos, final)
            if failure is None:
                return pos, None  # the record may be complete with more data
            if isinstance(failure, Damage):
                yield failure  # a torn header at the very end
                return n, None
            pending = failure
            search_from = pos + 1
        # ---- resynchronise
        q, ok = _find_valid(buf, search_from, final, budget)
        if ok:
            yield _resynced(pending, base + q)
            pending = None
            pos = q
            continue
        if not final:
            return q, pending
        start, kind, detail = pending
        yield Damage(start, kind, base + n - start, detail)
        return n, None


def _valid_run(buf: bytes, base: int, pos: int) -> Generator[Record, None, int]:
    """Yield the valid records back to back from ``pos``; return where they stop."""
    n = len(buf)
    unpack_from = _HEADER.unpack_from
    crc32 = zlib.crc32
    magic_int = _MAGIC_INT
    max_len = MAX_PAYLOAD_BYTES
    hdr = HEADER_BYTES
    new_record = _new_record
    set_offset = _set_record_offset
    set_payload = _set_record_payload
    while pos + hdr <= n:
        magic, length, crc = unpack_from(buf, pos)
        if magic != magic_int or length > max_len or (end := pos + hdr + length) > n:
            break
        payload = buf[pos + hdr : end]
        if crc32(payload) != crc:
            break
        # Equivalent to Record(base + pos, payload), minus the attrs
        # __init__ frame (a Python call per record, on the scan's hot path).
        rec = new_record(Record)
        set_offset(rec, base + pos)
        set_payload(rec, payload)
        yield rec
        pos = end
    return pos


def _classify(buf: bytes, base: int, pos: int, final: bool) -> _Pending | Damage | None:
    """The failure at ``pos``, where no valid record starts: the damage that
    opens there, a torn header ending the data (final), or None when the
    record at ``pos`` may still complete with more data (not final)."""
    rem = len(buf) - pos
    at = base + pos
    if rem < HEADER_BYTES:
        if not final:
            return None
        if buf[pos : pos + 4] != MAGIC[:rem]:
            return at, DamageKind.BAD_MAGIC, f"bad magic {buf[pos : pos + 4]!r}"
        return Damage(at, DamageKind.SHORT_HEADER, rem,
                      f"torn tail: {rem} of {HEADER_BYTES} header bytes")
    magic, length, crc = _HEADER.unpack_from(buf, pos)
    if magic != _MAGIC_INT:
        return at, DamageKind.BAD_MAGIC, f"bad magic {buf[pos : pos + 4]!r}"
    if length > MAX_PAYLOAD_BYTES:
        return at, DamageKind.BAD_LENGTH, f"length {length} exceeds MAX_PAYLOAD_BYTES"
    if length > rem - HEADER_BYTES:
        if not final:
            return None
        return (at, DamageKind.SHORT_PAYLOAD,
                f"torn tail: payload needs {length} bytes, {rem - HEADER_BYTES} present")
    computed = zlib.crc32(buf[pos + HEADER_BYTES : pos + HEADER_BYTES + length])
    return (at, DamageKind.CRC_MISMATCH,
            f"crc mismatch (stored {crc:#010x}, computed {computed:#010x})")


def _resynced(pending: _Pending, end: int) -> Damage:
    """The open damage, closed where a valid record starts (absolute ``end``)."""
    start, kind, detail = pending
    if kind is DamageKind.SHORT_PAYLOAD:
        # A valid record follows, so this was no torn tail.
        kind = DamageKind.BAD_LENGTH
        detail = "length runs past the next valid record; " + detail
    return Damage(start, kind, end - start, detail)


def scan(
    data: bytes | bytearray | memoryview, *, start_offset: int = 0
) -> Iterator[Record | Damage]:
    """Yield the records and damaged spans of ``data`` in order.

    ``start_offset`` is added to every reported offset (use it when ``data``
    is a slice of a larger log).  ``bytearray``/``memoryview`` inputs are
    copied once to ``bytes`` so that payloads are plain immutable bytes.
    """
    buf = data if isinstance(data, bytes) else bytes(data)
    return _scan_core(buf, start_offset, True, None, [len(buf) + RESYNC_SLACK_BYTES])


def scan_stream(stream: BinaryIO, *, chunk_bytes: int = 1 << 20) -> Iterator[Record | Damage]:
    """Like :func:`scan` over everything ``stream.read`` returns until EOF.

    Offsets are absolute from the stream's current position at the call (the
    stream start for a freshly opened file).  Reads ``chunk_bytes`` at a time.
    """
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    tail = b""
    base = 0
    pending: _Pending | None = None
    budget = [RESYNC_SLACK_BYTES]
    while True:
        chunk = stream.read(chunk_bytes)
        if not chunk:
            yield from _scan_core(tail, base, True, pending, budget)
            return
        budget[0] += len(chunk)
        buf = tail + chunk if tail else bytes(chunk)
        keep, pending = yield from _scan_core(buf, base, False, pending, budget)
        tail = buf[keep:]
        base += keep
