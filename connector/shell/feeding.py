"""The core's inputs in the engine's order, and the log's records of them.

Contract: :class:`CoreFeed` is the one caller of :func:`offload_fsm.drive` in
the shell and the one writer of the event log's ``record``. Every event it
applies reaches the core in the order vLLM observed it, the passed steps
(``StepReader``'s run) before the first event after them; every event the
core applied is recorded once, in that order, before the log closes.

Theory of operation
-------------------
One core pass and one record per step. What ``schedule()`` observes before
the step is read (arrivals, the step's offers) and the last step's receipts
wait (:meth:`CoreFeed.defer`) and are applied in order where the step is
read (:meth:`CoreFeed.apply_pending`, in the step's pass,
``connector.shell.beside``), with the passed steps before them: none of
them needs a command before then, and no hook between reads what they
change (a lookup reads the core's buffered blocks and pins, which an
arrival leaves alone, and asks :meth:`CoreFeed.arriving` for its request;
an event it feeds applies what waits first). What needs the core's answer
now (a finish whose shield pins before vLLM frees the blocks; an arrival
whose id is reused) is applied at once (:meth:`CoreFeed.feed`, pending ones
first); a finish that pins nothing waits with the rest
(``queries.finish_waits``). The applied pairs wait in ``unrecorded`` and go to the log once per
step (:meth:`CoreFeed.record`, at the end of the pass), or sooner past
:data:`RECORD_EVENTS`: the core sees the same events in the same order as
with a call and a record per event, and the log holds the same events.

On a failure (``drive`` raises), the events before the failing one are
applied and noted; the rest stay pending for the manager's drain-only
takeover, which drops them (:meth:`CoreFeed.drop_pending`; receipts among
them go to the drain).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from connector.shell.narrator import Narrator
from connector.shell.pool_commands import PoolCommands
from connector.shell.step_reading import StepReader
from offload_fsm import drive
from offload_fsm.state import State
from offload_fsm.vocabulary import events
from offload_fsm.vocabulary.errors import CommandFailed, StepFailed
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

RECORD_EVENTS = 256
"""Applied events held for the log at most before they are recorded."""

Applied = list[tuple[Event, Outcome]] | tuple[Any, ...]


class CoreFeed:
    """The manager's events into ``state`` and onto ``event_log`` (module
    docstring); ``failed(name, error)`` hears of the log's own failures."""

    def __init__(self, state: State, reader: StepReader, commands: PoolCommands,
                 narrator: Narrator, event_log: Any,
                 failed: Callable[[str, Exception], None]) -> None:
        self.state = state
        self.event_log = event_log
        self.seq = 0  # events applied (the log numbers them alike)
        self._reader = reader
        self._commands = commands
        self._narrator = narrator
        self._failed = failed
        self._pending: deque[Event | Callable[[], Event]] = deque()
        self._arriving: set[str] = set()  # the request ids of pending arrivals
        self._unrecorded: list[tuple[Event, Outcome]] = []

    def defer(self, event: Event | Callable[[], Event]) -> None:
        """Apply ``event`` where the step is read (or before the next event
        fed); a callable is the event's builder, called then (an offer's
        fingerprints are read in the step's pass)."""
        if type(event) is events.RequestArrived:
            self._arriving.add(event.req_id)
        self._pending.append(event)

    @property
    def waiting(self) -> bool:
        """Whether events wait to be applied."""
        return bool(self._pending)

    def arriving(self, req_id: str) -> bool:
        """Whether ``req_id``'s arrival waits to be applied."""
        return req_id in self._arriving

    def feed(self, event: Event) -> None:
        """Apply ``event`` and its command loop now, what waits first."""
        self.apply_pending()
        self._drive(event)

    def apply_pending(self) -> None:
        """Apply what waits, in order; on a failure the rest keep waiting."""
        pending = self._pending
        while pending:
            event = pending.popleft()
            if callable(event):
                event = event()
            elif type(event) is events.RequestArrived:
                self._arriving.discard(event.req_id)
            self._drive(event)

    def report_passed(self) -> None:
        """Apply the reader's run of passed steps."""
        self.applied(drive(self.state, self._reader.take_passed(), self._commands.execute))

    def drop_pending(self) -> list[Event | Callable[[], Event]]:
        """Forget what waits, and return it: the core closed (drain-only mode)."""
        dropped = list(self._pending)
        self._pending.clear()
        self._arriving.clear()
        return dropped

    def applied(self, applied: Applied) -> None:
        """``drive``'s result: noted, and held for the log."""
        self.noted(applied)
        if self.event_log is not None:
            self._unrecorded.extend(applied)
            if len(self._unrecorded) >= RECORD_EVENTS:
                self.record()

    def noted(self, applied: Applied) -> None:
        """What the commands and the narrator learn of applied events."""
        for _, outcome in applied:
            if outcome.decisions:  # both read decisions only
                self._commands.note(outcome)
                self._narrator.note(outcome)
        self.seq += len(applied)

    def record(self) -> None:
        """Hand the applied events not yet recorded to the event log."""
        unrecorded = self._unrecorded
        if not unrecorded or self.event_log is None:
            return
        self._unrecorded = []
        try:
            self.event_log.record(unrecorded, self.state)
        except Exception as error:  # the log's failure, not offload's: never drain-only
            self._failed("record", error)

    def record_failure(self, error: Exception, log_error: Callable[..., Any]) -> None:
        """Record what applied before a failure, then the failed drive's own
        applied events (a rejection's ``record_rejected`` records them before
        its REJECTED); a log that cannot is reported, never raised."""
        try:
            if isinstance(error, StepFailed):
                self.record()
                self.noted(error.applied)
                if self.event_log is not None:
                    self.event_log.record_rejected(error.applied, error.event, error.reason,
                                                   self.state)
            else:
                if isinstance(error, CommandFailed):
                    self.applied(error.applied)
                self.record()
        except Exception as secondary:
            log_error("lazy offload: could not record the failure", reason=repr(secondary))

    def _drive(self, event: Event) -> None:
        if self._reader.passed:
            self.report_passed()
        self.applied(drive(self.state, event, self._commands.execute))
