"""``explain --at STEP``: every event of one token step, from a replay.

:class:`StepObserver` keeps every event of token step ``step_index`` (from
its ``StepScheduled`` to the next), with what the core decided and
commanded, and the state after it; a step that passed inside a
``StepsPassed`` (nothing the core watches moved) is found there.
``replay.explain_text`` prints it.
"""

from __future__ import annotations

from typing import Any

from offload_fsm.state import State
from offload_fsm.vocabulary.events import Event, StepsPassed
from offload_fsm.vocabulary.outcome import Outcome
from replay.brief import brief

__all__ = ["StepObserver"]


class StepObserver:
    """Every event of token step ``step_index`` (see the module docstring)."""

    def __init__(self, step_index: int, *, verbose: bool = False) -> None:
        self.step_index = step_index
        self.verbose = verbose
        self.events: list[dict[str, Any]] = []
        self.after: dict[str, Any] = {}
        self.passed: tuple[int, int, int] | None = None  # (seq, first, last) of a quiet run
        self._before = -1  # state.step_index before the event

    def __call__(self, seq: int, event: Event, outcome: Outcome, state: State) -> None:
        before, self._before = self._before, state.step_index
        if type(event) is StepsPassed and before < self.step_index < state.step_index:
            self.passed = (seq, before + 1, state.step_index)  # the step passed inside it
        if state.step_index != self.step_index:
            return
        self.events.append({
            "seq": seq, "event": brief(event, self.verbose),
            "decisions": [brief(d, self.verbose) for d in outcome.decisions],
            "commands": [brief(c, self.verbose) for c in outcome.commands],
        })
        self.after = {
            "depth_blocks": state.depth_blocks, "requests": len(state.requests),
            "buffered_ops": sum(len(rec.ops) for rec in state.requests.values()),
            "batches_in_flight": len(state.batches), "pinned_blocks": len(state.pins),
        }

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step_index, "found": bool(self.events) or bool(self.passed),
                "events": self.events, "state_after": self.after,
                "passed": None if self.passed is None else list(self.passed)}
