"""What the hand-off holds towards one recorder: the link, the bookkeeping, backoff.

Contract: no I/O of its own. :class:`Link` is what the hand-off needs of a
recorder process and its socket (``connector.handoff.supervisor`` gives the
real one; tests give fakes); :data:`FRAME_BYTES` and :func:`growth` are what
the hand-off's byte budget charges beyond a message's own bytes;
:class:`InFlight` counts the bytes held against the budget;
:class:`Backoff` is the doubling delay of restarts, resyncs and snapshots
too large for the budget; :class:`HandoffStats` the counters ``/metrics``
reads.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from typing import Any, Final, Protocol

import attrs

from connector.background import name_this_thread, yield_to_serving

__all__ = ["FRAME_BYTES", "Backoff", "HandoffStats", "InFlight", "Link", "growth", "io_loop"]

EXIT_UNSAID: Final = -1  # a recorder that ended without telling its exit code: a signal
# What one frame's bookkeeping is charged against the budget: the hand-off's
# entry for it (a tuple of two ints in a deque: about 130 bytes) and
# ZeroMQ's (a 64-byte message slot in its pipe and the allocation's header).
FRAME_BYTES: Final = 512
IO_THREAD_NAME: Final = "lazy-handoff-io"  # the I/O thread's name to the OS (top -H)


class Link(Protocol):
    """One recorder process and the socket to it (``connector.handoff.supervisor``)."""

    def send(self, message: bytes) -> bool:
        """Append ``message`` to the open frame (nothing reaches ZeroMQ before
        :meth:`flush`). False if it could not be taken."""

    def flush(self) -> bool:
        """Hand the open frame to ZeroMQ as one message, without blocking;
        False if it could not be (its messages are lost)."""

    def replies(self) -> list[tuple[Any, ...]]:
        """The recorder's messages that arrived, without blocking."""

    def exit_code(self) -> int | None:
        """None while the process runs; then its exit code, or
        :data:`EXIT_UNSAID` when it ended without one (killed)."""

    def close(self) -> None:
        """Drop the socket (unsent messages are lost) and let the process go."""


@attrs.define(kw_only=True)
class HandoffStats:
    """Counters for ``/metrics`` and the log lines."""

    events_lost: int = 0  # numbered but never confirmed in the recorder's hands
    outages: int = 0
    recorder_restarts: int = 0
    bytes_in_flight: int = 0  # held against the budget: unacknowledged bytes and bookkeeping
    bytes_in_flight_max: int = 0


@attrs.define(kw_only=True)
class Backoff:
    """A delay that doubles from ``min_s`` up to ``max_s`` each time it is
    taken, and is due again ``delay_s`` after that."""

    min_s: float
    max_s: float
    delay_s: float = attrs.field(default=attrs.Factory(lambda self: self.min_s,
                                                       takes_self=True))
    due_at: float = 0.0

    def take(self, now: float) -> float:
        """Wait the current delay from ``now`` (returned), double the next."""
        delay = self.delay_s
        self.due_at = now + delay
        self.delay_s = min(delay * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self.delay_s = self.min_s




def growth(size: int) -> int:
    """What a message of ``size`` bytes adds to the count: its bytes and an
    eighth, the open frame's buffer's room to grow."""
    return size + size // 8


class InFlight:
    """What one link holds against the budget: the bytes handed over
    (``sent``: the open frame's included), handed to ZeroMQ (``flushed``)
    and acknowledged by the recorder (``acked``), as running totals; for
    each frame handed to ZeroMQ and not yet acknowledged, the total after
    it and its first event's ``seq``; the open frame's first ``seq``."""

    __slots__ = ("acked", "flushed", "frames", "open_first", "sent")

    def __init__(self) -> None:
        self.sent = 0
        self.flushed = 0
        self.acked = 0
        self.frames: deque[tuple[int, int]] = deque()
        self.open_first: int | None = None

    @property
    def held_bytes(self) -> int:
        """What counts against the budget (``connector.handoff``): the
        unacknowledged bytes, each frame's bookkeeping, and the open frame's
        buffer (over-allocated by an eighth at most)."""
        held = self.sent - self.acked + len(self.frames) * FRAME_BYTES
        if self.open_first is not None:
            held += FRAME_BYTES + (self.sent - self.flushed) // 8
        return held

    def fits(self, size: int, budget_bytes: int) -> bool:
        """Whether a message of ``size`` bytes keeps what is held within ``budget_bytes``."""
        opening = FRAME_BYTES if self.open_first is None else 0
        return self.held_bytes + opening + growth(size) <= budget_bytes

    def take(self, size: int, first_seq: int) -> int:
        """A message of ``size`` bytes (events from ``first_seq``) joined the
        open frame; returns the open frame's size."""
        self.sent += size
        if self.open_first is None:
            self.open_first = first_seq
        return self.sent - self.flushed

    def flushed_frame(self, handed: bool) -> None:
        """The open frame went to ZeroMQ (``handed``), or was refused (its
        bytes, never sent, leave the count)."""
        if handed:
            self.frames.append((self.sent, self.open_first if self.open_first is not None
                                else 0))
            self.flushed = self.sent
        else:
            self.sent = self.flushed
        self.open_first = None

    def acknowledge(self, total_bytes: int) -> None:
        """The recorder has taken ``total_bytes`` in, in all."""
        self.acked = acked = max(self.acked, total_bytes)
        frames = self.frames
        while frames and frames[0][0] <= acked:
            frames.popleft()

    def first_unacknowledged(self) -> int | None:
        """The first event not acknowledged (a frame's, or the open frame's)."""
        return self.frames[0][1] if self.frames else self.open_first


def exit_cause(code: int) -> tuple[str, str]:
    """A dead recorder's cause (warned once per cause) and what to say of it."""
    if code == EXIT_UNSAID:
        return "killed", "the recorder process was killed (it said no exit code)"
    return f"exit {code}", f"the recorder process exited (code {code})"


def io_loop(ref: weakref.ref[Any], period_s: float) -> None:
    """The I/O thread's loop over a hand-off (``Handoff.io_turn``); it ends
    with its hand-off (closed, or gone)."""
    name_this_thread(IO_THREAD_NAME)
    yield_to_serving()  # nobody waits on this thread (connector.background)
    period_s = max(period_s, 0.001)
    while True:
        time.sleep(period_s)
        handoff = ref()
        if handoff is None or handoff._closed:
            return
        handoff.io_turn()
        del handoff
