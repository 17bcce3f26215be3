"""The writer thread's encoder: queued items into payloads, in order.

Contract: runs on the writer thread only (``connector.recorder.writer``
calls it), never raises for the live stream, and keeps what schema 4's
forms need per *segment* (``offload_fsm.log.compact``): the compact-form
context, the zlib stream of its BATCH records (``log.batch``), the request
ids and the body key its INDEX will say (``log.records.Index``), and the
file's last snapshot's stored keys. A header or a snapshot starts a
segment.

Items (tuples queued by ``connector.recorder.recording``; the first item is
the record kind, ``log.records``):

* ``(INPUTS, seq, wall_s, batch, size_bytes)``: ``batch`` an
  :class:`InputsBatch` (the engine's wire tuples, encoded as they came) or
  a list of callbacks' (event, outcome) pairs (a recorder fed in process);
  encoded once in compact forms for the disk and, only while the live
  stream is on, once more in plain forms for it (subscribers join late);
* ``(DIGEST, seq, wall_s, digest)``, ``(GAP, lost, first)``, ``(END, seq,
  wall_s, digest)``, ``(VANISHED, seq, wall_s, reason)``, ``(REJECTED,
  seq, wall_s, event, reason)``, ``(INDEX, seq, wall_s, step_index)``,
  ``(SNAPSHOT, seq, wall_s, digest, state_wire, step_index, periodic)``;
* :data:`NEW_FILE`: the header of the file the writer opens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping
from typing import Any, Final

import attrs

from connector.recorder.stream import LiveStream
from offload_fsm.log.batch import Deflater, encode_batch
from offload_fsm.log.compact import (
    MAX_INDEX_REQUESTS,
    WireContext,
    encode_compact_inputs,
    hash_reads,
    requests_of,
)
from offload_fsm.log.cursor import run_header
from offload_fsm.log.peek import body_key
from offload_fsm.log.records import (
    DIGEST,
    END,
    GAP,
    HEADER,
    INDEX,
    INPUTS,
    REJECTED,
    SNAPSHOT,
    VANISHED,
    encode_digest,
    encode_end,
    encode_gap,
    encode_header,
    encode_index,
    encode_rejected,
    encode_snapshot,
    encode_vanished,
    encode_wire_inputs,
)
from offload_fsm.log.snapshot_pack import compact_snapshot
from offload_fsm.log.wire import inputs_items, to_wire
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

__all__ = ["NEW_FILE", "InputsBatch", "RecordEncoder"]

NEW_FILE: Final = (HEADER,)
_BATCHED: Final = frozenset((INPUTS, DIGEST, GAP, REJECTED))


@attrs.frozen(kw_only=True)
class InputsBatch:
    """A batch as the engine handed it over: ``items`` ``[ev_1, check_1,
    ...]`` (events as wire tuples, outcomes in their recorded forms) and the
    block ids each ``ReadHashes`` of the recorder's fold read, by batch id
    (``log.compact.hash_reads``)."""

    items: list[Any]
    read_ids: dict[int, tuple[int, ...]]


class RecordEncoder:
    """Turns queued items into payloads (see the module docstring)."""

    def __init__(self, *, header_config: Mapping[str, object], policy: str, world_size: int,
                 versions: Mapping[str, str], digest_every: int, full_outcomes: bool,
                 stream: LiveStream, engine_index: int = 0, compress_level: int = 6,
                 first_seq: int = 0) -> None:
        self._config = dict(header_config)
        self._engine_index = engine_index
        self._policy = policy
        self._world_size = world_size
        self._versions = dict(versions)
        self._digest_every = digest_every
        self._full = full_outcomes
        self.stream = stream
        self._created_s = 0.0
        self._file_index = -1
        self._next_seq = first_seq
        self._item_seq = first_seq
        self._header_payload = b""
        self._after_snapshot = False
        self._wire_context = WireContext()
        self._deflater = Deflater(compress_level)
        self._compress_level = compress_level
        self._segment_seq = 0
        self._segment_step = 0
        self._segment_key: int | None = 0  # see log.records.Index.key
        self._requests: set[str] | None = set()
        self._snapshot_keys: tuple[Any, ...] | None = None  # the file's last snapshot's

    # -- what the writer asks (``writer_thread.Encoder``) -------------------------

    def batchable(self, item: Any) -> bool:
        """With compression, INPUTS, DIGEST, GAP and REJECTED go into BATCH
        records; headers, snapshots, indexes and the END go on their own
        (the reader finds them without inflating anything)."""
        return self._compress_level > 0 and type(item) is tuple and item[0] in _BATCHED

    def events_of(self, item: Any) -> int:
        """How many events a queued item carries (what a GAP counts when it is lost)."""
        kind = item[0]
        if kind == INPUTS:
            batch = item[3]
            if type(batch) is InputsBatch:
                return len(batch.items) // 2
            return sum(map(len, batch))
        return 1 if kind == REJECTED else 0

    def weight(self, item: Any) -> int:
        """What a queued item weighs: an INPUTS item what its caller said
        (``EventRecorder.record_batch``'s ``size_bytes``)."""
        return item[4] if type(item) is tuple and item[0] == INPUTS else 0

    def pack(self, payloads: list[bytes]) -> bytes:
        """The writer's batch: one BATCH record of the segment's zlib stream."""
        return encode_batch(payloads, self._deflater)

    def header(self) -> bytes:
        """The payload of the header of the file the writer opens."""
        return self(NEW_FILE)

    def gap(self, lost: int) -> bytes:
        """The payload of a GAP for ``lost`` events the writer dropped."""
        return self((GAP, lost))

    def _start_segment(self) -> None:
        self._wire_context.reset()
        self._deflater.reset()
        self._segment_key = 0

    def _chain(self, payload: bytes) -> bytes:
        """``payload``, once the segment's key has taken in its body."""
        if self._segment_key is not None:
            self._segment_key = body_key(payload, self._segment_key)
        return payload

    def _ms(self, wall_s: float) -> int:
        return round((wall_s - self._created_s) * 1000.0)

    def __call__(self, item: Any) -> bytes:
        kind = item[0]
        after_snapshot, self._after_snapshot = self._after_snapshot, kind == SNAPSHOT
        # The writer encodes an item before it knows that the item starts a
        # new file, so a header's seq is the first event of the last item.
        if kind != HEADER:
            self._item_seq = self._next_seq
        if kind == INPUTS:
            return self._inputs(item[1], item[2], item[3])
        if kind == DIGEST:
            _, seq, wall_s, digest = item
            self.stream.publish(self._header_payload)  # late subscribers get the context
            payload = self._chain(encode_digest(seq, self._ms(wall_s), digest))
        elif kind == GAP:
            # A gap names the first lost event: the one the recorder says, or,
            # for the writer's own (encoded right after the snapshot that
            # follows it in the file), the events before the snapshot.
            lost = item[1]
            if len(item) > 2:
                first = item[2]
            else:
                first = self._next_seq - lost if after_snapshot else self._next_seq
            payload = encode_gap(max(0, first), self._ms(time.time()), lost)
            self._segment_key = None
            if not after_snapshot:
                self._requests = None  # the lost events named requests unknown
        elif kind == VANISHED:
            _, seq, wall_s, reason = item
            payload = encode_vanished(seq, self._ms(wall_s), seq, reason)
        elif kind == END:
            _, seq, wall_s, digest = item
            payload = encode_end(seq, self._ms(wall_s), seq, digest)
        elif kind == REJECTED:
            _, seq, wall_s, event, reason = item
            self._item_seq = seq
            self._segment_key = None
            payload = encode_rejected(seq, self._ms(wall_s), event, reason)
            self._add_requests(event)
            self._next_seq = seq + 1
        elif kind == SNAPSHOT:
            return self._snapshot(*item[1:])
        elif kind == INDEX:
            _, seq, wall_s, step_index = item
            requests = self._requests
            if requests is not None and len(requests) >= MAX_INDEX_REQUESTS:
                requests = None
            return encode_index(self._segment_seq, self._ms(wall_s), self._segment_step, seq,
                                step_index, requests, self._segment_key)
        else:
            payload = self._header()
            self._start_segment()
            if not after_snapshot:  # the file has no snapshot yet to refer to
                self._snapshot_keys = None
        self.stream.publish(payload)
        return payload

    def _inputs(self, seq: int, wall_s: float, batch: Any) -> bytes:
        if type(batch) is InputsBatch:
            items, read_ids = batch.items, batch.read_ids
        else:
            pairs = list(itertools.chain.from_iterable(batch))
            items = inputs_items(pairs, self._full)
            read_ids = hash_reads(outcome for _, outcome in pairs if type(outcome) is Outcome)
        self._item_seq = seq
        wall_ms = self._ms(wall_s)
        try:
            payload = encode_compact_inputs(seq, wall_ms, items, self._wire_context,
                                            self._requests, read_ids)
        except Exception:
            # A GAP takes its place; the context is part-way.
            self._requests = self._segment_key = None
            raise
        if self.stream.endpoint:  # subscribers join late: they get plain events
            self.stream.publish(encode_wire_inputs(seq, wall_ms, items))
        self._next_seq = seq + len(items) // 2
        return self._chain(payload)

    def _snapshot(self, seq: int, wall_s: float, digest: str, state: tuple[Any, ...],
                  step_index: int, periodic: bool) -> bytes:
        """Encoded before the header of the file it starts, which takes its seq."""
        previous = self._snapshot_keys if periodic else None
        state, keys = compact_snapshot(state, previous)
        payload = encode_snapshot(seq, self._ms(wall_s), digest, state,
                                  level=self._compress_level)
        self._item_seq = self._next_seq = seq
        self._start_segment()
        self._segment_seq, self._segment_step, self._requests = seq, step_index, set()
        self._snapshot_keys = keys
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
        self._header_payload = encode_header(run_header(
            seq=self._item_seq, wall_time_s=now, config=self._config, policy=self._policy,
            world_size=self._world_size, versions=self._versions, created_s=self._created_s,
            file_index=self._file_index, digest_every=self._digest_every,
            full_outcomes=self._full, engine_index=self._engine_index))
        return self._header_payload
