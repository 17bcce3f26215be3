"""The engine's hand-off, :class:`Handoff`, on vLLM's scheduler thread: its
contract is the package's (``connector.handoff``): number, pack and hand
over each batch without blocking, within the byte budget; count what does
not fit as an outage, ended by a START (lost count, snapshot)."""

from __future__ import annotations

import atexit
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Final

from connector.handoff.link import (
    FRAME_BYTES,
    Backoff,
    HandoffStats,
    InFlight,
    Link,
    exit_cause,
    growth,
    io_loop,
)
from connector.handoff.messages import PROTOCOL, Message, Reply, state_summary
from offload_fsm.log import snapshot
from offload_fsm.log.cursor import LogCursor
from offload_fsm.log.wire import TO_WIRE, inputs_items, pack_array_header, packb
from offload_fsm.state import State
from offload_fsm.vocabulary.config import LOG_BUDGET_MIN_MIB, PREFIX
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

__all__ = ["BUDGET_KEY", "COALESCE_BYTES", "FLUSH_EVERY_S", "Handoff"]

COALESCE_BYTES: Final = 64 * 1024  # an open frame is handed over at this size
FLUSH_EVERY_S: Final = 0.1  # the I/O thread's period (the package docstring says why)
BUDGET_KEY: Final = f"{PREFIX}_log_budget_mib"
_STEP_HEAD: Final = pack_array_header(5) + packb(Message.STEP)  # a STEP message's first bytes
_MIB = 1024 * 1024


