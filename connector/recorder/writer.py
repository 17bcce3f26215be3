"""The recorder's writer thread: framed records into rotating files.

A writer appends framed records (``offload_fsm.log.framing``) to the files
of its run (``connector.recorder.files``; the default prefix is ``<UTC
timestamp>-<pid>``), each starting with its header (:meth:`Encoder.header`).
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
* Writes are buffered and flushed to the OS every ``flush_interval_s`` or
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
* A write, flush or fsync that has not returned after ``io_stall_s`` (a hung
  mount) sends the writer to broken mode as an I/O error does: the
  producer's next :meth:`append` sees it, what comes is dropped and counted,
  and the log resumes in a new file once a probe succeeds.
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
from typing import Any, Protocol

from connector.recorder.files import LogFiles
from offload_fsm.log.framing import frame

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


class _Rotate:
    """Queue-internal: close the file, open the next, and write ``item`` (a
    snapshot, say) right after its header; see :meth:`EventLogWriter.rotate`."""

    __slots__ = ("item",)

    def __init__(self, item: object) -> None:
        self.item = item


class Encoder(Protocol):
    """What the writer asks of its items (the recorder's:
    ``connector.recorder.encoder.RecordEncoder``)."""

    def __call__(self, item: Any) -> bytes:
        """The payload of ``item``."""

    def header(self) -> bytes:
        """The payload of the header of a file the writer opens."""

    def gap(self, lost: int) -> bytes:
        """The payload of a GAP for ``lost`` events the writer dropped."""

    def pack(self, payloads: list[bytes]) -> bytes:
        """One record's payload holding ``payloads`` (a BATCH)."""

    def batchable(self, item: Any) -> bool:
        """Whether ``item`` joins the pending batch (else it is written alone)."""

    def events_of(self, item: Any) -> int:
        """How many events ``item`` carries (what a GAP counts when it is lost)."""

    def weight(self, item: Any) -> int:
        """What ``item`` weighs in the queue (see :attr:`EventLogWriter.busy`)."""


_GAP_WEIGHT = -1  # stands for a gap record among a pending batch's weights


