"""``diff``: the first place two logs of the same inputs part, and how their
ledgers end.

Two runs fed the same observations (two versions of the project, two knob
settings, a run and its ``whatif --out`` re-run) record the same events with
the same outcome checks until the code's decisions part. :func:`diff_logs`
finds that first event in two passes:

1. **Bisect by digests.** One cheap pass over each log collects its state
   digests and an index of its INPUTS records (``replay.digests``; leading
   segments both logs close with the same INDEX key are not even inflated).
   Over the ``seq`` values both logs hold a digest for, a binary search
   finds the first pair that differs; the last equal one before it
   (``good``) bounds the search from below. This assumes states, once
   apart, stay apart (they do in practice: op and batch ids, counters and
   the EMA all drift); ``full=True`` walks from event 0 instead.
2. **Walk events.** From the file holding event ``good + 1`` (each file's
   header says its first event), both logs are decoded in lockstep and
   compared event by event: the input itself (``input``), then its outcome
   check or full outcome (``outcome``). If every event up to the differing
   digest matches, the divergence is that digest (``digest``); if one log
   stops first, ``length``. After an input divergence, the first decision
   that differs (``replay.decisions``).

At the divergence both sides are shown: the event, and each side's outcome
decoded when the log carries full outcomes (``full_outcomes`` header flag,
as ``whatif --out`` writes), else recomputed by replaying the one file that
holds it with this code (and marked as matching the recorded check or not),
else the check alone. Then the ledgers: each side's final counters, from a
replay of its last file only (which starts from that file's snapshot). Both
replays start from the file's last segment (snapshot) before the event or
the end (``replay.seek``).

Exit codes (``replay diff``): 0 identical, 1 diverged, 3 damage in either log.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import attrs

from logfiles.scan import Entry, LogDamage, read_file
from logfiles.segments import segments
from offload_fsm.log.records import Inputs
from offload_fsm.log.wire import from_wire, outcome_check, outcome_wire, wire_check
from offload_fsm.state import State
from offload_fsm.vocabulary.errors import LogCorrupt
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome
from replay import seek
from replay.brief import brief
from replay.decisions import DECISION_WINDOW, DecisionSplit, first_decision
from replay.digests import Chunk, Digests, equal_segments, scan_digests
from replay.runner import ReplayResult, replay
from replay.text import DETAIL_CHARS_MAX, field

__all__ = ["DiffResult", "Side", "diff_logs", "format_diff", "to_json"]

@attrs.frozen(kw_only=True)
class Side:
    """One log's side of the divergence."""

    event: Event | None
    check: Any  # int, an outcome in wire form, or None (the log stopped)
    outcome: str  # the outcome as text: decoded, recomputed, or the check
    digest: str = ""


@attrs.define(kw_only=True)
class DiffResult:
    identical: bool = True
    seq: int = -1
    kind: str = ""  # input, outcome, digest, length
    detail: str = ""
    a: Side | None = None
    b: Side | None = None
    walked_from: int = 0
    events_compared: int = 0
    common_digests: int = 0
    counters_a: dict[str, int] = attrs.Factory(dict)
    counters_b: dict[str, int] = attrs.Factory(dict)
    damage: list[str] = attrs.Factory(list)
    full: bool = False
    item_a: Any = None
    item_b: Any = None
    decision: DecisionSplit | None = None  # after an input divergence



def _first_differing(common: list[int], a: dict[int, str], b: dict[int, str]) -> int:
    """Index of the first common seq whose digests differ (binary search,
    assuming equal, equal, ..., differ, differ), len(common) if none."""
    lo, hi = 0, len(common)
    while lo < hi:
        mid = (lo + hi) // 2
        if a[common[mid]] == b[common[mid]]:
            lo = mid + 1
        else:
            hi = mid
    return lo


_Item = tuple[int, Event, Any]


