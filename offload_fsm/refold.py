"""Folding recorded events again, checking each decides what was recorded.

``replay verify`` folds a log's events into a fresh state and compares each
outcome with the log's record of it; the connector's recorder folds the
events it logs into a state of its own and compares each outcome with what
the live core decided. Both are :func:`refold`: one loop, one rule of what
"the same outcome" means (:func:`same_outcome`).

A recorded outcome comes in one of three forms: the outcome itself (the
recorder), its wire form ``[decisions, commands]`` (a log with full
outcomes), or its ``outcome_check`` (an ``int``, what a log keeps by
default). An outcome matches a check when their checks are equal: a CRC, so
a collision could hide a divergence; the digests recorded every so often
catch what a check misses.

The loop stops at the first event the core refuses (the error) or whose
outcome differs; the events before it are applied, that one too unless it
was refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from offload_fsm.log.wire import OutcomeWire, outcome_check, outcome_wire, wire_check
from offload_fsm.machine import step
from offload_fsm.state import State
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

__all__ = ["Mismatch", "Recorded", "refold", "same_outcome"]

Recorded = Outcome | OutcomeWire | int
Observer = Callable[[int, Event, Outcome, State], None]


@attrs.frozen(kw_only=True)
class Mismatch:
    """Where a refold stopped: event ``seq``, refused (``error``) or deciding
    ``outcome`` where ``recorded`` was recorded."""

    seq: int
    event: Event
    recorded: Recorded
    outcome: Outcome | None
    error: Exception | None


def same_outcome(outcome: Outcome, recorded: Recorded) -> bool:
    """Whether ``outcome`` is what ``recorded`` records (see the module docstring)."""
    kind = type(recorded)
    if kind is int:
        return outcome_check(outcome) == recorded
    if kind is Outcome:
        # Equal objects, or equal wire forms: a NaN field is != itself.
        return (recorded is outcome or recorded == outcome
                or outcome_wire(outcome) == outcome_wire(recorded))  # type: ignore[arg-type]
    return wire_check(recorded) == outcome_check(outcome)  # type: ignore[arg-type]


def refold(state: State, seq: int, recorded: Iterable[tuple[Event, Any]],
           observer: Observer | None = None) -> tuple[int, Mismatch | None]:
    """Apply each recorded (event, outcome) pair to ``state``, the first as
    event ``seq``; ``observer(seq, event, outcome, state)`` sees every applied
    event. Returns the ``seq`` after the last event that matched, and the
    mismatch that stopped the loop (None: every event matched)."""
    step_ = step
    check_of = outcome_check
    for event, expected in recorded:
        try:
            outcome = step_(state, event)
        except Exception as error:  # any refusal: StepFailed, MachinePoisoned, ...
            return seq, Mismatch(seq=seq, event=event, recorded=expected, outcome=None,
                                 error=error)
        if type(expected) is int:
            same = check_of(outcome) == expected
        else:
            same = same_outcome(outcome, expected)
        if observer is not None:
            observer(seq, event, outcome, state)
        if not same:
            return seq, Mismatch(seq=seq, event=event, recorded=expected, outcome=outcome,
                                 error=None)
        seq += 1
    return seq, None
