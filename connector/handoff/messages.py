"""The hand-off's protocol: what the engine sends its recorder and what it answers.

Both processes import this module and nothing else of each other's, so the
message kinds, the protocol version and the state summary they compare have
one definition.

Messages (msgpack arrays, several back to back in one ZeroMQ frame):

======  =====================================================================
kind    fields
======  =====================================================================
START   ``seq, wall_s, lost_events, snapshot, protocol`` (``snapshot`` None:
        a fresh state at seq 0; ``protocol``: :data:`PROTOCOL`, which the
        recorder must speak or refuse)
STEP    ``seq, wall_s, summary, callbacks``: one batch (``log.cursor``), each
        callback a flat list ``[event_wire, recorded, ...]``; ``summary``
        (:func:`state_summary`) where a digest is due, else None
REJECT  ``seq, wall_s, callback, event_wire, reason``: the poison path; the
        callback's events from ``seq`` applied, the next one was rejected
END     ``seq, wall_s, summary, lost_from``: ``summary`` None when the state
        is not worth a digest; ``lost_from`` the first event of an outage
        still open (None: none)
======  =====================================================================

The recorder answers ACK ``(ACK, bytes_total, stats)`` (what it has taken
in, in bytes, and about once a second its writer's counters); RESYNC when
its fold disagreed with a recorded outcome (a later batch boundary sends a
START with a snapshot of the live state); FAILED ``(FAILED, cause, text)``
just before it exits because it cannot record (``text`` says why and the
fix; ``cause`` is what repeats).
"""

from __future__ import annotations

import enum
from typing import Any, Final

from offload_fsm.state import State

__all__ = ["PROTOCOL", "Message", "Reply", "state_summary"]

PROTOCOL: Final = 2  # the messages below; START carries it, the recorder refuses another


class Message(enum.IntEnum):
    """What the engine sends (the first item of each message)."""

    START = 1
    STEP = 2
    REJECT = 3
    END = 4


class Reply(enum.IntEnum):
    """What the recorder answers (the first item of each reply)."""

    ACK = 1
    RESYNC = 2
    FAILED = 3


def state_summary(state: State) -> tuple[Any, ...]:
    """An O(1) summary of ``state`` (sizes, id counters, counters), which the
    recorder's fold must match at the same ``seq``: a live state changed
    outside ``step`` shows."""
    return (state.step_index, state.next_op_id, state.next_batch_id, len(state.requests),
            len(state.batches), len(state.pins), len(state.stored_keys),
            state.stored_keys_xor, state.free_blocks, state.closed,
            tuple(state.counters.values()))