class EventLogWriter:
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
        idle_poll_s: float = 0.01,
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
        if since and time.monotonic() - since > self._io_stall_s:
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
        self._queue.append(_Rotate(first_item))
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

    # ------------------------------------------------------------ writer thread

    def _run(self) -> None:
        q = self._queue
        popleft = q.popleft
        write_item = self._write_item
        weight = self._encoder.weight
        monotonic = time.monotonic
        self._disk.enforce_retention()
        try:
            while True:
                n = 0
                while n < 4096:
                    self.writing = True  # before the pop: never "idle" with an item in hand
                    try:
                        item = popleft()
                    except IndexError:
                        break
                    self._bytes_out += weight(item)
                    write_item(item)
                    n += 1
                self.writing = False
                pending = self._unflushed + self._batch_bytes
                if pending and (
                    pending >= self._flush_bytes
                    or monotonic() - self._last_flush >= self._flush_interval_s
                ):
                    self._flush()
                if self._broken is not None and not self._due and monotonic() >= self._next_retry:
                    self._probe()
                if n == 0:
                    # Closing, and the queue empty *after* the flag was seen:
                    # what the producer queued before close() set it is written.
                    if self._closing:
                        if not q:
                            break
                        continue
                    self._wake.wait(self._idle_poll_s)
                    self._wake.clear()
        finally:
            self._close_file()

    def _weigh(self, item: object) -> int:
        try:
            return self._encoder.events_of(item)
        except Exception:  # a weight is bookkeeping; never let it stop the writer
            return 1

    def _write_item(self, item: object) -> None:
        if type(item) is _Rotate:
            assert isinstance(item, _Rotate)
            self._on_rotate(item.item)
            return
        if self._broken is not None:
            self._items_lost += 1
            self._outage_lost += self._weigh(item)
            return
        if self._encoder.batchable(item):
            self._add_to_batch(item)
            return
        self._close_batch()
        if self._broken is not None:
            self._drop(item)
            return
        is_gap = False
        try:
            record = frame(self._encoder(item))
        except Exception as exc:
            self._encode_errors += 1
            self._items_lost += 1
            if not self._warned_encode:
                self._warned_encode = True
                self._warn(f"event log: failed to encode {type(item).__name__}: {exc!r}")
            lost = self._weigh(item)
            if not lost:
                return
            try:
                record = frame(self._encoder.gap(lost))
            except Exception:
                return
            is_gap = True
        self._place(record, [_GAP_WEIGHT if is_gap else self._weigh(item)], is_gap=is_gap)

    def _drop(self, item: object) -> None:
        self._lose_weight(self._weigh(item))

    def _lose_weight(self, weight: int) -> None:
        """Count an item of ``weight`` events that will not be written (a
        gap record, ``_GAP_WEIGHT``, counts nothing)."""
        if weight != _GAP_WEIGHT:
            self._items_lost += 1
            self._outage_lost += weight

    def _add_to_batch(self, item: object) -> None:
        is_gap = False
        try:
            payload = self._encoder(item)
        except Exception as exc:
            self._encode_errors += 1
            if not self._warned_encode:
                self._warned_encode = True
                self._warn(f"event log: failed to encode {type(item).__name__}: {exc!r}")
            self._items_lost += 1
            lost = self._weigh(item)
            if not lost:
                return
            try:
                payload = self._encoder.gap(lost)
            except Exception:
                return
            is_gap = True
        self._batch.append(payload)
        self._batch_weights.append(_GAP_WEIGHT if is_gap else self._weigh(item))
        self._batch_bytes += len(payload)
        if (self._batch_bytes >= self._batch_max_bytes
                or self._disk.file_bytes + self._batch_bytes >= self._max_file_bytes):
            self._close_batch()

    def _close_batch(self) -> None:
        """Write the pending batch as one record (see the module docstring)."""
        if not self._batch:
            return
        payloads, weights = self._batch, self._batch_weights
        self._batch, self._batch_weights, self._batch_bytes = [], [], 0
        started = time.perf_counter()
        try:
            record = frame(self._encoder.pack(payloads))
        except Exception as exc:
            self._encode_errors += 1
            if not self._warned_encode:
                self._warned_encode = True
                self._warn(f"event log: failed to pack a batch of {len(weights)}: {exc!r}")
            self._items_lost += len(weights) - weights.count(_GAP_WEIGHT)
            return
        finally:
            self._pack_s += time.perf_counter() - started
        self._place(record, weights, is_gap=False, batch=True)

    def _place(self, record: bytes, weights: list[int], *, is_gap: bool,
               batch: bool = False) -> None:
        """Write ``record`` (of items of ``weights`` events), rotating around it
        as the bounds say.
        A batch never starts a file it was not packed for: it goes in the
        current file, and the rotation (if due) follows it."""
        if (not batch and self._disk.file_records
                and self._disk.file_bytes + len(record) > self._max_file_bytes):
            if self._auto_rotate:
                self._rotate()
            elif self._producer_late(len(record)):
                self._plain_rotation()
            else:
                self._set_due()
            if self._broken is not None:
                self._lose_all(weights, is_gap)
                return
        self._write_record(record)
        if self._broken is not None:
            self._lose_all(weights, is_gap)
            return
        gaps = 1 if is_gap else weights.count(_GAP_WEIGHT)
        self._gaps_written += gaps
        self._items_written += len(weights) - gaps
        self._disk.file_records += 1
        if self._disk.file_bytes >= self._max_file_bytes:
            if not self._auto_rotate:
                self._set_due()
                if batch and self._producer_late(0):
                    self._plain_rotation()
            elif batch:
                self._rotate()

    def _lose_all(self, weights: list[int], is_gap: bool) -> None:
        for weight in weights:
            self._lose_weight(_GAP_WEIGHT if is_gap else weight)

    def _producer_late(self, more_bytes: int) -> bool:
        """The producer has not answered rotation_due and the file (with
        ``more_bytes``) is past twice the bound. (A queued rotation is coming:
        the items before it go here.)"""
        return (not self._rotate_pending
                and self._disk.file_bytes + more_bytes > 2 * self._max_file_bytes
                and time.monotonic() - self._due_since > _PRODUCER_PATIENCE_S)

    def _plain_rotation(self) -> None:
        """Keep the bound anyway: the next file has no producer's first record."""
        if not self._warned_plain_rotation:
            self._warned_plain_rotation = True
            self._warn("event log: rotating without the producer's first record "
                       f"(file past twice {self._max_file_bytes} bytes)")
        self._rotate()

    def _set_due(self) -> None:
        if not self._due:
            self._due = True
            self._due_since = time.monotonic()

    def _on_rotate(self, first: object | None) -> None:
        """A rotation the producer asked for (``first``: the new file's first
        record after the header), or, while broken, the attempt to resume."""
        gap = None
        self._close_batch()  # the batch belongs to the file (and segment) before ``first``
        try:
            record = frame(self._encoder(first)) if first is not None else None
            if record is not None and self._broken is not None and self._outage_lost:
                # Encoded after ``first`` (whose place it tells), written before it.
                gap = frame(self._encoder.gap(self._outage_lost))
        except Exception as exc:
            self._encode_errors += 1
            if not self._warned_encode:
                self._warned_encode = True
                self._warn(f"event log: failed to encode {type(first).__name__}: {exc!r}")
            record = None
        finally:
            self._rotate_pending = False
        if self._broken is None:
            self._rotate(record)
            return
        self._resume(gap, record)

    # ------------------------------------------------------------ the disk

    def _probe(self) -> None:
        """While broken: can the directory take writes again? On success asks
        the producer for a rotation (its snapshot starts the resumed file)."""
        self._next_retry = time.monotonic() + self._retry_interval_s
        self._disk.drop()  # broken by a stall: the file was left open
        if self._disk.probe(self._probe_bytes):
            self._disk.enforce_retention()  # before the new file, not after: make room first
            self._set_due()

    def _resume(self, gap: bytes | None, record: bytes | None) -> None:
        """Open the next file with header, gap and ``record``, synced; on any
        failure delete it and wait for the next probe."""
        self._due = False
        self._next_retry = time.monotonic() + self._retry_interval_s
        if record is None:
            return  # nothing to resume from (the snapshot did not encode)
        try:
            header = frame(self._encoder.header())
            path = self._disk.open_resumed([part for part in (header, gap, record)
                                            if part is not None])
        except Exception:  # OSError: still no room; anything else: try again later
            return
        self._gaps_written += gap is not None
        self._items_written += 1
        self._last_flush = time.monotonic()
        self._unflushed = 0
        lost, self._outage_lost = self._outage_lost, 0
        self._broken = None
        self._resumes += 1
        self._warn(f"event log: resumed in {path} after {lost} lost event(s)")

    def _write_record(self, record: bytes) -> None:
        try:
            self._disk.write(record)
        except OSError as exc:
            self._fail(exc)
            return
        self._unflushed += len(record)

    def _flush(self) -> None:
        self._close_batch()
        self._unflushed = 0
        self._last_flush = time.monotonic()
        if self._broken is None:
            try:
                self._disk.flush()
            except OSError as exc:
                self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """An I/O error: stop writing, drop (and count) what comes, close the
        file, and probe for room once per ``retry_interval_s``."""
        self._broken = exc
        self._due = False
        self._outage_lost = 0
        self._next_retry = time.monotonic() + self._retry_interval_s
        paths = self._disk.paths
        self._warn(
            f"event log: I/O error on {paths[-1] if paths else self._disk.directory}: "
            f"{exc!r}; events are dropped and counted in items_lost; retrying every "
            f"{self._retry_interval_s:g}s, the log resumes in a new file when writes succeed"
        )
        self._disk.drop()
        self._unflushed = 0
        for weight in self._batch_weights:
            self._lose_weight(weight)
        self._batch, self._batch_weights, self._batch_bytes = [], [], 0

    def _close_file(self) -> None:
        if self._broken is None and self._disk.file is not None:
            self._close_batch()
        self._unflushed = 0
        if self._broken is not None:
            self._disk.drop()
            return
        try:
            self._disk.sync_close()
        except OSError as exc:
            self._fail(exc)

    def _rotate(self, first: bytes | None = None) -> None:
        """Close the file, open the next (header, then ``first``), apply retention."""
        self._close_file()
        if self._broken is not None:
            return
        try:
            self._open_next_file()
        except OSError as exc:
            self._fail(exc)
        except Exception as exc:  # make_header/encode failed: file lacks its header
            self._encode_errors += 1
            self._warn(f"event log: failed to write header of {self._disk.paths[-1]}: {exc!r}")
        if first is not None and self._disk.file is not None and self._broken is None:
            self._write_record(first)
            if self._broken is None:
                self._disk.file_records += 1
                self._items_written += 1
        self._disk.enforce_retention()

    def _open_next_file(self) -> None:
        self._due = False
        self._disk.open_next(frame(self._encoder.header()))


_PRODUCER_PATIENCE_S = 1.0  # how long a rotation_due may go unanswered past twice the bound
