"""Re-running the core on a recorded log, and the first divergence.

:func:`replay` reads a run (:mod:`replay.reader`), builds a fresh state from
the first header (config, world size), and folds every recorded event through
:func:`offload_fsm.machine.step`, comparing each outcome with its recorded
check and the state with every DIGEST and END record. It stops folding at
the first divergence, the first lost event (a GAP record, a hole in ``seq``)
or the first damaged span, because the state after lost inputs is unknown;
it keeps reading to the end so that every damage is reported.

An ``observer(seq, event, outcome, state)`` sees every applied event; the
analyses (explain, summary, timeline) are observers. The state passed to it
is live: read it, never keep or mutate it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import attrs

from offload_fsm.codec import state_digest
from offload_fsm.config import OffloadConfig, parse_config
from offload_fsm.errors import InvalidEvent, MachinePoisoned
from offload_fsm.events import Event
from offload_fsm.logformat import (
    Digest,
    End,
    Gap,
    Header,
    Inputs,
    outcome_check,
    outcome_wire,
    wire_check,
)
from offload_fsm.machine import Outcome, step
from offload_fsm.state import State, new_state
from replay.reader import LogDamage, read_log

Observer = Callable[[int, Event, Outcome, State], None]


@attrs.frozen(kw_only=True)
class Divergence:
    """``kind``: ``outcome`` (decisions/commands differ), ``digest`` (state
    differs), ``invalid_event`` (the core refused a recorded event)."""

    seq: int
    kind: str
    event: Event | None
    expected: Any
    got: Any
    detail: str


@attrs.define(kw_only=True)
class ReplayResult:
    header: Header | None = None
    state: State | None = None
    events_applied: int = 0
    records: int = 0
    digests_checked: int = 0
    divergence: Divergence | None = None
    damage: list[LogDamage] = attrs.Factory(list)
    lost: list[str] = attrs.Factory(list)  # gaps in the event sequence
    stopped: str = ""  # why folding stopped early ("" = it reached the end)
    ended_cleanly: bool = False

    @property
    def ok(self) -> bool:
        return self.divergence is None and not self.damage and not self.lost


def config_of(header: Header) -> OffloadConfig:
    return parse_config(header.config)


def replay(
    path: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    observer: Observer | None = None,
) -> ReplayResult:
    """Fold the run at ``path``; see the module docstring."""
    result = ReplayResult()
    state: State | None = None
    folding = True
    next_seq = 0
    check_of = outcome_check
    step_ = step
    for entry in read_log(path, prefix):
        if isinstance(entry, LogDamage):
            result.damage.append(entry)
            if folding:
                folding = False
                result.stopped = f"damaged record: {entry.describe()}"
            continue
        result.records += 1
        record = entry.record
        kind = type(record)
        if not folding:
            if kind is End:
                result.ended_cleanly = True
            continue
        if kind is Inputs:
            assert isinstance(record, Inputs)
            if state is None:
                folding = False
                result.stopped = "events before any header"
                continue
            if record.seq != next_seq:
                folding = False
                message = f"events {next_seq}..{record.seq - 1} are missing"
                result.lost.append(message)
                result.stopped = message
                continue
            seq = record.seq
            for event, check in zip(record.events, record.checks, strict=True):
                try:
                    outcome = step_(state, event)
                except (InvalidEvent, MachinePoisoned) as error:
                    result.divergence = Divergence(seq=seq, kind="invalid_event", event=event,
                                                   expected="accepted", got=str(error),
                                                   detail=str(error))
                    break
                if type(check) is int:
                    got_check = check_of(outcome)
                    if got_check != check:
                        result.divergence = Divergence(
                            seq=seq, kind="outcome", event=event,
                            expected=f"check {check:#010x}",
                            got=f"check {got_check:#010x}: {outcome_wire(outcome)!r}",
                            detail="the recorded outcome check differs",
                        )
                elif wire_check(check) != check_of(outcome):  # type: ignore[arg-type]
                    result.divergence = Divergence(
                        seq=seq, kind="outcome", event=event, expected=check,
                        got=outcome_wire(outcome), detail="the recorded outcome differs",
                    )
                if observer is not None:
                    observer(seq, event, outcome, state)
                if result.divergence is not None:
                    break
                seq += 1
            result.events_applied += seq - record.seq
            next_seq = seq
            if result.divergence is not None:
                folding = False
                result.stopped = f"divergence at seq {result.divergence.seq}"
        elif kind is Digest or kind is End:
            assert isinstance(record, Digest | End)
            if kind is End:
                result.ended_cleanly = True
            if state is None or not record.digest:
                continue
            got = state_digest(state)
            result.digests_checked += 1
            if got != record.digest:
                result.divergence = Divergence(
                    seq=record.seq, kind="digest", event=None, expected=record.digest, got=got,
                    detail=f"state digest after event {record.seq} differs",
                )
                folding = False
                result.stopped = f"divergence at seq {record.seq}"
        elif kind is Header:
            assert isinstance(record, Header)
            if result.header is None:
                result.header = record
                state = new_state(config_of(record), world_size=record.world_size)
                result.state = state
                next_seq = record.seq
                if record.seq != 0:
                    folding = False
                    result.stopped = (f"the run starts at event {record.seq}: "
                                      "earlier files are missing")
            elif record.seq != next_seq:
                folding = False
                message = f"file {record.file_index} starts at event {record.seq}, " \
                          f"expected {next_seq}"
                result.lost.append(message)
                result.stopped = message
        elif kind is Gap:
            assert isinstance(record, Gap)
            message = f"{record.lost_count} record(s) lost by the writer before event {record.seq}"
            result.lost.append(message)
            folding = False
            result.stopped = message
    if result.header is None and not result.stopped:
        result.stopped = "no header record"
    return result