class _Chunks:
    """Access to one log's INPUTS records by their index entry: a reader per
    file, reading on from the entry's segment start (compact forms decode
    only in order), reused while the entries come in order."""

    def __init__(self) -> None:
        # per file: the reader, and the (offset, index) of the last record it gave
        self.readers: dict[Path, tuple[Iterator[Entry | LogDamage], list[int]]] = {}

    def decode(self, chunk: Chunk) -> list[_Item]:
        path = Path(chunk.path)
        reader = self.readers.get(path)
        if reader is None or tuple(reader[1]) >= (chunk.offset, chunk.number):
            reader = self.readers[path] = (read_file(path, start_offset=chunk.segment), [-1, -1])
        entries, at = reader
        for entry in entries:
            if isinstance(entry, LogDamage):
                continue
            index = at[1] + 1 if entry.offset == at[0] else 0
            at[0], at[1] = entry.offset, index
            if (entry.offset, index) == (chunk.offset, chunk.number):
                record = entry.record
                assert type(record) is Inputs, record
                return [(record.seq + i, event, check) for i, (event, check)
                        in enumerate(zip(record.events, record.checks, strict=True))]
        raise LogCorrupt(f"{path}@{chunk.offset}: record {chunk.number} not found")

    def close(self) -> None:
        self.readers.clear()


def _same_check(x: Any, y: Any) -> bool:
    if type(x) is int and type(y) is int:
        return bool(x == y)
    cx = x if type(x) is int else wire_check(x)
    cy = y if type(y) is int else wire_check(y)
    return bool(cx == cy)


def _first_mismatch(a: list[Chunk], b: list[Chunk]) -> int:
    """Index of the first record whose events (by seq range and body key)
    differ between the two indexes; min(len) if none."""
    for index, (x, y) in enumerate(zip(a, b)):  # noqa: B905 (shorter is the point)
        if x.first_seq != y.first_seq or x.end_seq != y.end_seq or x.key != y.key:
            return index
    return min(len(a), len(b))


def diff_logs(a_path: str | os.PathLike[str], b_path: str | os.PathLike[str], *,
              prefix_a: str | None = None, prefix_b: str | None = None,
              full: bool = False, ledgers: bool = True) -> DiffResult:
    """Compare two logs; see the module docstring."""
    skip_a, skip_b = ({}, {}) if full else equal_segments(segments(a_path, prefix_a),
                                                           segments(b_path, prefix_b))
    a, b = scan_digests(a_path, prefix_a, skip_a), scan_digests(b_path, prefix_b, skip_b)
    result = DiffResult(damage=[*a.damage, *b.damage], full=full)
    if a.header is None or b.header is None:
        result.damage.append("a log without a header")
        return result
    common = sorted(set(a.digests) & set(b.digests))
    result.common_digests = len(common)
    bad = _first_differing(common, a.digests, b.digests)
    upper = common[bad] if bad < len(common) else None
    # Records before the first whose raw body differs hold equal events and checks.
    index = 0 if full else _first_mismatch(a.chunks, b.chunks)
    result.walked_from = start = (a.chunks[index].first_seq if index < len(a.chunks) else
                                  b.chunks[index].first_seq if index < len(b.chunks) else
                                  a.events_seen)
    result.events_compared = start
    side_a, side_b = _Chunks(), _Chunks()
    try:
        _walk(result, a, b, side_a, side_b, index, upper)
    finally:
        side_a.close()
        side_b.close()
    if upper is not None and result.identical:
        _digest_divergence(result, a, b, upper)
    elif result.identical and a.events_seen != b.events_seen:
        result.identical = False
        result.seq = min(a.events_seen, b.events_seen)
        result.kind = "length"
        result.detail = (f"A holds {a.events_seen} events, B {b.events_seen}; "
                         "all events both hold match")
    if not result.identical and result.kind == "input":
        result.decision = first_decision(a_path, b_path, prefix_a, prefix_b)
    shown = not result.identical and result.kind in ("input", "outcome")
    for scanned, item, side in ((a, result.item_a, "a"), (b, result.item_b, "b")):
        recomputed, counters = _replay_end(scanned, result.seq if shown else None, ledgers)
        if shown:
            setattr(result, side, _side(item, recomputed))
        if ledgers:
            setattr(result, f"counters_{side}", counters)
    return result


