"""``replay diff``'s decision split: where two logs' decisions first part,
by this code.

Contract: :func:`first_decision` replays both logs (from event 0, through
``replay.seek`` where the run starts with a segment, else from the
beginning) and hashes, per observation (an observation and the answers it
led to), the decisions taken; the first observation whose hashes differ, in
the first :data:`DECISION_WINDOW`, is replayed again on both sides to show
the event and the decisions briefly (:class:`DecisionSplit`). Counting
observations, not events, lines the two runs up where their commands, and
so their answers, differ in number.
"""

from __future__ import annotations

import os
from typing import Final

import attrs

from logfiles.runs import run_files
from logfiles.segments import segments
from offload_fsm.state import State
from offload_fsm.vocabulary.events import OBSERVATION_TYPES, Event
from offload_fsm.vocabulary.outcome import Outcome
from replay import seek
from replay.brief import brief
from replay.runner import replay

__all__ = ["DECISION_WINDOW", "DecisionSplit", "first_decision"]


@attrs.define(kw_only=True)
class DecisionSplit:
    """The first observation after which the two logs' decisions differ
    (its own and those of the answers it led to), counted among the
    observations (answers differ in number when the commands do): where each
    log holds it, the observation as each log recorded it, and the
    decisions of each side, briefly."""

    observation: int
    seq_a: int
    seq_b: int
    event_a: str
    event_b: str
    decisions_a: list[str]
    decisions_b: list[str]


class _Decisions:
    """Per observation (an observation and the answers it led to), a hash
    of the decisions taken: for the first ``limit`` observations, or, with
    ``show``, the briefs of observation ``show`` (then it stops)."""

    def __init__(self, limit: int, show: int = -1) -> None:
        self.limit = limit
        self.show = show
        self.hashes: list[int] = []
        self.current: list[str] = []
        self.seqs: list[int] = []
        self.events: list[str] = []
        self.briefs: list[str] = []
        self.done = False

    def __call__(self, seq: int, event: Event, outcome: Outcome, state: State) -> None:
        if type(event) in OBSERVATION_TYPES:
            self._close()
            if self.done:
                return
            self.seqs.append(seq)
            if len(self.seqs) - 1 == self.show:
                self.events.append(brief(event))
        if len(self.seqs) - 1 == self.show:
            self.briefs += [brief(decision) for decision in outcome.decisions]
        self.current += [repr(decision) for decision in outcome.decisions]

    def _close(self) -> None:
        if self.seqs:
            self.hashes.append(hash(tuple(self.current)))
        self.current = []
        if len(self.hashes) >= self.limit or 0 <= self.show < len(self.hashes):
            self.done = True

    def finish(self) -> None:
        if not self.done:
            self._close()


DECISION_WINDOW: Final = 1 << 20  # observations compared for the first differing decision


def first_decision(a_path: str | os.PathLike[str], b_path: str | os.PathLike[str],
                   prefix_a: str | None, prefix_b: str | None) -> DecisionSplit | None:
    """Replay both logs (this code) and find the first observation whose
    decisions differ (:class:`DecisionSplit`); None when none does in the
    first :data:`DECISION_WINDOW` observations."""
    def run(path: str | os.PathLike[str], prefix: str | None, observer: _Decisions) -> None:
        first = segments(path, prefix)
        if first and first[0].seq == 0:
            seek.replay_from(run_files(path, prefix), first[0], observer,
                             lambda fold: observer.done)
        else:
            replay(path, prefix=prefix, observer=observer)
        observer.finish()

    a, b = _Decisions(DECISION_WINDOW), _Decisions(DECISION_WINDOW)
    run(a_path, prefix_a, a)
    run(b_path, prefix_b, b)
    at = next((n for n, (x, y) in enumerate(zip(a.hashes, b.hashes)) if x != y),  # noqa: B905
              None)
    if at is None:
        return None
    shown_a, shown_b = _Decisions(DECISION_WINDOW, show=at), _Decisions(DECISION_WINDOW, show=at)
    run(a_path, prefix_a, shown_a)
    run(b_path, prefix_b, shown_b)
    return DecisionSplit(observation=at, seq_a=a.seqs[at], seq_b=b.seqs[at],
                         event_a=shown_a.events[0] if shown_a.events else "",
                         event_b=shown_b.events[0] if shown_b.events else "",
                         decisions_a=shown_a.briefs, decisions_b=shown_b.briefs)
