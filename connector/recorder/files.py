"""One run's log files in one directory: naming, opening, writing, syncing.

Contract: mechanism only, on the writer thread. Every call that does I/O
raises the ``OSError`` it met, and the writer (``connector.recorder.writer``)
decides what a failure means; :attr:`LogFiles.io_since` says since when the
call in progress has been running, so the caller's thread can see a hung
disk. Files are ``<directory>/<prefix>-<seqno:06d>.lolog``
(``offload_fsm.log.names``), created exclusively (an existing log is never
clobbered), the owner's alone, held against any writer's retention while
written (``connector.recorder.retention``); a writer that takes over a run
(a restarted recorder) goes on after the run's last file.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from connector.recorder.retention import Retention, discard, private, private_directory
from logfiles.runs import last_seqno
from offload_fsm.log.names import file_name

__all__ = ["LogFiles"]

_open = open  # the only way log files are opened (tests replace it to inject failures)


class LogFiles:
    """The files of run ``prefix`` in ``directory`` (made, 0700, if missing)."""

    def __init__(self, directory: Path, prefix: str, *, max_total_bytes: int | None,
                 buffer_bytes: int, warn: Callable[[str], None]) -> None:
        self.directory = directory
        self.prefix = prefix
        self._buffer_bytes = max(buffer_bytes, 8192)
        private_directory(directory, warn)
        self.retention = Retention(directory, max_total_bytes, warn)
        self._seqno = last_seqno(directory, prefix)
        self.file: BinaryIO | None = None
        self.paths: list[Path] = []  # every file opened, in order (deleted ones included)
        self.file_bytes = 0
        self.file_records = 0
        self.bytes_written = 0
        self.records_written = 0
        self.io_since = 0.0  # when the I/O call in progress began (0: none)

    def open_next(self, header: bytes) -> None:
        """Open the next file and write ``header`` (a framed record) first."""
        self._seqno += 1
        path = self.directory / file_name(self.prefix, self._seqno)
        self.file = _open(path, "xb", buffering=self._buffer_bytes, opener=private)
        self.retention.hold(self.file, path)
        self.paths.append(path)
        self.file_bytes = 0
        self.file_records = 0
        self.write(header)

    def write(self, record: bytes) -> None:
        """Append a framed record to the open file (buffered)."""
        f = self.file
        assert f is not None
        self.io_since = time.monotonic()
        try:
            f.write(record)
        finally:
            self.io_since = 0.0
        n = len(record)
        self.file_bytes += n
        self.bytes_written += n
        self.records_written += 1

    def flush(self) -> None:
        """Hand what is buffered to the OS."""
        if self.file is None:
            return
        self.io_since = time.monotonic()
        try:
            self.file.flush()
        finally:
            self.io_since = 0.0

    def sync_close(self) -> None:
        """Flush, fsync and close the open file (on a failure it stays open)."""
        f = self.file
        if f is None:
            return
        self.io_since = time.monotonic()
        try:
            f.flush()
            os.fsync(f.fileno())
        finally:
            self.io_since = 0.0
        self.file = None
        f.close()

    def drop(self) -> None:
        """Close the open file without flushing (after a failure: the
        descriptor is closed whatever flushing again would do)."""
        f, self.file = self.file, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()

    def probe(self, size_bytes: int) -> bool:
        """Whether the directory takes writes again: writes, syncs and
        deletes a ``size_bytes`` scratch file (a link planted in its place
        is removed, never followed)."""
        path = self.directory / f".{self.prefix}.probe"
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            with _open(path, "xb", opener=private) as f:
                f.write(b"\0" * size_bytes)
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                path.unlink()
        return True

    def open_resumed(self, records: Sequence[bytes]) -> Path:
        """Open the next file with ``records`` (framed: header first), synced;
        on any failure the file is deleted and the error raised."""
        seqno = self._seqno + 1
        path = self.directory / file_name(self.prefix, seqno)
        with contextlib.ExitStack() as cleanup:
            f = _open(path, "xb", buffering=self._buffer_bytes, opener=private)
            self.retention.hold(f, path)
            cleanup.callback(discard, f, path)
            for record in records:
                f.write(record)
            f.flush()
            os.fsync(f.fileno())
            cleanup.pop_all()
        size = sum(map(len, records))
        self._seqno = seqno
        self.file = f
        self.paths.append(path)
        self.file_bytes = size
        self.file_records = 1
        self.bytes_written += size
        self.records_written += len(records)
        return path

    def enforce_retention(self) -> None:
        """Keep the directory within its bound (``connector.recorder.retention``)."""
        current = self.paths[-1] if self.file is not None and self.paths else None
        self.retention.enforce(current, self.file_bytes)