def _walk(result: DiffResult, a: Digests, b: Digests, side_a: _Chunks, side_b: _Chunks,
          index: int, upper: int | None) -> None:
    """Compare events from record ``index`` on, decoding only where the two
    logs' records are not byte-equal (or not aligned)."""
    i = j = index
    left: list[_Item] = []
    right: list[_Item] = []
    li = ri = 0
    while True:
        if li == len(left) and ri == len(right):
            left, right, li, ri = [], [], 0, 0
            # Aligned: skip equal records without decoding them.
            while (i < len(a.chunks) and j < len(b.chunks) and not result.full
                   and a.chunks[i].first_seq == b.chunks[j].first_seq
                   and a.chunks[i].end_seq == b.chunks[j].end_seq
                   and a.chunks[i].key == b.chunks[j].key):
                result.events_compared += a.chunks[i].end_seq - a.chunks[i].first_seq
                i += 1
                j += 1
        if li == len(left):
            if i == len(a.chunks):
                return
            left, li = side_a.decode(a.chunks[i]), 0
            i += 1
            continue
        if ri == len(right):
            if j == len(b.chunks):
                return
            right, ri = side_b.decode(b.chunks[j]), 0
            j += 1
            continue
        x, y = left[li], right[ri]
        if x[0] != y[0]:  # a hole on one side
            _diverge(result, min(x[0], y[0]), "length", "events missing on one side", x, y)
            return
        seq = x[0]
        if upper is not None and seq > upper:
            return
        if x[1] != y[1]:
            _diverge(result, seq, "input", "the logs record different inputs"
                     + _fields_differing(x[1], y[1]), x, y)
            return
        if not _same_check(x[2], y[2]):
            _diverge(result, seq, "outcome", "same input, different decisions/commands", x, y)
            return
        result.events_compared += 1
        li += 1
        ri += 1


def _fields_differing(x: Event, y: Event) -> str:
    if type(x) is not type(y):
        return f" ({type(x).__name__} vs {type(y).__name__})"
    names = [f.name for f in attrs.fields(type(x)) if getattr(x, f.name) != getattr(y, f.name)]
    return f" (fields: {', '.join(names)})"


def _digest_divergence(result: DiffResult, a: Digests, b: Digests, upper: int) -> None:
    _diverge(result, upper, "digest", "the state digests differ after this event, though "
             "every event and outcome up to it matches", None, None)
    result.a = Side(event=None, check=None, outcome="", digest=a.digests[upper])
    result.b = Side(event=None, check=None, outcome="", digest=b.digests[upper])


def _diverge(result: DiffResult, seq: int, kind: str, detail: str, x: Any, y: Any) -> None:
    result.identical = False
    result.seq = seq
    result.kind = kind
    result.detail = detail
    result.item_a = x
    result.item_b = y


def _side(item: _Item | None, recomputed: Outcome | None) -> Side:
    """One log's side: its event, and its outcome decoded (full outcomes),
    else ``recomputed`` by this code against the recorded check."""
    if item is None:
        return Side(event=None, check=None, outcome="(no such event)")
    _, event, check = item
    if type(check) is not int:
        return Side(event=event, check=check, outcome=_format_wire(check))
    if recomputed is None:
        return Side(event=event, check=check, outcome=f"check {check:#010x}")
    got = outcome_check(recomputed)
    text = _format_wire(outcome_wire(recomputed))
    if got == check:
        return Side(event=event, check=check,
                    outcome=f"{text} (recomputed, matches the recorded check)")
    return Side(event=event, check=check,
                outcome=f"check {check:#010x}; this code gives {text} (check {got:#010x})")


def _file_of(scanned: Digests, seq: int) -> Path | None:
    found = None
    for first, file in scanned.file_starts:
        if first <= seq:
            found = file
    return found


def _replay_end(scanned: Digests, seq: int | None, ledgers: bool
                ) -> tuple[Outcome | None, dict[str, int]]:
    """The outcome of event ``seq`` under this code (None: not asked) and,
    with ``ledgers``, the log's final counters: replays of a file alone from
    its last segment (snapshot) before the event or the end; one replay
    serves both when the event is in the last file."""
    found: list[Outcome] = []

    def observer(at: int, event: Event, outcome: Outcome, state: State) -> None:
        if at == seq:
            found.append(outcome)

    last = scanned.file_starts[-1][1] if scanned.file_starts else None
    file = _file_of(scanned, seq) if seq is not None else None
    if ledgers and file is not None and file == last:
        assert seq is not None
        counters = _counters(_replay_tail(file, seq, observer, lambda fold: False))
        return (found[0] if found else None), counters
    if file is not None:
        assert seq is not None
        _replay_tail(file, seq, observer, lambda fold: fold.next_seq > seq)
    counters = (_counters(_replay_tail(last, 1 << 62, None, lambda fold: False))
                if ledgers and last is not None else {})
    return (found[0] if found else None), counters


def _replay_tail(file: Path, seq: int, observer: Any, until: Any) -> ReplayResult:
    """Replay ``file`` from its last segment starting at or before ``seq``
    (``replay.seek``; the whole file where none restores)."""
    starts = [s for s in segments(file) if s.seq <= seq]
    result = (seek.replay_from([file], starts[-1], observer, until) if starts else None)
    return result if result is not None else replay(file, observer=observer)


