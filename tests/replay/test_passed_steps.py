"""Passed steps fold to the same state as the steps they stand for: a log
recorded from the real scheduler, with every step the shell would pass today
carried in ``StepsPassed`` (``testkit.rerecord``), ends in the state, digest
and counters of the same log folded step by step; and a ``StepsPassed`` the
state contradicts is rejected naming why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from offload_fsm import new_state
from offload_fsm.digest import state_digest
from offload_fsm.machine import step
from offload_fsm.state import State
from offload_fsm.vocabulary.config import OffloadConfig, Policy
from offload_fsm.vocabulary.errors import InvalidEvent
from offload_fsm.vocabulary.events import StepsPassed
from testkit.rerecord import rerecord

SIM_LOGS = Path(__file__).resolve().parents[1] / "data" / "sim_logs"


class _Kept:
    def __init__(self) -> None:
        self.events: list[Any] = []

    def record(self, applied: list[tuple[Any, Any]], state: State) -> None:
        self.events.extend(event for event, _ in applied)


@pytest.mark.parametrize("name", ["sim-ea-2", "sim-ea-3"])
def test_a_log_with_its_quiet_steps_passed_ends_in_the_same_state(name: str) -> None:
    _, stepwise, _ = rerecord(SIM_LOGS / name, lambda header: _Kept())
    kept, passing, _ = rerecord(SIM_LOGS / name, lambda header: _Kept(),
                                pass_quiet_steps=True)
    runs = [e for e in kept.events if isinstance(e, StepsPassed)]
    assert runs, "the real scheduler's log has quiet steps"
    assert sum(len(run.steps) for run in runs) > 10 * len(runs) / 2
    assert state_digest(passing) == state_digest(stepwise)
    assert passing.counters == stepwise.counters


def _ea() -> State:
    return new_state(OffloadConfig(policy=Policy.EVICTION_AWARE), world_size=1)


def test_a_passed_step_must_have_the_windows_length() -> None:
    state = _ea()
    step(state, StepsPassed(steps=((16, 4, 4, 0, 100, 0, 1.0),)))  # nothing buffered: 0
    with pytest.raises(InvalidEvent, match="window blocks, expected 0"):
        step(_ea(), StepsPassed(steps=((16, 4, 4, 0, 100, 3, 1.0),)))


@pytest.mark.parametrize("steps, why", [
    ((), "0 passed steps"),
    (((0, 4, 4, 0, 100, 0, 1.0),), "count out of range"),
    (((16, -1, 4, 0, 100, 0, 1.0),), "count out of range"),
    (((16, 4, 4, 0, 100, 0, 2.0), (16, 4, 4, 0, 100, 0, 1.0)), "time went back"),
    (((16, 4, 4, 0, 100, 0),), "of 6 fields"),
])
def test_a_malformed_run_is_rejected_naming_why(steps: Any, why: str) -> None:
    with pytest.raises(InvalidEvent, match=why):
        step(_ea(), StepsPassed(steps=steps))


def test_fifo_never_passes_a_step() -> None:
    state = new_state(OffloadConfig(policy=Policy.FIFO), world_size=1)
    with pytest.raises(InvalidEvent, match="FIFO"):
        step(state, StepsPassed(steps=((16, 4, 4, 0, 100, 0, 1.0),)))
