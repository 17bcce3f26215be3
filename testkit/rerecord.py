"""Record a kept log's events again, through today's core and recorder.

A log recorded from the real scheduler (``tests/data/sim_logs``) has what a
synthetic workload lacks: prefix-cache hits re-offering a shared prompt,
windows of hundreds of blocks. :func:`rerecord` folds its events through a
fresh core and hands each outcome to a :class:`~connector.recording.EventRecorder`,
so the current log format is exercised on real shapes (tests, and the
golden log of a schema version: ``tests/data/make_golden.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from offload_fsm import new_state
from offload_fsm.log.records import Header, Inputs
from offload_fsm.machine import step
from offload_fsm.state import State
from replay.reader import Entry, read_log
from replay.runner import config_of


def rerecord(source: Path, make_recorder: Callable[[Header], Any], *,
             limit_events: int | None = None) -> tuple[Any, State, int]:
    """Fold the events of the log at ``source`` (at most ``limit_events``)
    into a fresh state, recording each with ``make_recorder(header)``'s
    recorder; returns the recorder (not closed), the state and the count."""
    recorder: Any = None
    state: State | None = None
    count = 0
    for entry in read_log(source):
        if not isinstance(entry, Entry):
            raise ValueError(f"{source}: damaged ({entry.describe()})")
        record = entry.record
        if isinstance(record, Header) and recorder is None:
            recorder = make_recorder(record)
            state = new_state(config_of(record), world_size=record.world_size)
        if not isinstance(record, Inputs) or state is None:
            continue
        for event in record.events:
            if limit_events is not None and count >= limit_events:
                return recorder, state, count
            recorder.record([(event, step(state, event))], state)
            count += 1
    if state is None:
        raise ValueError(f"{source}: no header")
    return recorder, state, count
