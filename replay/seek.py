"""Seeking in a run: replay only the segments a question needs.

A run is a sequence of *segments* (``logfiles.segments``: each starts with
a snapshot or the run's header, and may end with a trusted INDEX naming the
token steps it spans and every request id its events name). A segment
without a trusted index is *unindexed*: :func:`mentions` decodes it (no
replay) to see whether it names a request.

:func:`explain_request` replays from the snapshot of the first segment that
names the request, through the last one, and on until the core holds
nothing of the request (no record, no batch) and the observer nothing in
flight; decisions about a request only follow its own events, so the story
equals a replay from event 0. :func:`replay_at_step` replays from the
latest segment starting before a token step to the end of that step.
Where no segment can be started from (no snapshot restores, no index at
all), both replay from the beginning and say so in ``notes``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from logfiles.runs import run_files
from logfiles.scan import Entry, LogDamage, read_file
from logfiles.segments import Segment, segments
from offload_fsm.log.compact import requests_of
from offload_fsm.log.records import Header, Inputs, Snapshot
from offload_fsm.log.wire import to_wire
from offload_fsm.state import State
from replay.runner import Observer, ReplayResult, _Fold, replay

__all__ = ["explain_request", "mentions", "replay_at_step", "replay_from"]


def mentions(segment: Segment, req_id: str, following: Segment | None) -> bool:
    """Whether the segment's events name ``req_id`` (its index, else decoded;
    damage counts as a yes: the events lost there are unknown)."""
    if segment.index is not None:
        return segment.index.requests is None or req_id in segment.index.requests
    for entry in read_file(segment.path, start_offset=segment.offset):
        if following is not None and following.path == segment.path and \
                entry.offset >= following.offset:
            return False
        if isinstance(entry, LogDamage):
            return True
        record = entry.record
        if type(record) is Inputs:
            assert isinstance(record, Inputs)
            if any(req_id in requests_of(to_wire(event)) for event in record.events):
                return True
    return False  # the file ended: the whole segment was read


def replay_from(run: list[Path], start: Segment, observer: Observer | None,
                 until: Callable[[_Fold], bool], *, check_snapshots: bool = False
                 ) -> ReplayResult | None:
    """Fold from ``start`` until ``until(fold)`` holds after a record; None
    when folding could not start there. ``check_snapshots``: as :func:`replay`'s."""
    fold = _Fold(observer, check_snapshots=check_snapshots)
    files = run[run.index(start.path):]
    for number, file in enumerate(files):
        entries = read_file(file, start_offset=start.offset if number == 0 else 0)
        for entry in entries:
            fold.take(entry)
            if isinstance(entry, LogDamage):
                continue
            record = entry.record
            if number == 0 and start.offset:
                if type(record) is Header:
                    fold.stop("seeking to a snapshot")  # the snapshot next restores the state
                elif type(record) is Snapshot and not fold.result.snapshots_loaded:
                    return None  # it did not restore: no seeking here
            if until(fold):
                fold.finish()
                return fold.result
    fold.finish()
    return fold.result


def _holds(state: State | None, req_id: str) -> bool:
    if state is None:
        return False
    return req_id in state.requests or any(
        batch.req.req_id == req_id for batch in state.batches.values())


def explain_request(path: str | os.PathLike[str], prefix: str | None, req_id: str,
                    observer: Any, notes: list[str]) -> ReplayResult:
    """:func:`replay.runner.replay` with ``observer`` (an ``ExplainObserver``),
    started and stopped as the index allows (see the module docstring)."""
    run = run_files(path, prefix)
    damage: list[LogDamage] = []
    found = segments(path, prefix, damage)
    if not any(segment.index is not None for segment in found):
        notes.append("no usable index in the log: replayed from the beginning")
        return replay(path, prefix=prefix, observer=observer)
    hits = [number for number, segment in enumerate(found)
            if mentions(segment, req_id, found[number + 1] if number + 1 < len(found)
                        else None)]
    if not hits:
        return ReplayResult(header=_first_header(run), damage=damage)
    last_end = found[hits[-1]].end_seq

    def until(fold: _Fold) -> bool:
        if last_end < 0 or fold.next_seq < last_end or _holds(fold.state, req_id):
            return False
        return not any(op.status in ("buffered", "selected", "submitted")
                       for op in observer.ops)

    result = replay_from(run, found[hits[0]], observer, until)
    if result is None:
        notes.append(f"the snapshot before event {found[hits[0]].seq} does not restore: "
                     "replayed from the beginning")
        observer.__init__(req_id, verbose=observer.verbose)
        return replay(path, prefix=prefix, observer=observer)
    return _with(result, damage)


def _with(result: ReplayResult, damage: list[LogDamage]) -> ReplayResult:
    """``result`` with the damage of the whole run (the scan's and its own),
    in run order, as a replay from the beginning reports it."""
    seen = {(d.path, d.offset) for d in result.damage}
    result.damage.extend(d for d in damage if (d.path, d.offset) not in seen)
    return result


def replay_at_step(path: str | os.PathLike[str], prefix: str | None, step_index: int,
                   observer: Observer, notes: list[str]) -> ReplayResult:
    """Fold from the latest segment starting before token step ``step_index``
    until the state is past it. (A snapshot is taken at a step's end, its
    ``StepScheduled`` already applied: a segment whose ``first_step`` is N
    starts inside step N, so step N needs an earlier one; the run's start
    is before step 0's first event.)"""
    run = run_files(path, prefix)
    damage: list[LogDamage] = []
    found = [s for s in segments(path, prefix, damage)
             if 0 <= s.first_step < step_index or (s.seq == 0 and s.first_step == 0)]
    if not found:
        notes.append("no indexed segment starts at or before that step: replayed from the "
                     "beginning")
        return replay(path, prefix=prefix, observer=observer)
    result = replay_from(run, found[-1], observer,
                          lambda fold: fold.state is not None
                          and fold.state.step_index > step_index)
    if result is None:
        notes.append(f"the snapshot before event {found[-1].seq} does not restore: replayed "
                     "from the beginning")
        return replay(path, prefix=prefix, observer=observer)
    return _with(result, damage)


def _first_header(run: list[Path]) -> Header | None:
    for entry in read_file(run[0]):
        if isinstance(entry, Entry) and type(entry.record) is Header:
            return entry.record
        break
    return None