class Handoff:
    """See the module docstring. ``launch`` starts a recorder and returns its
    link (it raises when it cannot); ``clock`` is monotonic seconds;
    ``io_thread`` starts the hand-off's I/O thread (:meth:`io_turn`); without it
    (tests) the scheduler thread does that I/O at a batch boundary every ``flush_every_s``."""

    def __init__(
        self,
        launch: Callable[[], Link],
        *,
        budget_bytes: int,
        digest_every: int = 1000,
        full_outcomes: bool = False,
        warn: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        liveness_every_s: float = 0.5,
        flush_every_s: float = FLUSH_EVERY_S,
        backoff_s: tuple[float, float] = (1.0, 60.0),
        end_wait_s: float = 2.0,
        register_atexit: bool = True,
        io_thread: bool = True,
        release: Callable[[], None] | None = None,
    ) -> None:
        if budget_bytes < 1:
            raise ValueError(f"budget_bytes={budget_bytes!r}: expected an integer >= 1")
        self._launch = launch
        self._budget = budget_bytes
        self._full = full_outcomes
        self._warn = warn
        self._clock = clock
        self._wall = wall_clock
        self._liveness_every_s = liveness_every_s
        self._flush_every_s = flush_every_s
        self._next_flush = 0.0
        self._io_thread = io_thread
        self._restart = Backoff(min_s=backoff_s[0], max_s=backoff_s[1])
        self._resync_backoff = Backoff(min_s=backoff_s[0], max_s=backoff_s[1])
        self._snapshot_backoff = Backoff(min_s=backoff_s[0], max_s=backoff_s[1])
        self._resynced_at = -float("inf")  # when the last resync's START went out
        self._end_wait_s = end_wait_s
        self._release = release
        self.stats = HandoffStats()
        self.recorder_stats: dict[str, int] = {}  # the recorder's writer counters, last sent
        # seq, the open batch (each record call's packed events) and the next digest
        self._cursor = LogCursor(digest_every=digest_every)
        self._link: Link | None = None
        self._flight = InFlight()  # the link's bytes against the budget
        self._start_at: int | None = None  # the byte total that acknowledges a START
        self._lost_from: int | None = None  # in an outage since this seq
        self._resync = False
        self._resume_at = 0.0
        self._next_liveness = 0.0
        self._failure: tuple[str, str] | None = None  # the last FAILED reply
        self._warned_causes: set[str] = set()
        self._bugs_warned: set[str] = set()  # the kinds of error _failed warned about
        self._warned_snapshot = False
        self._closed = False
        self._end_at: int | None = None  # the byte total that acknowledges END
        self._lock = threading.Lock()
        now = self._clock()
        link = self._try_launch(now, first=True)
        if link is not None:
            if self._send(link, packb((Message.START, 0, self._wall(), 0, None, PROTOCOL)), 0):
                self._start_at = self._flight.sent
                self._flush(link)
            else:
                self._outage(0, "the recorder did not take its start")
        if register_atexit:
            atexit.register(self.wait_for_end)
        if io_thread:
            threading.Thread(target=io_loop, args=(weakref.ref(self), flush_every_s),
                             name="lazy-offload-handoff-io", daemon=True).start()

    @property
    def recorder_up(self) -> bool:
        """Whether a recorder took its START in and the log is in step with the engine."""
        return self._link is not None and self._lost_from is None and self._start_at is None

    @property
    def events_lost(self) -> int:
        """Events that never reached the recorder, the open outage's included."""
        open_ = self._cursor.seq - self._lost_from if self._lost_from is not None else 0
        return self.stats.events_lost + open_

    @property
    def held_bytes(self) -> int:
        """What counts against the budget now (see the module docstring)."""
        return self._flight.held_bytes

    # -- the scheduler thread's calls ----------------------------------------

    def record(self, applied: Sequence[tuple[Event, Outcome]], state: State) -> None:
        """Number and pack one callback's applied events (see the module docstring)."""
        if self._closed or not applied:
            return
        with self._lock:
            cursor = self._cursor
            end = cursor.seq + len(applied)
            try:
                if cursor.add(applied, self._pack(applied)):
                    summary = state_summary(state) if cursor.digest_due(state) else None
                    self._send_batch(summary, state)
            except Exception as error:
                self._failed(error, end)

    def record_rejected(self, applied: Sequence[tuple[Event, Outcome]], event: Event,
                        reason: str, state: State) -> None:
        """The callback's ``drive`` failed: what applied before, then ``event``
        rejected with ``reason`` under the next ``seq``."""
        if self._closed:
            return
        with self._lock:
            cursor = self._cursor
            end = cursor.seq + len(applied) + 1
            try:
                # The open batch, before this callback; no START now: ``state``
                # is already past the rejected event.
                self._send_batch(None, state, service=False)
                first = cursor.seq
                message = packb((Message.REJECT, first, self._wall(), self._pack(applied),
                                 TO_WIRE[type(event)](event), reason))
                cursor.skip_to(end)
                self._hand(message, first)
                if self._link is not None:
                    self._flush(self._link)
            except Exception as error:
                self._failed(error, end)

    def close(self, state: State | None) -> None:
        """Hand END over (with a summary for the final digest when ``state``
        is given and open) and return at once; see :meth:`wait_for_end`."""
        if self._closed:
            return
        with self._lock:
            try:
                self._close(state)
            except Exception as error:
                self._closed = True
                self._failed(error, self._cursor.seq)

    def _close(self, state: State | None) -> None:
        if state is not None:
            self._send_batch(None, state)
            self._service(state)
        self._closed = True
        link = self._link
        lost_from = self._lost_from
        seq = self._cursor.seq
        if lost_from is None and self._cursor.batch:  # a batch no state could send
            lost_from = self._cursor.batch_seq
        if lost_from is not None:
            self.stats.events_lost += seq - lost_from
            self._lost_from = None
        summary = state_summary(state) if state is not None and lost_from is None else None
        message = packb((Message.END, seq, self._wall(), summary, lost_from))
        if link is not None and self._send(link, message, seq):
            self._end_at = self._flight.sent
            self._flush(link)

    def _failed(self, error: Exception, end_seq: int) -> None:
        """A failure of this code (a bug), not the recorder's: the events of
        the open batch and the call fall into an outage, as a lost message's
        do (the next batch boundary tries to resume); serving, and offload,
        go on. Warned once per kind of error."""
        cursor = self._cursor
        first = min(cursor.batch_seq, cursor.seq)
        cursor.skip_to(max(cursor.seq, end_seq))
        if self._lost_from is None:
            self._lost_from = first
            self.stats.outages += 1
        else:
            self._lost_from = min(self._lost_from, first)
        kind = type(error).__name__
        if kind not in self._bugs_warned:
            self._bugs_warned.add(kind)
            self._warn(f"event log: the hand-off failed ({error!r}); serving and offload "
                       "continue, the events are counted and the log records them as a GAP "
                       "when recording resumes")

    def wait_for_end(self) -> bool:
        """At the engine's exit: wait at most ``end_wait_s`` for END's ACK (a
        clean exit follows it, though its exit code can overtake it); whether it came."""
        link = self._link
        if link is None or self._end_at is None:
            return False
        deadline = time.monotonic() + self._end_wait_s  # a real wait, whatever the clock
        while self._flight.acked < self._end_at and time.monotonic() < deadline:
            self._take_replies(link)
            if link.exit_code() not in (None, 0):
                break
            time.sleep(0.005)
        self._take_replies(link)
        return self._flight.acked >= self._end_at

    def finish(self) -> bool:
        """At vLLM's shutdown, after :meth:`close`: :meth:`wait_for_end`, then
        let the recorder go and ``release`` what its sockets used. vLLM's
        engine core leaves through ``os._exit``, where :func:`atexit` handlers
        never run: this is called on its way out instead
        (``EventSourcedLMCacheMPConnector.shutdown``). Returns whether the
        recorder acknowledged END."""
        ended = self.wait_for_end()
        link, self._link = self._link, None
        if link is not None:
            link.close()
        release, self._release = self._release, None
        if release is not None:
            release()
        return ended

    # -- the I/O thread ------------------------------------------------------

    def io_turn(self) -> None:
        """The I/O thread's turn, every ``flush_every_s``: hand the open frame
        to ZeroMQ and :meth:`_watch`. It skips a turn while the scheduler
        thread holds the lock, and leaves it what needs the engine's state:
        a restart's or an outage's START (:meth:`_recover`)."""
        if self._closed or not self._lock.acquire(blocking=False):
            return
        try:
            link = self._link
            if link is not None and not self._closed:
                self._flush(link)
                self._watch(link, self._clock())
        finally:
            self._lock.release()

    # -- internals -----------------------------------------------------------

    def _pack(self, applied: Sequence[tuple[Event, Outcome]]) -> bytes:
        """One record call's pairs as an INPUTS record holds them, packed."""
        return packb(inputs_items(applied, self._full))

    def _send_batch(self, summary: Any, state: State, *, service: bool = True) -> None:
        """The open batch as one STEP message ``(STEP, seq, wall_s, summary,
        callbacks)``, its callbacks' packed bytes spliced in. First, with
        ``service`` (``state`` is the state after the batch), the link is
        looked after: a START that ends an outage holds the batch's events
        in its snapshot, and the batch is not sent; a resync's START follows
        the batch. With the I/O thread, the frame goes to ZeroMQ on its next
        turn; the scheduler thread only appends to it."""
        now = self._clock()
        due = now >= self._next_flush
        if due:
            self._next_flush = now + self._flush_every_s
            if service and self._io_thread:
                self._recover(now, state)
            elif service:
                self._service(state)
        if not self._cursor.batch:
            return
        first, batch = self._cursor.take()
        message = b"".join((_STEP_HEAD, packb(first),
                            packb(self._wall()), packb(summary),
                            pack_array_header(len(batch)), *batch))
        self._hand(message, first)
        link = self._link
        if due and link is not None and not self._io_thread:
            self._flush(link)
        if service and self._resync and link is not None and self._lost_from is None:
            self._resume(link, state)

    def _hand(self, message: bytes, first_seq: int) -> None:
        """Send ``message`` (events ``first_seq`` up to the cursor's), or let
        its events fall into the outage."""
        link = self._link
        if link is None or self._lost_from is not None:
            self._outage(first_seq, "")
            return
        if not self._flight.fits(len(message), self._budget):
            self._outage(first_seq, "the recorder is not keeping up: the hand-off budget "
                         f"({self._budget} bytes) is full")
            return
        if not self._send(link, message, first_seq):
            self._outage(first_seq, "the recorder's socket refused a message")

    def _send(self, link: Link, message: bytes, first_seq: int) -> bool:
        """Append ``message`` (its events from ``first_seq``) to the open frame;
        hand the frame over once it reaches :data:`COALESCE_BYTES`."""
        if not link.send(message):
            return False
        open_bytes = self._flight.take(len(message), first_seq)
        self._note_held()
        if open_bytes >= COALESCE_BYTES:
            self._flush(link)
        return True

    def _note_held(self) -> None:
        stats = self.stats
        stats.bytes_in_flight = held = self.held_bytes
        if held > stats.bytes_in_flight_max:
            stats.bytes_in_flight_max = held

    def _flush(self, link: Link) -> None:
        """Hand the open frame to ZeroMQ; if it refuses, the frame's events
        fall into an outage (and its bytes, never sent, out of the count)."""
        first = self._flight.open_first
        if first is None:
            return
        handed = link.flush()
        self._flight.flushed_frame(handed)
        if handed:
            return
        self._note_held()
        self._outage(first, "the recorder's socket refused a message")

    def _service(self, state: State) -> None:
        """:meth:`_watch` and :meth:`_recover`, on the scheduler thread."""
        link = self._link
        now = self._clock()
        if link is not None:
            self._watch(link, now)
        self._recover(now, state)

    def _watch(self, link: Link, now: float) -> None:
        """Read the recorder's replies, and every ``liveness_every_s`` see
        whether its process is still there."""
        self._take_replies(link)
        if now >= self._next_liveness:
            self._next_liveness = now + self._liveness_every_s
            code = link.exit_code()
            if code is not None:
                self._died(link, code, now)

    def _recover(self, now: float, state: State) -> None:
        """What needs ``state``, on the scheduler thread: restart a dead
        recorder when due, and end an outage when it can."""
        link = self._link
        if link is None and now >= self._restart.due_at and not self._closed:
            link = self._try_launch(now, first=False)
        if link is not None and self._lost_from is not None:
            self._resume(link, state)

    def _take_replies(self, link: Link) -> None:
        for reply in link.replies():
            if reply[0] == Reply.ACK:
                self._flight.acknowledge(int(reply[1]))
                if len(reply) > 2 and reply[2] is not None:
                    self.recorder_stats = dict(reply[2])
            elif reply[0] == Reply.RESYNC:
                self._resync = True
                if self._clock() - self._resynced_at > self._resync_backoff.max_s:
                    self._resync_backoff.reset()  # the last mismatch is long past
            elif reply[0] == Reply.FAILED and len(reply) > 2:
                self._failure = (str(reply[1]), str(reply[2]))
                self._start_at = None  # that START was refused: the recorder is not up
        if self._start_at is not None and self._flight.acked >= self._start_at:
            # A recorder took its START in: it is up; the next failure is news.
            self._start_at = None
            self._restart.reset()
            self._warned_causes.clear()
        self._note_held()

    def _died(self, link: Link, code: int, now: float) -> None:
        self._take_replies(link)  # a FAILED sent just before it exited
        first = self._flight.first_unacknowledged()
        if first is None:
            first = self._cursor.batch_seq
        delay = self._restart.take(now)
        failure, self._failure = self._failure, None
        if failure is not None:
            cause, why = failure[0], f"the recorder cannot record: {failure[1]}"
        else:
            cause, why = exit_cause(code)
        self._outage(first, f"{why}; starting it again in {delay:g} s", cause=cause)
        link.close()
        self._link = None
        self._start_at = None

    def _try_launch(self, now: float, *, first: bool) -> Link | None:
        try:
            link = self._launch()
        except Exception as error:  # never let the log hurt the engine
            delay = self._restart.take(now)
            self._outage(self._cursor.batch_seq, f"the recorder could not start ({error!r}); "
                         f"trying again in {delay:g} s", cause=f"launch {error!r}")
            return None
        self._link = link
        self._flight = InFlight()
        self._next_liveness = now + self._liveness_every_s
        if not first:  # only after a death or a failed launch: in an outage, so the
            # new recorder's first message is the START that ends it
            self.stats.recorder_restarts += 1
        return link

    def _resume(self, link: Link, state: State) -> None:
        """End the outage (or resync the recorder's fold): START with the
        events not handed over since the outage began (none for a resync) and
        a snapshot of the live state, which holds them."""
        seq = self._cursor.seq
        lost_from = self._lost_from if self._lost_from is not None else seq
        lost = seq - lost_from
        now = self._clock()
        resync_only = self._lost_from is None
        if now < self._resume_at or now < self._snapshot_backoff.due_at or (
                resync_only and now < self._resync_backoff.due_at):
            return
        if self._flight.sent - self._flight.acked > self._budget // 2:
            return  # a snapshot walks the state: not while the recorder is still full
        self._resume_at = now + self._liveness_every_s
        try:
            message = packb((Message.START, seq, self._wall(), lost,
                             packb(snapshot.take(state)), PROTOCOL))
        except Exception as error:  # a bug; stay in the outage, the warning says why
            self._outage(lost_from, f"the state snapshot failed ({error!r})")
            return
        if not self._flight.fits(len(message), self._budget):
            needed = FRAME_BYTES + growth(len(message))  # with nothing else held
            if needed > self._budget:
                self._too_large(needed, lost_from, now)
            return
        if not self._send(link, message, seq):
            return
        self._start_at = self._flight.sent
        self._flush(link)
        if resync_only:
            self._resync_backoff.take(now)
            self._resynced_at = now
        self.stats.events_lost += lost
        self._lost_from = None
        self._resync = False
        self._cursor.skip_to(seq)  # the open batch is in the snapshot
        self._snapshot_backoff.reset()

    def _too_large(self, needed: int, lost_from: int, now: float) -> None:
        """A snapshot that cannot fit the budget: stay in (or enter) the
        outage, say once what the budget needs, and try again later."""
        delay = self._snapshot_backoff.take(now)
        if self._lost_from is None:  # a resync's: the warning below says it
            self._lost_from = lost_from
            self.stats.outages += 1
        if not self._warned_snapshot:
            self._warned_snapshot = True
            advice = max(LOG_BUDGET_MIN_MIB, math.ceil(2 * needed / _MIB))
            self._warn(f"event log: the state snapshot needs {needed} bytes, more than the "
                       f"hand-off budget ({self._budget} bytes): set {BUDGET_KEY} to at "
                       f"least {advice:g}; until then the log stays in its outage (events "
                       f"counted), tried again after {delay:g} s, doubling")

    def _outage(self, first_seq: int, why: str, *, cause: str = "") -> None:
        """Events from ``first_seq`` on do not reach the recorder; the first
        loss of an outage warns once, with ``why`` (not again for a ``cause``
        already warned about since a recorder last started)."""
        if self._lost_from is not None:
            self._lost_from = min(self._lost_from, first_seq)
            return
        self._lost_from = first_seq
        self.stats.outages += 1
        if cause:
            if cause in self._warned_causes:
                return
            self._warned_causes.add(cause)
        self._warn(f"event log: {why or 'the recorder is gone'}; serving continues, the "
                   "events are counted and the log records them as a GAP when recording "
                   "resumes")
