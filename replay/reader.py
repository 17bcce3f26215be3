"""Reading event logs: every intact record of a run, in order, and every damage.

:func:`read_log` takes a ``.lolog`` file or a directory (all files of one run:
one prefix, ordered by file number) and yields :class:`Entry` items (a
decoded :class:`~offload_fsm.log.records.LogRecord` with its file and byte
offset) and :class:`LogDamage` items. Framing damage (short read, bad magic,
bad length, CRC mismatch) comes from :mod:`offload_fsm.log.framing`, which
resynchronises past it; payloads that frame correctly but do not decode are
reported as ``unknown_tag``, ``schema_too_new`` or ``undecodable`` and skipped.
A file whose first intact record is not a header is decoded with the current
schema and reported as ``missing_header``. Nothing is ever silently skipped.
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple

import attrs

from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.framing import HEADER_BYTES, Damage, Record, scan_stream
from offload_fsm.log.names import FILE_SUFFIX, file_sort_key, parse_file_name
from offload_fsm.log.peek import body_at, payload_kind
from offload_fsm.log.records import SNAPSHOT, Header, LogRecord
from offload_fsm.log.snapshot_pack import KeysOf, LazyState
from offload_fsm.vocabulary.errors import LogCorrupt, SchemaTooNew, UnknownTag


@attrs.frozen(kw_only=True)
class Entry:
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


class UsageError(Exception):
    """A path that is not a log (exit code 2)."""


def run_prefixes(path: str | os.PathLike[str]) -> list[str | None]:
    """The runs of ``path``: a directory's log prefixes, sorted (several
    engines, or several servers, may share one); ``[None]`` for a file or a
    directory of one run."""
    target = Path(path)
    if not target.is_dir():
        return [None]
    prefixes = {parsed[0] for child in target.iterdir()
                if (parsed := parse_file_name(child.name)) is not None and child.is_file()}
    if len(prefixes) < 2:
        return [None]
    return [*sorted(prefixes)]


def run_files(path: str | os.PathLike[str], prefix: str | None = None) -> list[Path]:
    """The files of one run: ``path`` itself, or the ``.lolog`` files of a
    directory ordered by file number (exactly one prefix unless given)."""
    target = Path(path)
    if target.is_file():
        return [target]
    if not target.is_dir():
        raise UsageError(f"{path}: no such file or directory")
    runs: dict[str, list[Path]] = {}
    for child in target.iterdir():
        parsed = parse_file_name(child.name)
        if parsed is not None and child.is_file():
            runs.setdefault(parsed[0], []).append(child)
    if prefix is not None:
        runs = {k: v for k, v in runs.items() if k == prefix}
    if not runs:
        inside = [] if prefix else _run_folders(target)
        raise UsageError(f"{path}: no {FILE_SUFFIX} files" + (
            f" with prefix {prefix!r}" if prefix else
            "; the run folders inside it: " + ", ".join(inside[:RUN_FOLDERS_SHOWN])
            + (f" and {len(inside) - RUN_FOLDERS_SHOWN} more" if len(inside) >
               RUN_FOLDERS_SHOWN else "") + " (pass one of them)" if inside else ""))
    if len(runs) > 1:
        raise UsageError(f"{path}: several runs ({', '.join(sorted(runs))}); pass --prefix")
    ((_, files),) = runs.items()
    return sorted(files, key=lambda file: file_sort_key(file.name))


RUN_FOLDERS_SHOWN = 8


def _run_folders(directory: Path) -> list[str]:
    """The folders directly inside ``directory`` that hold a log, newest name
    last (the demo and the connector name them by start time)."""
    folders = []
    for child in sorted(directory.iterdir()):
        with contextlib.suppress(OSError):
            if child.is_dir() and any(parse_file_name(f.name) is not None
                                      for f in child.iterdir()):
                folders.append(str(child))
    return folders


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
                yield LogDamage(path=name, offset=item.offset, kind=item.kind.value,
                                length_bytes=item.length_bytes, detail=item.detail)
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


# The stored keys the snapshots before an offset leave ((file, size, mtime,
# offset) -> the last snapshot's keys, decoded when first used): reading a
# file from a segment again (diff reads each side twice, explain and seek
# re-enter files) skips decoding every earlier snapshot, and reading it from
# a later segment (parallel verify's workers take a file's segments in order)
# decodes only the snapshots in between.
_KEYS_BEFORE: dict[tuple[str, int, int, int], KeysOf | None] = {}
_KEYS_BEFORE_MAX = 64


def _frames(stream: BinaryIO, start_offset: int, decoder: LogDecoder
            ) -> Iterator[Record | Damage]:
    """The file's frames; from ``start_offset`` after the first (the header).
    The snapshots between go to ``decoder`` unseen: a snapshot's stored keys
    may be a delta against the one before (``log.snapshot_pack``)."""
    if not start_offset:
        yield from scan_stream(stream)
        return
    stat = os.fstat(stream.fileno())
    file_id = (stream.name, stat.st_size, stat.st_mtime_ns)
    frames = scan_stream(stream)
    for item in frames:  # the header, and damage before it
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
        frames = scan_stream(stream)
    if base < start_offset:
        for item in frames:
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


def read_log(
    path: str | os.PathLike[str], prefix: str | None = None
) -> Iterator[Entry | LogDamage]:
    """Every entry and damage of the run at ``path``, in order."""
    for file in run_files(path, prefix):
        yield from read_file(file)


# --------------------------------------------------------------------------
# Peeking at payloads without decoding them (``replay diff``'s index).

class Chunk(NamedTuple):
    """An INPUTS record located, not decoded: events ``first_seq`` to
    ``end_seq - 1``, and ``key``, a CRC32 of its body after the envelope's
    wall clock, so equal keys mean equal events and checks. In a schema 4
    file the record is number ``number`` of the frame at ``offset`` (a batch),
    in the segment whose first frame is at ``segment``, and the key is
    chained over the segment's records from its first event: compact forms
    are equal bytes for equal events only after equal records."""

    path: str
    offset: int
    first_seq: int
    end_seq: int
    key: int
    number: int = 0
    segment: int = 0


def input_chunk(path: str, offset: int, payload: bytes, *, index: int = 0, segment: int = 0,
                chain: int | None = None) -> Chunk | None:
    """The :class:`Chunk` of an INPUTS payload (None if its envelope is odd);
    ``chain``: the key it continues (see :class:`Chunk`)."""
    head = body_at(payload)
    if head is None:
        return None
    items, seq, at = head
    key = zlib.crc32(memoryview(payload)[at:], 0 if chain is None else chain)
    # Positional: a diff builds one per INPUTS record of both logs.
    return Chunk(path, offset, seq, seq + (items - 3) // 2, key, index, segment)
