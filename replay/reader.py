"""Reading event logs: every intact record of a run, in order, and every damage.

:func:`read_log` takes a ``.lolog`` file or a directory (all files of one run:
one prefix, ordered by file number) and yields :class:`Entry` items (a
decoded :class:`~offload_fsm.logformat.LogRecord` with its file and byte
offset) and :class:`LogDamage` items. Framing damage (short read, bad magic,
bad length, CRC mismatch) comes from :mod:`offload_fsm.framing`, which
resynchronises past it; payloads that frame correctly but do not decode are
reported as ``unknown_tag``, ``schema_too_new`` or ``undecodable`` and skipped.
A file whose first intact record is not a header is decoded with the current
schema and reported as ``missing_header``. Nothing is ever silently skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import attrs

from offload_fsm.errors import LogCorrupt, SchemaTooNew, UnknownTag
from offload_fsm.framing import HEADER_BYTES, Damage, scan_stream
from offload_fsm.logdecode import LogDecoder
from offload_fsm.logfiles import FILE_SUFFIX, file_sort_key, parse_file_name
from offload_fsm.logformat import Header, LogRecord


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
        raise UsageError(f"{path}: no {FILE_SUFFIX} files" + (f" with prefix {prefix!r}"
                                                                  if prefix else ""))
    if len(runs) > 1:
        raise UsageError(f"{path}: several runs ({', '.join(sorted(runs))}); pass --prefix")
    ((_, files),) = runs.items()
    return sorted(files, key=lambda file: file_sort_key(file.name))


def read_file(path: str | os.PathLike[str]) -> Iterator[Entry | LogDamage]:
    name = str(path)
    decoder = LogDecoder()
    decode = decoder.decode
    first = True
    with open(path, "rb") as stream:
        for item in scan_stream(stream):
            if isinstance(item, Damage):
                yield LogDamage(path=name, offset=item.offset, kind=item.kind.value,
                                length_bytes=item.length_bytes, detail=item.detail)
                continue
            try:
                record = decode(item.payload)
            except LogCorrupt as error:
                kind = ("unknown_tag" if isinstance(error, UnknownTag) else
                        "schema_too_new" if isinstance(error, SchemaTooNew) else "undecodable")
                yield LogDamage(path=name, offset=item.offset, kind=kind,
                                length_bytes=len(item.payload) + HEADER_BYTES, detail=str(error))
                if isinstance(error, SchemaTooNew):
                    return  # nothing after a too-new header can be trusted
                continue
            if first and type(record) is not Header:
                yield LogDamage(path=name, offset=item.offset, kind="missing_header",
                                length_bytes=0,
                                detail="the file does not start with a header record")
            first = False
            yield Entry(path=name, offset=item.offset, record=record)


def read_log(
    path: str | os.PathLike[str], prefix: str | None = None
) -> Iterator[Entry | LogDamage]:
    """Every entry and damage of the run at ``path``, in order."""
    for file in run_files(path, prefix):
        yield from read_file(file)
