"""``summary``: the ledger and the losses of a run, from a replay.

:class:`SummaryObserver` watches a fold (recorded or simulated) and
:func:`summarize` turns it and the final state into a plain dict: the ledger
terms and whether they close, counts per drop cause and reject reason, the
drop rate in ops and tokens, the deferral of every selected op in token
steps (buffered -> selected; mean, p50, p99), the peak of pinned blocks, and
the requests that lost the most tokens.
"""

from __future__ import annotations

import shlex
from collections import Counter as Tally
from typing import Any

from offload_fsm.invariants import ledger_closes, ledger_terms
from offload_fsm.state import State
from offload_fsm.vocabulary.counters import DROPPED_OPS, DROPPED_TOKENS, REJECTED, Counter
from offload_fsm.vocabulary.decisions import DropCause, OpsDropped, OpsSelected, RejectReason
from offload_fsm.vocabulary.events import CandidateOffered, Event
from offload_fsm.vocabulary.outcome import Outcome
from replay.text import field


class SummaryObserver:
    """Per-op deferrals, pinned-block peak and per-request losses."""

    def __init__(self) -> None:
        self.admitted: dict[str, list[tuple[int, int]]] = {}  # req -> (start, step buffered)
        self.deferrals: list[int] = []
        self.peak_pinned_blocks = 0
        self.lost_tokens: Tally[str] = Tally()
        self.lost_ops: Tally[str] = Tally()
        self.lost_causes: dict[str, Tally[str]] = {}  # req -> tokens lost per drop cause

    def __call__(self, seq: int, event: Event, outcome: Outcome, state: State) -> None:
        pinned = len(state.pins)
        if pinned > self.peak_pinned_blocks:
            self.peak_pinned_blocks = pinned
        decisions = outcome.decisions
        if type(event) is CandidateOffered and not decisions:
            self.admitted.setdefault(event.req_id, []).append(
                (event.start_token, state.step_index))
            return
        for decision in decisions:
            kind = type(decision)
            if kind is OpsSelected:
                assert isinstance(decision, OpsSelected)
                self._taken(decision.req_id, decision.start_token, decision.end_token,
                            state.step_index)
            elif kind is OpsDropped:
                assert isinstance(decision, OpsDropped)
                if decision.cause is not DropCause.DUPLICATE:  # stored by another request
                    self.lost_tokens[decision.req_id] += decision.tokens
                    self.lost_ops[decision.req_id] += decision.ops
                    self.lost_causes.setdefault(decision.req_id, Tally())[
                        decision.cause.value] += decision.tokens
                self._taken(decision.req_id, decision.start_token, decision.end_token, None)

    def _taken(self, req_id: str, start: int, end: int, step: int | None) -> None:
        buffered = self.admitted.get(req_id)
        if not buffered:
            return
        kept = []
        for op_start, op_step in buffered:
            if start <= op_start < end:
                if step is not None:
                    self.deferrals.append(step - op_step)
            else:
                kept.append((op_start, op_step))
        self.admitted[req_id] = kept


def _percentile(sorted_values: list[int], fraction: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, round(fraction * (len(sorted_values) - 1)))
    return float(sorted_values[index])


