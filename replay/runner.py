"""Re-running the core on a recorded log, and the first divergence.

:func:`replay` reads a run (:mod:`logfiles.scan`), builds a fresh state from
the first header (config, world size), and folds every recorded event through
:func:`offload_fsm.machine.step`, comparing each outcome with its recorded
check and the state with every DIGEST and END record. It stops folding at
the first divergence, the first lost event (a GAP record, a hole in ``seq``)
or the first damaged span, because the state after lost inputs is unknown;
it keeps reading to the end so that every damage is reported.

A SNAPSHOT record (every file but the first starts with one) carries the
whole state before event ``seq``. While folding, its digest is checked like
a DIGEST record and its state is not decoded (``check_snapshots``: it is,
and must rebuild a state with that digest). Where the state is unknown (the files before it are
missing, deleted by retention; a lost event or a damaged span before it),
folding starts again from it: the state is rebuilt by
:func:`offload_fsm.log.snapshot.restore` and must match the snapshot's own
digest. So a file alone replays from its snapshot; a loss or damage is
still reported, but the rest of the run is verified. A divergence or a
rejection ends folding for good.

A REJECTED record is the recorded run's core refusing an event (and being
poisoned by it). Replay applies that event too: the core must refuse it
again (a :class:`Rejection`, ``reproduced``); if it applies it instead, that
is a divergence as well. Either way folding ends there.

An ``observer(seq, event, outcome, state)`` sees every applied event; the
analyses (explain, summary, timeline) are observers. The state passed to it
is live: read it, never keep or mutate it. A ``clock(wall_time_s)`` is
called with the recorder's wall clock (absolute seconds) before the events
of each INPUTS or REJECTED record are applied.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from logfiles.scan import Entry, LogDamage, read_log
from offload_fsm.digest import state_digest
from offload_fsm.log import records as log_records
from offload_fsm.log import snapshot
from offload_fsm.log.records import LogRecord
from offload_fsm.log.wire import outcome_check, outcome_wire
from offload_fsm.machine import step
from offload_fsm.refold import Mismatch, refold
from offload_fsm.state import State, new_state
from offload_fsm.vocabulary.config import OffloadConfig, parse_recorded_config
from offload_fsm.vocabulary.errors import LogCorrupt, StepFailed
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

Observer = Callable[[int, Event, Outcome, State], None]


@attrs.frozen(kw_only=True)
class Divergence:
    """``kind``: ``outcome`` (decisions/commands differ, or an event recorded
    as rejected was applied), ``digest`` (state differs), ``invalid_event``
    (the core refused an event recorded as applied)."""

    seq: int
    kind: str
    event: Event | None
    expected: Any
    got: Any
    detail: str


@attrs.frozen(kw_only=True)
class Rejection:
    """The recorded run's core rejected event ``seq`` (a REJECTED record).

    ``reproduced``: True when the replayed core rejected it too (with
    ``reproduced_reason``), False when it applied it (a divergence is
    reported as well), None when folding had stopped before it.
    """

    seq: int
    event: Event
    recorded_reason: str
    reproduced: bool | None
    reproduced_reason: str = ""

    def describe(self) -> str:
        req_id = getattr(self.event, "req_id", None)
        who = f" (request {req_id!r})" if req_id is not None else ""
        if self.reproduced is None:
            answer = "not checked, replay had stopped before it"
        elif not self.reproduced:
            answer = "no, the core applied it"
        elif self.reproduced_reason == self.recorded_reason:
            answer = "yes"
        else:
            answer = f"yes, with reason: {self.reproduced_reason}"
        return (f"event {self.seq} {type(self.event).__name__}{who} was rejected by the "
                f"core: {self.recorded_reason} (reproduced on replay: {answer})")


@attrs.define(kw_only=True)
class ReplayResult:
    header: log_records.Header | None = None
    state: State | None = None
    events_applied: int = 0
    records: int = 0
    digests_checked: int = 0
    divergence: Divergence | None = None
    rejection: Rejection | None = None  # the run's first REJECTED record
    damage: list[LogDamage] = attrs.Factory(list)
    lost: list[str] = attrs.Factory(list)  # gaps in the event sequence
    stopped: str = ""  # why folding stopped early ("" = it reached the end)
    ended_cleanly: bool = False
    vanished: str = ""  # the recorder's word that the engine died (a VANISHED record)
    first_seq: int = 0  # the first event replayed (a snapshot's, when earlier files are gone)
    snapshots_loaded: list[int] = attrs.Factory(list)  # seq of each snapshot folding started at
    snapshots_checked: int = 0

    @property
    def ok(self) -> bool:
        return (self.divergence is None and self.rejection is None and not self.damage
                and not self.lost)


YOUNG_COLLECTION_ALLOCATIONS = 100_000
"""The cyclic GC's young-generation threshold while a replay command runs
(CPython's default is 700; :func:`spaced_collections`)."""


@contextlib.contextmanager
def spaced_collections() -> Iterator[None]:
    """Run the block with the cyclic GC's young generation collected once
    :data:`YOUNG_COLLECTION_ALLOCATIONS` more containers are alive than at
    the last collection; the thresholds before are restored after.

    A fold keeps most of what the core builds (ops, their requests, block
    ids, block-index entries) for hundreds of steps, and each collection
    examines objects that nearly all survive it (and every tuple of block
    ids in them, element by element). The count is allocations less frees,
    so a steady fold stays under this threshold and a collection comes only
    while the state grows (or cyclic garbage piles up: never more than this
    many containers of it). Measured with ``gc.callbacks``, ``verify`` of
    the one-hour ``bench_longrun`` log: at 700, 12,722 collections, 4.1 s of
    43 s; at 20,000, 290 (2 of them full), 2.9-4.3 s of 38-44 s; at 100,000,
    2, under 1 ms, 34-39 s, at the same peak memory. The cycles a fold makes
    (an op and its request) are dropped whole when the request ends."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], YOUNG_COLLECTION_ALLOCATIONS), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


def config_of(header: log_records.Header) -> OffloadConfig:
    """The core's config a log was recorded under."""
    return parse_recorded_config(header.config).offload


def replay(
    path: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    observer: Observer | None = None,
    clock: Callable[[float], None] | None = None,
    check_snapshots: bool = False,
) -> ReplayResult:
    """Fold the run at ``path``; see the module docstring."""
    fold = _Fold(observer, clock, check_snapshots=check_snapshots)
    for entry in read_log(path, prefix):
        fold.take(entry)
    fold.finish()
    return fold.result


def _divergence(mismatch: Mismatch) -> Divergence:
    """A refold's mismatch as replay reports it."""
    seq, event, recorded = mismatch.seq, mismatch.event, mismatch.recorded
    if mismatch.outcome is None:
        return Divergence(seq=seq, kind="invalid_event", event=event, expected="accepted",
                          got=str(mismatch.error), detail=str(mismatch.error))
    if type(recorded) is int:
        return Divergence(seq=seq, kind="outcome", event=event,
                          expected=f"check {recorded:#010x}",
                          got=f"check {outcome_check(mismatch.outcome):#010x}: "
                              f"{outcome_wire(mismatch.outcome)!r}",
                          detail="the recorded outcome check differs")
    return Divergence(seq=seq, kind="outcome", event=event, expected=recorded,
                      got=outcome_wire(mismatch.outcome), detail="the recorded outcome differs")


def _rebuilt(record: log_records.Snapshot, config: OffloadConfig, world_size: int) -> State | str:
    """The state ``record`` holds, or why it does not give one with its digest."""
    try:
        state = snapshot.restore(record.wire(), config)
    except LogCorrupt as error:
        return f"the snapshot before event {record.seq} does not decode: {error}"
    if state.world_size != world_size:
        return (f"the snapshot before event {record.seq} has world size "
                f"{state.world_size}, the header {world_size}")
    got = state_digest(state)
    if got != record.digest:
        return (f"the snapshot before event {record.seq} rebuilds a state with digest "
                f"{got}, recorded {record.digest}")
    return state


def _reason(error: Exception) -> str:
    """What the core said when it refused an event."""
    if isinstance(error, StepFailed):
        return error.reason
    return f"{type(error).__name__}: {error}"  # MachinePoisoned, or not the core's own


class _Fold:
    """One replay in progress: the live state, the next ``seq`` expected, and
    the result. One ``on_*`` method per record kind (:data:`_ON_RECORD`),
    called while folding; :meth:`after_stop` sees the records after that."""

    def __init__(self, observer: Observer | None,
                 clock: Callable[[float], None] | None = None, *,
                 check_snapshots: bool = False) -> None:
        self.result = ReplayResult()
        self.observer = observer
        self.clock = clock
        self.check_snapshots = check_snapshots
        self.state: State | None = None
        self.config: OffloadConfig | None = None
        self.folding = True
        self.resumable = True  # a later snapshot may restart folding
        self.next_seq = 0
        self.schema = 0
        self.missing_start = ""  # the run's first file starts past event 0

    def take(self, entry: Entry | LogDamage) -> None:
        """One item of the log: damage, or a record folded (or seen after the stop)."""
        if isinstance(entry, LogDamage):
            self.on_damage(entry)
            return
        self.result.records += 1
        record = entry.record
        if self.folding:
            _ON_RECORD[type(record)](self, record)
        else:
            self.after_stop(record)

    def stop(self, reason: str, *, resumable: bool = True) -> None:
        self.folding = False
        self.resumable = self.resumable and resumable
        self.result.stopped = reason

    def finish(self) -> None:
        result = self.result
        if result.header is None and not result.stopped:
            result.stopped = "no header record"
        if self.missing_start and not result.snapshots_loaded:
            result.lost.append(f"{self.missing_start}, and no snapshot follows")

    def lose(self, message: str) -> None:
        self.result.lost.append(message)
        self.stop(message)

    def diverge(self, divergence: Divergence) -> None:
        self.result.divergence = divergence
        self.stop(f"divergence at seq {divergence.seq}", resumable=False)

    def on_damage(self, damage: LogDamage) -> None:
        self.result.damage.append(damage)
        if self.folding:
            self.stop(f"damaged record: {damage.describe()}")

    def after_stop(self, record: LogRecord) -> None:
        """Past the stop, a clean end and the run's own rejection still count."""
        if type(record) is log_records.End:
            self.result.ended_cleanly = True
        elif type(record) is log_records.Vanished:
            self.on_vanished(record)
        elif type(record) is log_records.Snapshot and self.resumable:
            self.restore(record)
        elif type(record) is log_records.Header:
            self.schema = record.schema
        elif type(record) is log_records.Rejected and self.result.rejection is None:
            self.result.rejection = Rejection(seq=record.seq, event=record.event,
                                              recorded_reason=record.reason, reproduced=None)

    def on_header(self, record: log_records.Header) -> None:
        result = self.result
        self.schema = record.schema
        if result.header is not None:
            if record.seq != self.next_seq:
                self.lose(f"file {record.file_index} starts at event {record.seq}, "
                          f"expected {self.next_seq}")
            return
        result.header = record
        self.config = config_of(record)
        self.next_seq = result.first_seq = record.seq
        if record.seq != 0:
            # Retention deleted the files before it: its snapshot restarts folding.
            self.missing_start = f"the run starts at event {record.seq}: earlier files are missing"
            self.stop(self.missing_start)
            return
        self.state = result.state = new_state(self.config, world_size=record.world_size)

    def on_snapshot(self, record: log_records.Snapshot) -> None:
        """While folding: the live state must have the snapshot's digest."""
        state = self._live(record.seq)
        if state is None:
            self.after_stop(record)
            return
        got = state_digest(state)
        self.result.snapshots_checked += 1
        if got != record.digest:
            self.diverge(Divergence(
                seq=record.seq, kind="digest", event=None, expected=record.digest, got=got,
                detail=f"state digest before event {record.seq} differs from the snapshot's",
            ))
        elif self.check_snapshots and self.config is not None:
            rebuilt = _rebuilt(record, self.config, state.world_size)
            if isinstance(rebuilt, str):
                self.result.lost.append(rebuilt)


    def restore(self, record: log_records.Snapshot) -> None:
        """Start folding again at ``record`` (the state before it is unknown)."""
        result = self.result
        if self.config is None or result.header is None:
            return
        state = _rebuilt(record, self.config, result.header.world_size)
        if isinstance(state, str):
            result.lost.append(state)
            return
        self.state = result.state = state
        self.next_seq = record.seq
        self.folding = True
        result.stopped = ""
        result.snapshots_loaded.append(record.seq)
        if not result.events_applied:
            result.first_seq = record.seq

    def _live(self, seq: int) -> State | None:
        """The state, if events numbered from ``seq`` can be applied to it now."""
        if self.state is None:
            self.stop("events before any header")
        elif seq != self.next_seq:
            self.lose(f"events {self.next_seq}..{seq - 1} are missing")
        return self.state if self.folding else None

    def on_inputs(self, record: log_records.Inputs) -> None:
        state = self._live(record.seq)
        if state is None:
            return
        if self.clock is not None:
            self.clock(record.wall_time_s)
        seq, mismatch = refold(state, record.seq, zip(record.events, record.checks,
                                                      strict=True), self.observer)
        self.result.events_applied += seq - record.seq
        self.next_seq = seq
        if mismatch is not None:
            self.diverge(_divergence(mismatch))

    def on_digest(self, record: log_records.Digest | log_records.End) -> None:
        if self.state is None or not record.digest:
            return
        got = state_digest(self.state)
        self.result.digests_checked += 1
        if got != record.digest:
            self.diverge(Divergence(
                seq=record.seq, kind="digest", event=None, expected=record.digest, got=got,
                detail=f"state digest after event {record.seq} differs",
            ))

    def on_end(self, record: log_records.End) -> None:
        self.result.ended_cleanly = True
        self.on_digest(record)

    def on_vanished(self, record: log_records.Vanished) -> None:
        self.result.vanished = (f"the engine vanished after event {record.seq - 1}; its "
                                f"recorder closed the log ({record.reason})")

    def on_gap(self, record: log_records.Gap) -> None:
        if self.schema >= 3:  # a schema 3 GAP counts events, from the first lost one
            last = record.seq + record.lost_count - 1
            self.lose(f"{record.lost_count} event(s) lost by the writer "
                      f"(events {record.seq}..{last})")
        else:
            self.lose(f"{record.lost_count} record(s) lost by the writer before event "
                      f"{record.seq}")

    def on_rejected(self, record: log_records.Rejected) -> None:
        state = self._live(record.seq)
        if state is None:
            self.after_stop(record)
            return
        event = record.event
        if self.clock is not None:
            self.clock(record.wall_time_s)
        try:
            outcome = step(state, event)
        except Exception as error:  # the core refuses it again: reproduced
            self.result.rejection = Rejection(
                seq=record.seq, event=event, recorded_reason=record.reason, reproduced=True,
                reproduced_reason=_reason(error))
            self.stop(f"the core rejected event {record.seq}", resumable=False)
            return
        self.result.events_applied += 1
        self.next_seq = record.seq + 1
        if self.observer is not None:
            self.observer(record.seq, event, outcome, state)
        self.result.rejection = Rejection(seq=record.seq, event=event,
                                          recorded_reason=record.reason, reproduced=False)
        self.diverge(Divergence(
            seq=record.seq, kind="outcome", event=event, expected=f"rejected: {record.reason}",
            got=f"applied: {outcome_wire(outcome)!r}",
            detail="recorded as rejected, but the core applied it",
        ))


_ON_RECORD: dict[type[Any], Callable[[_Fold, Any], None]] = {
    log_records.Header: _Fold.on_header,
    log_records.Inputs: _Fold.on_inputs,
    log_records.Digest: _Fold.on_digest,
    log_records.End: _Fold.on_end,
    log_records.Gap: _Fold.on_gap,
    log_records.Rejected: _Fold.on_rejected,
    log_records.Snapshot: _Fold.on_snapshot,
    log_records.Vanished: _Fold.on_vanished,
    log_records.Index: lambda fold, record: None,  # for seeking (replay.seek), nothing to check
}