def _counters(result: ReplayResult) -> dict[str, int]:
    if result.state is None:
        return {}
    return {name.value: value for name, value in result.state.counters.items()}


DECISIONS_SHOWN: Final = 6  # a side's decisions listed at the decision split
OUTCOME_ITEMS_SHOWN: Final = 16  # decisions and commands a side's outcome lists


def _format_wire(value: Any) -> str:
    """An outcome's decisions then commands, the first OUTCOME_ITEMS_SHOWN of
    them and a count of the rest (a shutdown can drop hundreds of ops at once)."""
    decisions, commands = value
    items = [*decisions, *commands]
    if not items:
        return "[] (nothing)"
    parts = [brief(from_wire(item)) for item in items[:OUTCOME_ITEMS_SHOWN]]
    left = len(items) - len(parts)
    if left:
        parts.append(f"... {left} more ({len(decisions)} decisions and {len(commands)} "
                     "commands in all)")
    return "[" + ", ".join(parts) + "]"


def format_diff(result: DiffResult, name_a: str, name_b: str) -> str:
    lines = []
    if result.identical:
        lines.append(f"identical: {result.events_compared} events and outcomes equal "
                     f"(byte-equal records up to event {result.walked_from}, decoded after; "
                     f"{result.common_digests} common digests equal)")
    else:
        lines.append(f"DIVERGED at seq {result.seq} ({result.kind}): {result.detail}")
        lines.append(f"  ({result.common_digests} common digests bisected; records "
                     f"byte-equal up to event {result.walked_from}, "
                     f"{result.events_compared} events equal before the divergence)")
        for name, side in ((name_a, result.a), (name_b, result.b)):
            if side is None:
                continue
            lines.append(f"  A {name}:" if side is result.a else f"  B {name}:")
            if side.digest:
                lines.append(f"    digest:  {side.digest}")
                continue
            event = "-" if side.event is None else brief(side.event)
            lines.append(f"    event:   {field(event, DETAIL_CHARS_MAX)}")
            lines.append(f"    outcome: {field(side.outcome, DETAIL_CHARS_MAX)}")
        split = result.decision
        if split is not None:
            lines.append(f"first differing DECISION: observation {split.observation} (A seq "
                         f"{split.seq_a}, B seq {split.seq_b}), which each log recorded as")
            for name, event, decisions in (("A", split.event_a, split.decisions_a),
                                           ("B", split.event_b, split.decisions_b)):
                lines.append(f"  {name} {field(event, DETAIL_CHARS_MAX)}")
                shown = decisions[:DECISIONS_SHOWN]
                more = (f" ... {len(decisions) - len(shown)} more"
                        if len(decisions) > len(shown) else "")
                lines.append(f"    decided: {'; '.join(shown) or 'nothing'}{more}")
        elif result.kind == "input":
            lines.append("no decision differs (in the first "
                         f"{DECISION_WINDOW} observations): only the inputs do")
    if result.counters_a or result.counters_b:
        names = list(dict.fromkeys([*result.counters_a, *result.counters_b]))
        rows = [(n, result.counters_a.get(n, 0), result.counters_b.get(n, 0)) for n in names]
        rows = [r for r in rows if r[1] or r[2]]
        width = max((len(n) for n, _, _ in rows), default=7)
        lines.append("final counters (a replay of each log's last file):")
        lines.append(f"  {'counter':<{width}}  {'A':>10}  {'B':>10}  {'B-A':>8}")
        for n, x, y in rows:
            mark = "" if x == y else f"{y - x:+8d}"
            lines.append(f"  {n:<{width}}  {x:>10}  {y:>10}  {mark:>8}")
    return "\n".join(lines)


def to_json(result: DiffResult) -> dict[str, Any]:
    def side(value: Side | None) -> dict[str, Any] | None:
        if value is None:
            return None
        return {"event": repr(value.event), "check": repr(value.check),
                "outcome": value.outcome, "digest": value.digest}

    split = result.decision
    return {"decision": None if split is None else attrs.asdict(split),
            "identical": result.identical, "seq": result.seq, "kind": result.kind,
            "detail": result.detail, "a": side(result.a), "b": side(result.b),
            "walked_from": result.walked_from, "events_compared": result.events_compared,
            "common_digests": result.common_digests, "counters_a": result.counters_a,
            "counters_b": result.counters_b, "damage": result.damage}
