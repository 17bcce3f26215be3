"""Event-log record format: envelopes around pure domain facts (schema 8).

Pure module: standard library, ``attrs`` and ``msgpack`` only. It defines
the records and turns them into payload bytes; ``log.decode`` turns bytes
back into records, framing (magic, length, CRC32) is
:mod:`offload_fsm.log.framing`, and file names are ``log.names``.

Envelope
--------
Every payload is one msgpack array ``[kind, seq, wall, *payload]``:

==========  ===  =====================================================================
kind        tag  payload
==========  ===  =====================================================================
HEADER      1    ``{...}`` (see :class:`Header`); ``wall`` is absolute seconds
INPUTS      2    ``ev_1, check_1, ev_2, check_2, ...``: consecutive applied events
DIGEST      3    ``digest``: ``digest.state_digest`` after event ``seq`` was applied
GAP         4    ``lost_count``: events lost from ``seq`` on (writer overload, I/O error)
END         5    ``events_total, digest``: clean shutdown (digest ``""`` if unknown)
REJECTED    6    ``ev, reason``: the core rejected event ``seq`` (added in schema 2)
SNAPSHOT    7    ``digest, state``: the whole state before event ``seq`` (added in schema 3;
                 in schema 4 ``state`` may be the zlib-deflated msgpack of it)
BATCH       8    ``data``: payloads of the kinds above, deflated (schema 4, ``log.compact``)
INDEX       9    ``first_step, end_seq, end_step, requests[, key]``: the segment from
                 event ``seq`` (schema 4, ``key`` schema 5; see :class:`Index`)
VANISHED    10   ``events_total, reason``: the engine died without a clean shutdown;
                 its recorder wrote what it had received and closed the log (schema 6)
==========  ===  =====================================================================

A SNAPSHOT is ``log.snapshot.take(state)`` with its ``digest.state_digest``. The
recorder writes one right after the header of every file but the first (and
of a file that resumes the log after an I/O failure), so each file replays
alone: retention may delete the files before it. In a schema 3 file a GAP
counts events; before, the records the writer dropped.

Kind tags are never renumbered (append new ones). ``seq`` numbers events from
0 without holes; an INPUTS record carries the events ``seq, seq + 1, ...``
(a batch, ``log.layout``: observations in order, each followed by the answers
of its command loop),
which amortises the envelope and the 12 framing bytes. For non-event kinds
``seq`` is the number of events recorded before the record, except for
REJECTED, the last word of a poisoned core: ``seq`` is the number the
rejected event ``ev`` was given (the events of its callback that applied
before it are in the INPUTS records before it). ``wall`` is the recorder's
clock (``time.time()``) in whole milliseconds since the file header's
``created_s``, so decoding needs the header's context (``log.decode.LogDecoder``).

An event ``ev_i`` is ``log.wire.to_wire(event)``. ``check_i`` is
:func:`outcome_check` of what the core returned for it: ``0`` for an empty
outcome, else a CRC32 (never 0) of the packed decisions and commands. It lets
replay detect divergence at a cost of one to five bytes per event. With the
header flag ``full_outcomes`` the check is replaced by the outcome itself,
``[decisions, commands]`` as wire tuples.

Versions
--------
The header's ``schema`` states the version of every record in its file.
Readers refuse versions newer than :data:`SCHEMA_VERSION`
(:class:`SchemaTooNew`) and bring older ones up to date with the chain
:data:`UPCASTERS` (``version -> function`` from plain decoded envelope tuples
of that version to the next), before any object is built. A changed field
list of an event, decision or command is a new schema version plus an
upcaster; tags stay. Schema 2 added the REJECTED kind; a schema 1 record
is a valid schema 2 record, so its upcaster is the identity. Schema 3 added
the SNAPSHOT kind, again the identity for older records. Schema 4 added the
compact forms of :mod:`offload_fsm.log.compact` (window deltas, hash
references, BATCH) and the INDEX kind; a plain record is a valid compact
one, so its upcaster is the identity too. Schema 5 added block-id runs in
``CandidateOffered`` and compact op records in snapshots; schema 4's forms
are valid schema 5 forms (the identity again), while a schema 4 reader
refuses a schema 5 file instead of misreading a run. Schema 6 added the
VANISHED kind, schema 7 the ``StepsPassed`` event (a run of quiet token
steps) and schema 8 the ``LookupAnswered`` event (a lookup's allocation
reach), each the identity for older records.
"""

from __future__ import annotations

import enum
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs

from offload_fsm.log.wire import OutcomeWire, inputs_items, pack_array_header, packb, to_wire
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

__all__ = ["BATCH", "DIGEST", "END", "GAP", "HEADER", "INDEX", "INPUTS", "PUB_TOPIC",
           "REJECTED", "SCHEMA_VERSION", "SNAPSHOT", "UPCASTERS", "VANISHED", "Digest", "End",
           "Gap", "Header", "Index", "Inputs", "LogRecord", "RecordKind", "Rejected",
           "Snapshot", "Vanished", "encode_digest", "encode_end", "encode_gap",
           "encode_header", "encode_index", "encode_inputs", "encode_packed_snapshot",
           "encode_rejected", "encode_snapshot", "encode_vanished", "encode_wire_inputs"]

