"""The writer thread's half of :class:`~connector.recorder.writer.EventLogWriter`.

Contract: every method here runs on the writer's daemon thread (its loop,
:meth:`WriterThread._run`), never on the producer's: it takes items off the
queue, encodes them (the :class:`Encoder`),
gathers batchable payloads into one record per flush, places records in the
run's files (``connector.recorder.files``), rotating as the bounds say, and
watches the disk: an I/O error or a stall sends it to broken mode, where
what it takes is dropped and counted, and it probes for room once per
``retry_interval_s``; once writes succeed it asks the producer for a
rotation, and the resumed file holds header, a GAP of the events lost, and
the producer's snapshot. The state both halves share is set up by
``EventLogWriter.__init__``; the annotations below name it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from connector.recorder.files import LogFiles
from offload_fsm.log.framing import frame

__all__ = ["Encoder", "Rotate", "WriterThread"]

_GAP_WEIGHT = -1  # stands for a gap record among a pending batch's weights
_PRODUCER_PATIENCE_S = 1.0  # how long a rotation_due may go unanswered past twice the bound


class Rotate:
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


class WriterThread:
    """See the module docstring."""

    _encoder: Encoder
    _warn: Callable[[str], None]
    _disk: LogFiles
    _queue: deque[object]
    _wake: threading.Event
    _closing: bool
    _rotate_pending: bool
    _max_file_bytes: int
    _auto_rotate: bool
    _retry_interval_s: float
    _probe_bytes: int
    _flush_interval_s: float
    _flush_bytes: int
    _idle_poll_s: float
    _batch_max_bytes: int
    _batch: list[bytes]
    _batch_weights: list[int]
    _batch_bytes: int
    _pack_s: float
    _bytes_out: int
    _items_written: int
    _items_lost: int
    writing: bool
    _gaps_written: int
    _encode_errors: int
    _warned_encode: bool
    _warned_plain_rotation: bool
    _broken: BaseException | None
    _outage_lost: int
    _next_retry: float
    _due: bool
    _due_since: float
    _resumes: int
    _unflushed: int
    _last_flush: float

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
        if type(item) is Rotate:
            assert isinstance(item, Rotate)
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
