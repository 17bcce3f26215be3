"""The recorder's writer: framed records into rotating files, on a thread of its own.

This module is the producer's half (the queue, rotation requests, close,
counters); the thread's half is ``connector.recorder.writer_thread``.

A writer appends framed records (``offload_fsm.log.framing``) to the files
of its run (``connector.recorder.files``; the default prefix is ``<UTC
timestamp>-<pid>``), each starting with its header (``Encoder.header``,
``connector.recorder.writer_thread``).
A file past ``max_file_bytes`` asks the producer for a rotation
(:attr:`EventLogWriter.rotation_due`; with ``auto_rotate`` it rotates by
itself), so the next file can start with the producer's snapshot.

Contract towards the caller (the recorder process's main thread)
----------------------------------------------------------------
* :meth:`EventLogWriter.append` never blocks, never drops and never does
  I/O: it puts the opaque item on an in-memory queue. Encoding, framing and
  writing happen on a daemon background thread. The queue's bound is its
  caller's: the recorder process takes nothing more from the engine while
  :attr:`EventLogWriter.busy` (half of ``queue_max_bytes``, each item
  weighing what :meth:`Encoder.weight` says), so what waits stays within the
  engine's hand-off budget, the one place that drops and counts events
  (``connector.handoff``). This writer loses events only to its disk (an
  I/O error, a stall: below), and the log says so with a GAP. An item that
  fails to encode is counted in ``items_lost``, warned about once, and
  replaced by a GAP of its events.
* The thread takes what was appended every ``idle_poll_s`` (an append
  wakes nothing: the recorder's engine hands over a frame every 100 ms, and
  on a CPU engine every wake-up takes a core from the model's threads).
  Writes are buffered and flushed to the OS every ``flush_interval_s`` or
  ``flush_bytes``; files are fsynced on rotation and on :meth:`close`.
  ``close`` is idempotent and registered with :mod:`atexit`, so a normal
  interpreter exit drains the queue and flushes.  A crash loses at most the
  queued/unflushed tail and leaves at most a torn last record, which
  :func:`offload_fsm.log.framing.scan` reports as damage and skips.
* Consecutive items the encoder calls batchable are encoded into one
  pending batch, written as the single record :meth:`Encoder.pack` makes
  (compressed there) at the next flush, when
  ``batch_bytes`` of payloads are pending, or before the next item that is
  not batchable (that one is written on its own). A batch closes early when
  the file would reach ``max_file_bytes`` with it (so rotation keeps its
  bound). A crash loses the pending batch with the unflushed tail.
* Appends come from one thread (the recorder process's main thread).
* A shared directory (several engines, several ``vllm serve``): the
  directory's total stays within ``max_total_bytes`` less the files being
  written (``connector.recorder.retention``). An existing directory open
  to others is left as it is, with a warning.
* A write, flush or fsync that has not returned ``io_stall_s`` after the
  producer first saw it in flight (a hung mount; a process stopped and
  resumed mid-write is not one) sends the writer to broken mode as an I/O
  error does: the producer's next :meth:`append` sees it, what comes is
  dropped and counted, and the log resumes in a new file once a probe
  succeeds.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from connector.recorder.files import LogFiles
from connector.recorder.writer_thread import Encoder, Rotate, WriterThread

__all__ = [
    "EventLogWriter",
    "default_prefix",
]

_log = logging.getLogger(__name__)
_instance_counter = itertools.count()


def default_prefix() -> str:
    """``<UTC timestamp with ms>-<pid>``, plus ``-<n>`` for later writers of a process."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f"{int(now * 1000) % 1000:03d}Z"
    n = next(_instance_counter)
    return f"{stamp}-{os.getpid()}" + (f"-{n}" if n else "")