SCHEMA_VERSION: Final[int] = 8



class RecordKind(enum.IntEnum):
    """A payload's kind, the envelope's first item (the table above); never
    renumbered, new kinds appended."""

    HEADER = 1
    INPUTS = 2
    DIGEST = 3
    GAP = 4
    END = 5
    REJECTED = 6  # added in schema 2
    SNAPSHOT = 7  # added in schema 3
    BATCH = 8  # added in schema 4
    INDEX = 9  # added in schema 4
    VANISHED = 10  # added in schema 6


# The kinds by name, as the readers and writers of this package import them.
HEADER: Final = RecordKind.HEADER
INPUTS: Final = RecordKind.INPUTS
DIGEST: Final = RecordKind.DIGEST
GAP: Final = RecordKind.GAP
END: Final = RecordKind.END
REJECTED: Final = RecordKind.REJECTED
SNAPSHOT: Final = RecordKind.SNAPSHOT
BATCH: Final = RecordKind.BATCH
INDEX: Final = RecordKind.INDEX
VANISHED: Final = RecordKind.VANISHED

PUB_TOPIC: Final[bytes] = b"lolog"
"""The ZeroMQ topic of the live stream: every message is ``[PUB_TOPIC, frame]``."""

def _upcast_v1_v2(item: tuple[Any, ...]) -> tuple[Any, ...]:
    """Schema 2 only added the REJECTED kind, which v1 files never contain."""
    return item


def _upcast_v2_v3(item: tuple[Any, ...]) -> tuple[Any, ...]:
    """Schema 3 only added the SNAPSHOT kind, which v2 files never contain."""
    return item


def _upcast_v3_v4(item: tuple[Any, ...]) -> tuple[Any, ...]:
    """Schema 4 added compact forms and kinds; a schema 3 record is a plain one."""
    return item


def _upcast_v4_v5(item: tuple[Any, ...]) -> tuple[Any, ...]:
    """Schema 5 added block-id runs and compact snapshot ops (``log.compact``),
    whose readers take schema 4's plain forms as they are."""
    return item


def _upcast_v5_v6(item: tuple[Any, ...]) -> tuple[Any, ...]:
    """Schema 6 only added the VANISHED kind, which v5 files never contain."""
    return item


def _upcast_v6_v7(item: tuple[Any, ...]) -> tuple[Any, ...]:
    """Schema 7 only added the ``StepsPassed`` event, which v6 files never contain."""
    return item


def _upcast_v7_v8(item: tuple[Any, ...]) -> tuple[Any, ...]:
    """Schema 8 only added the ``LookupAnswered`` event, which v7 files never contain."""
    return item


UPCASTERS: dict[int, Callable[[tuple[Any, ...]], tuple[Any, ...]]] = {
    1: _upcast_v1_v2,
    2: _upcast_v2_v3,
    3: _upcast_v3_v4,
    4: _upcast_v4_v5,
    5: _upcast_v5_v6,
    6: _upcast_v6_v7,
    7: _upcast_v7_v8,
}
"""``UPCASTERS[n]`` turns a decoded envelope tuple of schema ``n`` into schema
``n + 1``."""


# --------------------------------------------------------------------------
# Records.


@attrs.frozen(kw_only=True)
class Header:
    """First record of every file: everything needed to replay the run."""

    seq: int  # events recorded before this file
    wall_time_s: float
    schema: int
    config: dict[str, Any]  # OffloadConfig.to_wire()
    policy: str
    world_size: int
    versions: dict[str, str]  # package, vllm, lmcache, ...
    created_s: float
    file_index: int = 0
    digest_every: int = 0
    full_outcomes: bool = False
    engine_index: int = 0  # vLLM's data-parallel rank (several engines, one directory)


@attrs.frozen(kw_only=True)
class Inputs:
    """Applied events ``seq, seq + 1, ...`` with their outcome checks (ints)
    or, under ``full_outcomes``, their outcomes (:data:`OutcomeWire`)."""

    seq: int
    wall_time_s: float
    events: tuple[Event, ...]
    checks: tuple[int | OutcomeWire, ...]


@attrs.frozen(kw_only=True)
class Digest:
    seq: int  # the last event applied before the digest was taken
    wall_time_s: float
    digest: str


@attrs.frozen(kw_only=True)
class Gap:
    seq: int  # the first lost event
    wall_time_s: float
    lost_count: int


@attrs.frozen(kw_only=True)
class End:
    seq: int  # events recorded in total
    wall_time_s: float
    events_total: int
    digest: str


@attrs.frozen(kw_only=True)
class Vanished:
    """The engine died without a clean shutdown (killed, say): the recorder
    wrote every event it had received, ``events_total`` in all, and this."""

    seq: int  # events recorded in total
    wall_time_s: float
    events_total: int
    reason: str


@attrs.frozen(kw_only=True)
class Rejected:
    """The core rejected ``event``, which was given number ``seq``; nothing
    was applied after it (the machine is poisoned)."""

    seq: int
    wall_time_s: float
    event: Event
    reason: str


