"""Where records fall in a log: the rules every writer of a log keeps.

The connector's recorder and ``replay whatif``'s writer lay out their logs by
these rules, so two logs of the same inputs hold their INPUTS records and
their digests at the same ``seq`` and ``replay diff`` compares them record by
record.

* **Batches.** Events are numbered in the order they were applied; one INPUTS
  record carries a batch of them. A batch closes at the end of the record call
  whose events hold a ``StepScheduled`` or a ``StepsPassed`` (one scheduler step,
  or one run of passed steps, per record), or once it holds
  :data:`BATCH_EVENTS` events (:data:`STEP_TYPES`; ``log.cursor.LogCursor.add``
  keeps the rule).
* **Digests.** The first digest is due after ``digest_every`` events; after
  one at event ``end``, the next is due at least ``digest_every`` events on,
  and at least :data:`DIGEST_EVENTS_PER_LIVE` events per live request and
  batch, since a digest walks the whole state: so its cost stays O(1) per
  event (:func:`next_digest_seq`). ``digest_every`` 0 turns digests off.
"""

from __future__ import annotations

from typing import Final

from offload_fsm.state import State
from offload_fsm.vocabulary.events import StepScheduled, StepsPassed

__all__ = ["BATCH_EVENTS", "DIGEST_EVENTS_PER_LIVE", "STEP_TYPES", "first_digest_seq",
           "next_digest_seq"]

BATCH_EVENTS: Final[int] = 256
DIGEST_EVENTS_PER_LIVE: Final[int] = 64
STEP_TYPES: Final = frozenset((StepScheduled, StepsPassed))
"""The events whose record call ends a batch (one scheduler step, or one run of passed steps)."""


def first_digest_seq(digest_every: int) -> int:
    """The ``seq`` at which the first digest is due; -1: never."""
    return digest_every if digest_every > 0 else -1


def next_digest_seq(end: int, digest_every: int, state: State) -> int:
    """The next digest's due ``seq``, after one taken when ``end`` events
    were recorded, of ``state`` as it was then."""
    live = len(state.requests) + len(state.batches)
    return end + max(digest_every, DIGEST_EVENTS_PER_LIVE * live)