class EventLogWriter(WriterThread):
    """Non-blocking, rotating writer of framed records.  See the module docstring."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        encoder: Encoder,
        warn: Callable[[str], None] | None = None,
        prefix: str | None = None,
        max_file_bytes: int = 64 * 1024 * 1024,
        max_total_bytes: int | None = None,
        auto_rotate: bool = True,
        retry_interval_s: float = 1.0,
        probe_bytes: int = 64 * 1024,
        flush_interval_s: float = 0.2,
        flush_bytes: int = 1 << 20,
        idle_poll_s: float = 0.1,
        register_atexit: bool = True,
        batch_bytes: int = 256 * 1024,
        queue_max_bytes: int = 64 * 1024 * 1024,
        io_stall_s: float = 10.0,
    ) -> None:
        if max_file_bytes < 1:
            raise ValueError("max_file_bytes must be >= 1")
        if max_total_bytes is not None and max_total_bytes < 1:
            raise ValueError("max_total_bytes must be >= 1 (or None: unbounded)")
        self._encoder = encoder
        self._warn = warn if warn is not None else _log.warning
        self.prefix = prefix if prefix is not None else default_prefix()
        self._queue_max_bytes = queue_max_bytes
        self._bytes_in = 0  # producer: bytes of the items it queued (``item_bytes``)
        self._bytes_out = 0  # writer thread: of those it took
        self._io_stall_s = io_stall_s
        self._max_file_bytes = max_file_bytes
        self._auto_rotate = auto_rotate
        self._retry_interval_s = retry_interval_s
        self._probe_bytes = probe_bytes
        self._flush_interval_s = flush_interval_s
        self._flush_bytes = flush_bytes
        self._idle_poll_s = idle_poll_s
        self._batch_max_bytes = batch_bytes
        self._batch: list[bytes] = []  # writer thread: encoded payloads not yet written
        # Their items' events (``_GAP_WEIGHT``: a gap record), for the loss
        # accounting. Not the items: a flush interval's worth of events kept
        # alive here would make the cyclic GC's young collections come due.
        self._batch_weights: list[int] = []
        self._batch_bytes = 0
        self._pack_s = 0.0  # writer thread time in pack (compression)

        # Producer-side state.
        self._queue: deque[object] = deque()
        self._items_lost = 0
        self._warned_loss = False
        self._closing = False
        self._rotate_pending = False  # a rotation is queued, not yet done
        # The I/O call in flight (its ``io_since``) and when this side first
        # saw it: a stall is timed from then, not from the call's start, so
        # a process stopped mid-write (SIGSTOP, a frozen cgroup) is not taken
        # for a hung disk when it resumes.
        self._io_seen_for = 0.0
        self._io_seen_s = 0.0

        # Writer-thread state.
        self._items_written = 0
        self.writing = False  # the writer thread holds an item (testkit.pacing reads it)
        self._gaps_written = 0
        self._encode_errors = 0
        self._warned_encode = False
        self._warned_plain_rotation = False
        self._broken: BaseException | None = None
        self._outage_lost = 0  # events dropped since the I/O failure
        self._next_retry = 0.0
        self._due = False  # the writer wants a rotation (size bound, or space is back)
        self._due_since = 0.0
        self._resumes = 0
        self._unflushed = 0
        self._last_flush = time.monotonic()

        # Open the first file here, on the caller's thread, so that a bad
        # directory or a failing header/encode raises at construction.
        self._disk = LogFiles(Path(directory), self.prefix, max_total_bytes=max_total_bytes,
                              buffer_bytes=flush_bytes, warn=self._warn)
        self._open_next_file()

        self._wake = threading.Event()
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._run, name=f"eventlog-writer-{self.prefix}", daemon=True
        )
        self._thread.start()
        self._atexit_registered = register_atexit
        if register_atexit:
            atexit.register(self._atexit_close)

    # ------------------------------------------------------------ producer side

    def append(self, item: object) -> None:
        """Enqueue ``item`` for writing; never blocks, never drops (see the module docstring)."""
        if self._closing:
            self._lose("append() after close(); item dropped")
            return
        since = self._disk.io_since
        if since:
            now = time.monotonic()
            if since != self._io_seen_for:  # this write's first sight
                self._io_seen_for, self._io_seen_s = since, now
            elif now - self._io_seen_s > self._io_stall_s:
                self._stalled()
        self._bytes_in += self._encoder.weight(item)
        self._queue.append(item)

    @property
    def busy(self) -> bool:
        """Whether the queue weighs half ``queue_max_bytes`` or more: its
        caller takes nothing more in until it is not."""
        return 2 * (self._bytes_in - self._bytes_out) >= self._queue_max_bytes

    def _stalled(self) -> None:
        """The writer thread's write/flush/fsync has not returned for longer
        than ``io_stall_s``: broken mode, as for an I/O error (the writer
        thread, when the call returns, drops what it takes and probes)."""
        if self._broken is None:
            self._broken = TimeoutError(f"a write has not returned for {self._io_stall_s:g} s")
            self._outage_lost = 0
            self._next_retry = time.monotonic() + self._retry_interval_s
            self._warn(f"event log: a write to {self._disk.directory} has not returned for "
                       f"{self._io_stall_s:g} s (a hung disk?); events are dropped and "
                       "counted; the log resumes in a new file when writes succeed")

    def _lose(self, message: str) -> None:
        self._items_lost += 1
        if not self._warned_loss:
            self._warned_loss = True
            self._warn(message)

    @property
    def rotation_due(self) -> bool:
        """True when the writer wants the producer to call :meth:`rotate`: the
        file reached ``max_file_bytes`` (with ``auto_rotate=False``), or the
        log can resume after an I/O failure (probed once per
        ``retry_interval_s``). False while a rotation is queued."""
        return self._due and not self._rotate_pending and not self._closing

    def rotate(self, first_item: object | None = None) -> bool:
        """Queue a rotation: the next file starts with its header and then
        ``first_item`` (the producer's snapshot); after an I/O failure this is
        the attempt to resume, and a gap marker with the events lost goes
        between the two. Returns False (nothing queued) when the writer is
        closing."""
        if self._closing:
            return False
        self._rotate_pending = True
        self._queue.append(Rotate(first_item))
        self._wake.set()
        return True

    # ------------------------------------------------------------ counters

    @property
    def items_written(self) -> int:
        """Caller items written (headers and gap markers excluded)."""
        return self._items_written

    @property
    def items_lost(self) -> int:
        """Caller items dropped: queue overflow, encode failures, after close, I/O failure."""
        return self._items_lost

    @property
    def records_written(self) -> int:
        """All records written, including headers and gap markers."""
        return self._disk.records_written

    @property
    def gaps_written(self) -> int:
        return self._gaps_written

    @property
    def bytes_written(self) -> int:
        """Framed bytes handed to the OS or buffered for it, over all files."""
        return self._disk.bytes_written

    @property
    def encode_errors(self) -> int:
        return self._encode_errors

    @property
    def broken(self) -> bool:
        """True from an I/O failure until the log resumes."""
        return self._broken is not None

    @property
    def files(self) -> tuple[Path, ...]:
        """Paths of the files opened so far, in order (deleted ones included)."""
        return tuple(self._disk.paths)

    @property
    def queue_len(self) -> int:
        return len(self._queue)

    @property
    def queued_bytes(self) -> int:
        """What the queued items weigh (``item_bytes``; 0 without it)."""
        return self._bytes_in - self._bytes_out

    @property
    def queue_max_bytes(self) -> int:
        return self._queue_max_bytes

    def stats(self) -> dict[str, int]:
        return {
            "items_written": self._items_written,
            "items_lost": self._items_lost,
            "records_written": self._disk.records_written,
            "gaps_written": self._gaps_written,
            "bytes_written": self._disk.bytes_written,
            "encode_errors": self._encode_errors,
            "files": len(self._disk.paths),
            "files_deleted": self._disk.retention.files_deleted,
            "bytes_deleted": self._disk.retention.bytes_deleted,
            "resumes": self._resumes,
            "queue_len": len(self._queue),
            "pack_us": round(self._pack_s * 1e6),
        }

    # ------------------------------------------------------------ close

    def close(self, timeout_s: float = 10.0) -> bool:
        """Drain the queue, flush, fsync and close the file, join the thread.

        Idempotent.  Returns True once the writer thread has finished (a later
        call may be used to wait again after a timeout).
        """
        with self._close_lock:
            first = not self._closing
            self._closing = True
        if first and self._atexit_registered:
            atexit.unregister(self._atexit_close)
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            if first:
                self._warn(
                    f"event log writer did not finish within {timeout_s}s "
                    f"({len(self._queue)} items still queued)"
                )
            return False
        if first and self._queue:
            # Items appended concurrently with close(), after the final drain.
            leftover = len(self._queue)
            self._queue.clear()
            self._items_lost += leftover
            self._warn(f"{leftover} event(s) appended during close() were dropped")
        return True

    def _atexit_close(self) -> None:
        self.close()

    def __enter__(self) -> EventLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
