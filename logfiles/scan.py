"""Scanning a log file: every intact record, in order, and every damage.

Contract: the one loop over a log file's frames. :func:`frames` yields the
file's framed payloads (:class:`~offload_fsm.log.framing.Record`) and its
framing damage as :class:`LogDamage`, for callers that only peek at
envelopes (``replay.seek``'s segments, ``replay diff``'s index);
:func:`read_file` decodes them into :class:`Entry` items (a decoded
:class:`~offload_fsm.log.records.LogRecord` with its file and byte offset),
from the file's start or from a segment's first record; :func:`read_log`
reads every file of a run (``logfiles.runs``) in order.

Theory of operation. Framing damage (short read, bad magic, bad length, CRC
mismatch) comes from :mod:`offload_fsm.log.framing`, which resynchronises
past it; payloads that frame correctly but do not decode are reported as
``unknown_tag``, ``schema_too_new`` or ``undecodable`` and skipped (after a
too-new header nothing more of the file is read: nothing after it can be
trusted). A file whose first intact record is not a header is decoded with
the current schema and reported as ``missing_header``. Nothing is ever
silently skipped. After any damage the decoder is told records were lost,
so compact forms that lean on them raise instead of decoding wrongly.

Reading from a segment: a snapshot's stored keys may be a delta against the
snapshot before (``log.snapshot_pack``), so the snapshots between the header
and the segment are decoded unseen first; the keys they leave at an offset
are kept (:data:`_KEYS_BEFORE`, at most :data:`_KEYS_BEFORE_MAX` entries),
so reading a file from a segment again skips that work.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import BinaryIO, Final

import attrs

from logfiles.runs import run_files
from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.framing import HEADER_BYTES, Damage, Record, scan_stream
from offload_fsm.log.peek import payload_kind
from offload_fsm.log.records import SNAPSHOT, Header, LogRecord
from offload_fsm.log.snapshot_pack import KeysOf, LazyState
from offload_fsm.vocabulary.errors import LogCorrupt, SchemaTooNew, UnknownTag

__all__ = ["Entry", "LogDamage", "frames", "read_file", "read_log"]


@attrs.frozen(kw_only=True)
class Entry:
    """A decoded record, and the file and byte offset of the frame holding it."""

    path: str
    offset: int
    record: LogRecord


@attrs.frozen(kw_only=True)
class LogDamage:
    """A skipped span. ``kind``: a framing ``DamageKind`` value, or
    ``unknown_tag``, ``schema_too_new``, ``undecodable``, ``missing_header``."""

    path: str
    offset: int
    kind: str
    length_bytes: int
    detail: str

    @property
    def is_torn_tail(self) -> bool:
        return self.kind in ("short_header", "short_payload")

    def describe(self) -> str:
        return (f"{self.path}@{self.offset}: {self.kind} ({self.length_bytes} bytes): "
                f"{self.detail}")


def _damage(path: str, damage: Damage) -> LogDamage:
    return LogDamage(path=path, offset=damage.offset, kind=damage.kind.value,
                     length_bytes=damage.length_bytes, detail=damage.detail)


def frames(path: str | os.PathLike[str]) -> Iterator[Record | LogDamage]:
    """The file's framed payloads and framing damage, in file order."""
    name = str(path)
    with open(path, "rb") as stream:
        for item in scan_stream(stream):
            yield _damage(name, item) if isinstance(item, Damage) else item


def read_file(path: str | os.PathLike[str], *, start_offset: int = 0
              ) -> Iterator[Entry | LogDamage]:
    """The entries and damage of one file. With ``start_offset`` (a segment's
    first record: a snapshot) the header is read first, then the records from
    that offset on (the header's entry is yielded too)."""
    name = str(path)
    decoder = LogDecoder()
    decode_all = decoder.decode_all
    first = True
    with open(path, "rb") as stream:
        for item in _frames(stream, start_offset, decoder):
            if isinstance(item, Damage):
                decoder.lose()
                yield _damage(name, item)
                continue
            try:
                records = decode_all(item.payload)
            except LogCorrupt as error:
                decoder.lose()
                kind = ("unknown_tag" if isinstance(error, UnknownTag) else
                        "schema_too_new" if isinstance(error, SchemaTooNew) else "undecodable")
                yield LogDamage(path=name, offset=item.offset, kind=kind,
                                length_bytes=len(item.payload) + HEADER_BYTES, detail=str(error))
                if isinstance(error, SchemaTooNew):
                    return  # nothing after a too-new header can be trusted
                continue
            if first and type(records[0]) is not Header:
                yield LogDamage(path=name, offset=item.offset, kind="missing_header",
                                length_bytes=0,
                                detail="the file does not start with a header record")
            first = False
            for record in records:
                yield Entry(path=name, offset=item.offset, record=record)


def read_log(path: str | os.PathLike[str], prefix: str | None = None
             ) -> Iterator[Entry | LogDamage]:
    """Every entry and damage of the run at ``path`` (``runs.run_files``), in order."""
    for file in run_files(path, prefix):
        yield from read_file(file)


# (file, size, mtime, offset) -> the stored keys the snapshots before the
# offset leave, decoded when first used: diff reads each side twice, explain
# and seek re-enter files, and parallel verify's workers take a file's
# segments in order, so each decodes only the snapshots in between.
_KEYS_BEFORE: dict[tuple[str, int, int, int], KeysOf | None] = {}
_KEYS_BEFORE_MAX: Final = 64


def _frames(stream: BinaryIO, start_offset: int, decoder: LogDecoder
            ) -> Iterator[Record | Damage]:
    """The file's frames; from ``start_offset`` after the first (the header).
    The snapshots between go to ``decoder`` unseen (see the module docstring)."""
    if not start_offset:
        yield from scan_stream(stream)
        return
    stat = os.fstat(stream.fileno())
    file_id = (stream.name, stat.st_size, stat.st_mtime_ns)
    scanned = scan_stream(stream)
    for item in scanned:  # the header, and damage before it
        yield item
        if isinstance(item, Record):
            break
    cached = [at for (*same, at) in _KEYS_BEFORE if tuple(same) == file_id
              and at <= start_offset]
    base = 0
    if cached:
        base = max(cached)
        decoder.keys = _KEYS_BEFORE[(*file_id, base)]
        stream.seek(base)
        scanned = scan_stream(stream)
    if base < start_offset:
        for item in scanned:
            if isinstance(item, Record) and item.offset + base >= start_offset:
                break
            if isinstance(item, Record) and payload_kind(item.payload) == SNAPSHOT:
                with contextlib.suppress(LogCorrupt):
                    decoder.decode(item.payload)
        if len(_KEYS_BEFORE) >= _KEYS_BEFORE_MAX:
            _KEYS_BEFORE.pop(next(iter(_KEYS_BEFORE)))
        keys = decoder.keys
        _KEYS_BEFORE[(*file_id, start_offset)] = decoder.keys = (
            KeysOf(keys) if isinstance(keys, LazyState) else keys)
    stream.seek(start_offset)
    for item in scan_stream(stream):
        if isinstance(item, Record):
            yield Record(item.offset + start_offset, item.payload)
        else:
            yield Damage(item.offset + start_offset, item.kind, item.length_bytes, item.detail)