@attrs.frozen(kw_only=True)
class Snapshot:
    """The whole state before event ``seq`` (``log.snapshot.take``, decoded
    into a state by ``log.snapshot.restore`` with the header's config), and
    its ``digest.state_digest``. A reader's ``state`` is a
    ``log.snapshot_pack.LazyState``, decoded when :meth:`wire` asks for it."""

    seq: int
    wall_time_s: float
    digest: str
    state: Any  # the wire tuple, or a LazyState of it

    def wire(self) -> tuple[Any, ...]:
        """The state's wire tuple; raises ``LogCorrupt`` when it does not decode."""
        state = self.state
        return state if type(state) is tuple else state.wire()


@attrs.frozen(kw_only=True)
class Index:
    """What a segment (events ``seq`` to ``end_seq - 1``, from a header or a
    snapshot to the next) holds: the token steps it spans (``state.step_index``
    before its first event and after its last) and every request id its
    events name, or None when unknown (events were lost, or too many).

    ``key`` (schema 5): CRC-32 chained, from 0, over the body (after the wall
    clock, ``log.peek``) of each INPUTS and DIGEST payload of the segment in
    order; None when a GAP or REJECTED was in it, or before schema 5. Two
    runs whose segments have the same ``seq``, ``end_seq`` and ``key`` hold
    the same events, checks and digests there (``replay diff`` skips them)."""

    seq: int
    wall_time_s: float
    first_step: int
    end_seq: int
    end_step: int
    requests: tuple[str, ...] | None
    key: int | None = None


LogRecord = Header | Inputs | Digest | Gap | End | Rejected | Snapshot | Index | Vanished


# --------------------------------------------------------------------------
# Encoding.


def _ms(wall_time_s: float, created_s: float) -> int:
    return max(0, round((wall_time_s - created_s) * 1000.0))


def encode_header(header: Header) -> bytes:
    body: dict[str, Any] = {
        "schema": header.schema,
        "config": header.config,
        "policy": header.policy,
        "world_size": header.world_size,
        "versions": header.versions,
        "created_s": header.created_s,
        "file_index": header.file_index,
        "digest_every": header.digest_every,
        "full_outcomes": header.full_outcomes,
        "engine_index": header.engine_index,
    }
    return packb((HEADER, header.seq, header.wall_time_s, body))


def encode_inputs(
    seq: int,
    wall_ms: int,
    applied: Iterable[tuple[Event, Outcome]],
    *,
    full_outcomes: bool = False,
) -> bytes:
    """An INPUTS payload for events numbered from ``seq``; ``wall_ms`` is
    relative to the file header's ``created_s``."""
    return encode_wire_inputs(seq, wall_ms, inputs_items(applied, full_outcomes))


def encode_wire_inputs(seq: int, wall_ms: int, items: Iterable[Any]) -> bytes:
    """An INPUTS payload of ``items`` (``log.wire.inputs_items``' form)."""
    return packb([INPUTS, seq, wall_ms, *items])


def encode_digest(seq: int, wall_ms: int, digest: str) -> bytes:
    return packb((DIGEST, seq, wall_ms, digest))


def encode_gap(seq: int, wall_ms: int, lost_count: int) -> bytes:
    return packb((GAP, seq, wall_ms, lost_count))


def encode_end(seq: int, wall_ms: int, events_total: int, digest: str) -> bytes:
    return packb((END, seq, wall_ms, events_total, digest))


def encode_vanished(seq: int, wall_ms: int, events_total: int, reason: str) -> bytes:
    return packb((VANISHED, seq, wall_ms, events_total, reason))


def encode_rejected(seq: int, wall_ms: int, event: Event, reason: str) -> bytes:
    return packb((REJECTED, seq, wall_ms, to_wire(event), reason))


def encode_snapshot(seq: int, wall_ms: int, digest: str, state: tuple[Any, ...],
                    *, level: int = 0) -> bytes:
    """With ``level`` (schema 4) the state travels deflated at that zlib level."""
    body = zlib.compress(packb(state), level) if level else state
    return packb((SNAPSHOT, seq, wall_ms, digest, body))


def encode_packed_snapshot(seq: int, wall_ms: int, digest: str, packed_state: bytes,
                           *, level: int = 0) -> bytes:
    """:func:`encode_snapshot` of the state whose packed bytes are
    ``packed_state`` (``log.snapshot_pack.packed_snapshot``): the same bytes."""
    if level:
        return packb((SNAPSHOT, seq, wall_ms, digest, zlib.compress(packed_state, level)))
    return b"".join((pack_array_header(5), packb(SNAPSHOT), packb(seq), packb(wall_ms),
                     packb(digest), packed_state))


def encode_index(seq: int, wall_ms: int, first_step: int, end_seq: int, end_step: int,
                 requests: Iterable[str] | None, key: int | None = None) -> bytes:
    listed = None if requests is None else tuple(sorted(requests))
    return packb((INDEX, seq, wall_ms, first_step, end_seq, end_step, listed, key))
