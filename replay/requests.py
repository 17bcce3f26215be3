"""Request ids of a run: list them, resolve what an operator typed, find the
run that holds one, and say what became of each request.

* :func:`request_ids`: every id the run's events name, in first-seen order;
  from the segment indexes when every segment has a trusted one (no event is
  decoded), else by decoding the events (no replay).
* :func:`resolve`: an exact id, or the one id a typed prefix starts; else a
  :class:`~replay.usage.UsageError` that says "did you mean" with the
  closest ids (or lists the ids the prefix is ambiguous between).
* :func:`run_holding`: in a directory of several runs, the one run whose
  ids resolve the typed text (an error names every run that does, or the
  closest ids of them all when none does).
* :class:`OutcomeObserver` and :func:`outcomes`: per request, its ops by
  final status and drop cause, and the tokens it lost (``replay requests``).
"""

from __future__ import annotations

import difflib
import os
from collections import Counter as Tally
from typing import Any

from logfiles.runs import run_prefixes
from logfiles.scan import Entry, read_log
from logfiles.segments import segments
from offload_fsm.log.compact import requests_of
from offload_fsm.log.records import Inputs
from offload_fsm.log.wire import to_wire
from offload_fsm.state import State
from offload_fsm.vocabulary.events import CandidateOffered, Event, RequestPreempted
from offload_fsm.vocabulary.outcome import Outcome
from replay.opstory import OpTracker
from replay.text import field
from replay.usage import UsageError

SUGGESTIONS = 5  # ids offered after "did you mean"
AMBIGUOUS_SHOWN = 8  # ids listed for an ambiguous prefix


def request_ids(path: str | os.PathLike[str], prefix: str | None = None) -> list[str]:
    """Every request id the run names, in first-seen order (see the module
    docstring)."""
    found = segments(path, prefix)
    if found and all(s.index is not None and s.index.requests is not None for s in found):
        ids: dict[str, None] = {}
        for segment in found:
            assert segment.index is not None and segment.index.requests is not None
            ids.update(dict.fromkeys(segment.index.requests))
        return list(ids)
    seen: dict[str, None] = {}
    for entry in read_log(path, prefix):
        if isinstance(entry, Entry) and type(entry.record) is Inputs:
            for event in entry.record.events:
                seen.update(dict.fromkeys(requests_of(to_wire(event))))
    return list(seen)


def _matches(ids: list[str], text: str) -> list[str]:
    if text in ids:
        return [text]
    return [req_id for req_id in ids if req_id.startswith(text)]


def _suggest(ids: list[str], text: str) -> list[str]:
    """The ids closest to ``text``: containing it first, then by likeness."""
    containing = [req_id for req_id in ids if text and text in req_id]
    close = difflib.get_close_matches(text, ids, n=SUGGESTIONS, cutoff=0.4)
    return list(dict.fromkeys(containing + close))[:SUGGESTIONS]


def _miss(text: str, ids: list[str], where: str, log: str) -> UsageError:
    suggestions = _suggest(ids, text)
    hint = ("; did you mean " + ", ".join(field(s) for s in suggestions) + "?"
            if suggestions else f"; `replay requests {log}` lists its {len(ids)} ids")
    return UsageError(f"request {field(text)} does not appear in {where}{hint}")


def _ambiguous(text: str, matches: list[str]) -> UsageError:
    shown = ", ".join(field(m) for m in matches[:AMBIGUOUS_SHOWN])
    more = f" and {len(matches) - AMBIGUOUS_SHOWN} more" if len(matches) > AMBIGUOUS_SHOWN else ""
    return UsageError(f"request {field(text)} is ambiguous: {len(matches)} ids start with it "
                      f"({shown}{more}); type more of it")


def resolve(ids: list[str], text: str, where: str, log: str) -> str:
    """The id ``text`` names among ``ids`` (exactly, or as a unique prefix);
    ``where`` and ``log`` name the run in the error."""
    matches = _matches(ids, text)
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise _ambiguous(text, matches)
    raise _miss(text, ids, where, log)


def run_holding(path: str | os.PathLike[str], text: str) -> tuple[str | None, str]:
    """The run of ``path`` (its prefix; None for a file or a directory of one
    run) whose ids resolve ``text``, and the id."""
    runs = run_prefixes(path)
    if runs == [None]:
        return None, resolve(request_ids(path), text, str(path), str(path))
    holding: dict[str, list[str]] = {}
    every: list[str] = []
    for prefix in runs:
        assert prefix is not None
        ids = request_ids(path, prefix)
        every += ids
        matches = _matches(ids, text)
        if matches:
            holding[prefix] = matches
    if len(holding) == 1:
        ((prefix, matches),) = holding.items()
        if len(matches) > 1:
            raise _ambiguous(text, matches)
        return prefix, matches[0]
    if holding:
        raise UsageError(f"request {field(text)} is in {len(holding)} runs of {path} ("
                         + ", ".join(f"--prefix {field(p)}" for p in holding)
                         + "): pass one of them")
    raise _miss(text, every, f"any of the {len(runs)} runs of {path}", str(path))


class OutcomeObserver:
    """Follows every request's ops (``opstory.OpTracker``)."""

    def __init__(self) -> None:
        self.tracker = OpTracker(lambda _req_id: True)

    def __call__(self, seq: int, event: Event, outcome: Outcome, state: State) -> None:
        kind = type(event)
        if kind is CandidateOffered:
            assert isinstance(event, CandidateOffered)
            self.tracker.offered(seq, event, outcome, state)
        elif kind is RequestPreempted:
            assert isinstance(event, RequestPreempted)
            self.tracker.preempted(event.req_id)
        for decision in outcome.decisions:
            self.tracker.decided(decision, state)


def outcomes(observer: OutcomeObserver) -> list[dict[str, Any]]:
    """Per request, in first-offer order: its ops by status, its drops by
    cause, and the tokens lost (drops other than duplicates)."""
    rows = []
    for req_id, ops in observer.tracker.ops.items():
        statuses = Tally(op.status for op in ops)
        causes = Tally(op.cause for op in ops if op.status == "dropped")
        lost = sum(op.end_token - op.start_token for op in ops
                   if op.status == "dropped" and op.cause != "duplicate")
        rows.append({"req_id": req_id, "ops": len(ops), "statuses": dict(statuses),
                     "causes": dict(causes), "lost_tokens": lost})
    return rows


def row_causes(row: dict[str, Any]) -> set[str]:
    """What ``--cause`` matches of a row: its drop causes and its statuses."""
    return set(row["causes"]) | set(row["statuses"])


def format_row(row: dict[str, Any], width: int) -> str:
    parts = []
    for status, count in row["statuses"].items():
        if status == "dropped":
            causes = ", ".join(f"{c} {n}" if n > 1 else c for c, n in row["causes"].items())
            parts.append(f"dropped {count} ({causes})")
        else:
            parts.append(f"{status} {count}")
    lost = f"; lost {row['lost_tokens']} tokens" if row["lost_tokens"] else ""
    return f"{field(row['req_id']):<{width}}  {row['ops']:>3} ops: {', '.join(parts)}{lost}"