def summarize(state: State, observer: SummaryObserver, *, top: int = 10) -> dict[str, Any]:
    counters = state.counters
    ledger = {unit: ledger_terms(state, unit) for unit in ("ops", "tokens")}
    admitted = {"ops": counters[Counter.ADMITTED_OPS], "tokens": counters[Counter.ADMITTED_TOKENS]}
    # A duplicate is not a loss: another request's batch stored the same content.
    dropped = {
        unit: sum(counters[by_cause[cause]] for cause in DropCause
                  if cause is not DropCause.DUPLICATE)
        for unit, by_cause in (("ops", DROPPED_OPS), ("tokens", DROPPED_TOKENS))
    }
    deferrals = sorted(observer.deferrals)
    return {
        "ledger": {
            unit: {"admitted": admitted[unit], **ledger[unit]} for unit in ("ops", "tokens")
        },
        "ledger_closes": not ledger_closes(state),
        "ledger_problems": ledger_closes(state),
        "dropped_by_cause": {
            cause.value: {"ops": counters[DROPPED_OPS[cause]],
                          "tokens": counters[DROPPED_TOKENS[cause]]}
            for cause in DropCause
        },
        "rejected_by_reason": {
            reason.value: counters[REJECTED[reason]] for reason in RejectReason
        },
        "drop_rate": {
            unit: (dropped[unit] / admitted[unit]) if admitted[unit] else 0.0
            for unit in ("ops", "tokens")
        },
        "stored": {"ops": counters[Counter.STORED_OPS], "tokens": counters[Counter.STORED_TOKENS]},
        "deferral_steps": {
            "count": len(deferrals),
            "mean": (sum(deferrals) / len(deferrals)) if deferrals else 0.0,
            "p50": _percentile(deferrals, 0.50),
            "p99": _percentile(deferrals, 0.99),
            "max": float(deferrals[-1]) if deferrals else 0.0,
        },
        "peak_pinned_blocks": observer.peak_pinned_blocks,
        "token_steps": counters[Counter.TOKEN_STEPS],
        "top_losses": [
            {"req_id": req_id, "tokens": tokens, "ops": observer.lost_ops[req_id],
             "causes": dict(observer.lost_causes.get(req_id, {}))}
            for req_id, tokens in observer.lost_tokens.most_common(top)
        ],
    }


def format_summary(summary: dict[str, Any], log: str = "LOG", prefix: str | None = None
                   ) -> str:
    """The summary as text; each top loss with a ready-to-paste ``explain``
    of ``log`` (and ``prefix``, a run of several)."""
    lines = []
    for unit in ("ops", "tokens"):
        terms = summary["ledger"][unit]
        rhs = " + ".join(f"{k} {v}" for k, v in terms.items() if k != "admitted" and v)
        lines.append(f"ledger ({unit}): admitted {terms['admitted']} = {rhs or '0'}")
    lines.append("ledger closes: " + ("yes" if summary["ledger_closes"] else
                                      "NO: " + "; ".join(summary["ledger_problems"])))
    lines.append("dropped by cause:")
    for cause, value in summary["dropped_by_cause"].items():
        if value["ops"]:
            lines.append(f"  {cause:<13} {value['ops']:>8} ops {value['tokens']:>10} tokens")
    rejected = {k: v for k, v in summary["rejected_by_reason"].items() if v}
    if rejected:
        lines.append("rejected: " + ", ".join(f"{k} {v} ops" for k, v in rejected.items()))
    rate = summary["drop_rate"]
    lines.append(f"drop rate (losses, duplicates excluded): {rate['ops']:.2%} of ops, "
                 f"{rate['tokens']:.2%} of tokens")
    d = summary["deferral_steps"]
    lines.append(f"deferral (steps buffered before selection, {d['count']} ops): "
                 f"mean {d['mean']:.2f}, p50 {d['p50']:g}, p99 {d['p99']:g}, max {d['max']:g}")
    lines.append(f"peak pinned blocks: {summary['peak_pinned_blocks']}")
    if summary["top_losses"]:
        lines.append("top requests by loss (explain one: the command under it):")
        run = f" --prefix {shlex.quote(prefix)}" if prefix else ""
        for item in summary["top_losses"]:
            causes = ", ".join(item["causes"])
            lines.append(f"  {field(item['req_id']):<20} {item['tokens']:>8} tokens "
                         f"{item['ops']:>5} ops  ({causes})")
            lines.append(f"      replay explain {shlex.quote(log)}{run} --request "
                         f"{shlex.quote(field(item['req_id']))}")
    return "\n".join(lines)
