"""Where a log's next event goes: one cursor for every writer of a log, and the sink contract.

Contract: pure (no clock, no I/O, no logging). A writer of a log (the
engine's hand-off, the recorder, ``replay whatif``'s writer) keeps one
:class:`LogCursor`, which owns the three numbers that decide the log's
layout (``log.layout``): the next event's ``seq``, the open batch, and the
``seq`` at which the next digest is due. Two writers fed the same events
therefore number them alike, close their batches after the same record calls
and take their digests at the same ``seq``: ``replay diff`` compares their
logs record by record.

Theory of operation
-------------------
* :meth:`LogCursor.add` numbers one record call's applied events (a
  callback's, or the shell's half step's) into the open batch (the writer
  keeps whatever it wants per call: the event objects, their packed bytes)
  and says whether the batch closes after them: after a step among them
  (``layout.STEP_TYPES``), once it holds ``limit_events`` events, or where a
  digest is due.
* :meth:`LogCursor.take` hands the open batch over (its first ``seq`` and
  its items) and opens the next one.
* :meth:`LogCursor.digest_due` is asked when a batch closed, with the state
  after it: a digest (or the engine's summary, which the recorder's digest
  is checked against) follows the batch, so a digest never falls inside
  one, and the recorder, taking the engine's batches as sent, puts its
  digests where the engine's cursor did.
* :meth:`LogCursor.skip_to` moves past events that are not in this log (a
  GAP: lost, or numbered by the engine before this recorder started); the
  open batch is dropped with them.

:func:`run_header` builds the header of every file a writer of a log
starts. :class:`EventSink` is the contract the shell's manager records through:
``record`` applied events (a callback's, or several in order), ``record_rejected`` a callback
whose step failed, ``close`` at shutdown. None of its methods may raise
because of the log or block on I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from offload_fsm.log.layout import (
    BATCH_EVENTS,
    STEP_TYPES,
    first_digest_seq,
    next_digest_seq,
)
from offload_fsm.log.records import SCHEMA_VERSION, Header
from offload_fsm.state import State
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

__all__ = ["EventSink", "LogCursor", "run_header"]


class EventSink(Protocol):
    """Where the shell's applied events go (see the module docstring)."""

    def record(self, applied: Sequence[tuple[Event, Outcome]], state: State) -> None:
        """Applied events in order (``offload_fsm.drive`` results) and the state after."""

    def record_rejected(self, applied: Sequence[tuple[Event, Outcome]], event: Event,
                        reason: str, state: State) -> None:
        """A callback whose step failed: ``applied`` before the failure, then
        ``event`` rejected with ``reason``."""

    def close(self, state: State | None) -> None:
        """The log ends (with the final digest when ``state`` is given)."""


class LogCursor:
    """``seq``, the open batch and the next digest of one log (see the module docstring)."""

    __slots__ = ("batch", "batch_events", "batch_seq", "digest_every", "limit_events",
                 "next_digest", "seq")

    def __init__(self, *, digest_every: int, first_seq: int = 0,
                 limit_events: int = BATCH_EVENTS) -> None:
        if limit_events < 1:
            raise ValueError(f"limit_events={limit_events!r}: expected an integer >= 1")
        self.seq = first_seq  # the next event's
        self.batch: list[Any] = []  # the writer's items of the open batch, one per record call
        self.batch_events = 0
        self.batch_seq = first_seq  # the open batch's first event
        self.digest_every = digest_every
        self.next_digest = first_digest_seq(digest_every)
        self.limit_events = limit_events

    def add(self, applied: Sequence[tuple[Any, Any]], item: Any) -> bool:
        """Number one record call's ``applied`` (event, outcome) pairs into the
        open batch, kept there as ``item``; whether the batch closes now (a
        step ended, the batch is full, or a digest is due)."""
        self.batch.append(item)
        count = len(applied)
        self.seq += count
        self.batch_events += count
        return (self.batch_events >= self.limit_events or self.seq >= self.next_digest > 0
                or any(type(event) in STEP_TYPES for event, _ in applied))

    def take(self) -> tuple[int, list[Any]]:
        """The open batch (its first ``seq``, its items); the next one opens at ``seq``."""
        first, items = self.batch_seq, self.batch
        self.batch = []
        self.batch_events = 0
        self.batch_seq = self.seq
        return first, items

    def take_whole(self, first_seq: int, events: int) -> None:
        """A batch numbered elsewhere (the engine's, ``events`` from
        ``first_seq``) taken as it is: the cursor moves past it."""
        self.skip_to(first_seq)
        self.seq = self.batch_seq = first_seq + events

    def digest_due(self, state: State | None) -> bool:
        """When a batch closed: whether a digest of ``state`` (the state
        after the batch) is due; the next one is then scheduled. With
        ``state`` None (not known) none is due and the next one is
        ``digest_every`` events on."""
        if not self.seq >= self.next_digest > 0:
            return False
        if state is None:
            self.next_digest = self.seq + self.digest_every
            return False
        self.next_digest = next_digest_seq(self.seq, self.digest_every, state)
        return True

    def skip_to(self, seq: int) -> None:
        """Go on from event ``seq``; the open batch is dropped."""
        self.seq = self.batch_seq = seq
        self.batch = []
        self.batch_events = 0


def run_header(*, seq: int, wall_time_s: float, config: dict[str, Any], policy: str,
               world_size: int, versions: dict[str, str], created_s: float,
               file_index: int, digest_every: int, full_outcomes: bool,
               engine_index: int) -> Header:
    """The header of a file this version writes (every writer of a log builds
    its headers here: the schema is always :data:`SCHEMA_VERSION`)."""
    return Header(seq=seq, wall_time_s=wall_time_s, schema=SCHEMA_VERSION, config=config,
                  policy=policy, world_size=world_size, versions=versions,
                  created_s=created_s, file_index=file_index, digest_every=digest_every,
                  full_outcomes=full_outcomes, engine_index=engine_index)
