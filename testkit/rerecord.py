"""Record a kept log's events again, through today's core and recorder.

A log recorded from the real scheduler (``tests/data/sim_logs``) has what a
synthetic workload lacks: prefix-cache hits re-offering a shared prompt,
windows of hundreds of blocks. :func:`rerecord` folds its events through a
fresh core and hands each outcome to a :class:`~connector.recorder.recording.EventRecorder`,
so the current log format is exercised on real shapes (tests, and the
golden log of a schema version: ``tests/data/make_golden.py``).

With ``pass_quiet_steps`` each recorded ``StepScheduled`` that the shell
would pass today (``queries.step_passes`` on the state before it) goes into a
``StepsPassed`` instead, reported before the next other event, as
``connector.shell.manager`` does: a log recorded before passed steps existed,
brought to today's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from logfiles.scan import Entry, read_log
from offload_fsm import new_state
from offload_fsm.log.records import Header, Inputs
from offload_fsm.machine import step
from offload_fsm.queries import step_passes
from offload_fsm.state import State
from offload_fsm.vocabulary.events import (
    MAX_STEPS_PASSED,
    Event,
    PassedStep,
    StepScheduled,
    StepsPassed,
)
from replay.runner import config_of


def rerecord(source: Path, make_recorder: Callable[[Header], Any], *,
             limit_events: int | None = None,
             pass_quiet_steps: bool = False) -> tuple[Any, State, int]:
    """Fold the events of the log at ``source`` (at most ``limit_events``)
    into a fresh state, recording each with ``make_recorder(header)``'s
    recorder; returns the recorder (not closed), the state and the count of
    events recorded."""
    recorder: Any = None
    state: State | None = None
    count = 0
    passed: list[PassedStep] = []

    def record(event: Event) -> None:
        nonlocal count
        assert state is not None
        recorder.record([(event, step(state, event))], state)
        count += 1

    def report_passed() -> None:
        if passed:
            record(StepsPassed(steps=tuple(passed)))
            passed.clear()

    for entry in read_log(source):
        if not isinstance(entry, Entry):
            raise ValueError(f"{source}: damaged ({entry.describe()})")
        kept = entry.record
        if isinstance(kept, Header) and recorder is None:
            recorder = make_recorder(kept)
            state = new_state(config_of(kept), world_size=kept.world_size)
        if not isinstance(kept, Inputs) or state is None:
            continue
        for event in kept.events:
            if limit_events is not None and count >= limit_events:
                report_passed()
                return recorder, state, count
            if pass_quiet_steps and isinstance(event, StepScheduled) and \
                    event.scheduled_tokens and step_passes(
                        state, window_block_ids=event.window_block_ids,
                        reallocated=event.reallocated, time_s=event.time_s):
                passed.append((event.scheduled_tokens, event.allocated_blocks,
                               event.next_step_blocks, event.reserve_blocks, event.free_blocks,
                               len(event.window_block_ids), event.time_s))
                if len(passed) == MAX_STEPS_PASSED:
                    report_passed()
                continue
            report_passed()
            record(event)
    report_passed()
    if state is None:
        raise ValueError(f"{source}: no header")
    return recorder, state, count
