"""The shell's log lines: quiet, structured, one line per failure.

:class:`Narrator` reads the core's decisions and logs only what an operator
acts on, as ``<event> key=value ...`` (``connector.shell.logs``):

* a stale skip (hash mismatch at verification), once per request and batch;
* an unhashed candidate (the request's later ops cannot be stored);
* a failed store, once when it settles, with the held-back ops it cost;
* evictions and preemptions, aggregated per scheduler step;
* the drops of a prefix-cache reset, and of the shutdown, one line each with
  the requests (at most :data:`MAX_IDS_IN_LOG_LINE`) and ``run=``;
* the counters line every few seconds when it changed, and at shutdown;
* the policy line of the spec at start-up, what was left at shutdown, and
  what drain-only mode released, kept and settled.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable
from typing import Any

from offload_fsm import OffloadConfig, Policy
from offload_fsm.after_failure import DrainOnly
from offload_fsm.invariants import ledger_terms
from offload_fsm.state import State
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.decisions import (
    DropCause,
    OpRejected,
    OpsDropped,
    ReceiptIgnored,
    RejectReason,
    ShutdownLeft,
    StoreAbandoned,
    StoreSettled,
    TailFlushed,
)
from offload_fsm.vocabulary.outcome import Outcome

COUNTERS_LOG_INTERVAL_S = 5.0
MAX_IDS_IN_LOG_LINE = 8
# Drops that one event makes for many requests at once: one line per event.
AT_ONCE = {
    DropCause.CACHE_RESET: "lazy offload: the prefix cache was reset; dropped the buffered "
                           "store ops it left unverifiable",
    DropCause.SHUTDOWN: "lazy offload: shutting down; dropped the store ops still buffered",
}


class Narrator:
    """``run``: the event log's file prefix; every line about a request
    carries it (``run=``) beside ``req_id=``, which is what ``replay explain``
    needs to find the story (the start-up line names the directory)."""

    def __init__(self, log: Any, clock: Callable[[], float], *, run: str = "") -> None:
        self._log = log.bind(run=run) if run else log
        self._clock = clock
        self._lost: Tally[str] = Tally()  # cause -> ops, this step
        self._lost_ids: list[str] = []
        self._last_counters: tuple[int, ...] = ()
        self._last_counters_log_s = 0.0
        self._left: ShutdownLeft | None = None

    def enabled(self, config: OffloadConfig) -> None:
        """The spec's policy line (and the tail flush's, when on)."""
        if config.policy is Policy.FIFO:
            self._log.info(
                f"lazy offload enabled with FIFO policy, offload threshold: {config.threshold}"
            )
        else:
            self._log.info(f"lazy offload enabled with EVICTION_AWARE policy: {config.describe()}")
        if config.idle_flush_steps or config.shutdown_flush_s:
            self._log.info("lazy offload tail flush on", idle_flush_steps=config.idle_flush_steps,
                           shutdown_flush_s=config.shutdown_flush_s)

    def left_at_shutdown(self, state: State, *, signal_seen: bool) -> None:
        """With a tail flush on: one line with what never reached LMCache."""
        left = self._left
        if left is None:
            return
        counters = state.counters
        self._log.info(
            "lazy offload: left at shutdown, not in LMCache",
            requests=left.requests,
            ops=left.buffered_ops + left.in_flight_ops,
            tokens=left.buffered_tokens + left.in_flight_tokens,
            buffered_ops=left.buffered_ops, in_flight_ops=left.in_flight_ops,
            shutdown_flush_ops=counters[Counter.SHUTDOWN_FLUSH_OPS],
            idle_flush_ops=counters[Counter.IDLE_FLUSH_OPS],
            signal_seen=signal_seen,
        )

    def drained(self, message: str, drain: DrainOnly) -> None:
        self._log.info(message, **_drain_stats(drain))

    def stopped(self, drain: DrainOnly, *, seq: int, event: Any, reason: str) -> None:
        """Drain-only mode took over after a failure: one error line."""
        self._log.error(
            "lazy offload stopped: nothing new is stored for the rest of this run; stores "
            "already submitted keep their blocks until their receipts arrive, and vLLM "
            "keeps serving",
            seq=seq, failed_event=type(event).__name__ if event is not None else "-",
            reason=reason, in_flight_batches=len(drain.in_flight), **_drain_stats(drain),
        )

    def note(self, outcome: Outcome) -> None:
        # A failed or abandoned store and the later ops of its request it
        # costs come in the same outcome, in either order: tally them first.
        held_back: Tally[str] = Tally()
        at_once: dict[DropCause, dict[str, int]] = {}  # reset or shutdown: cause -> req -> ops
        for decision in outcome.decisions:
            if isinstance(decision, OpsDropped) and decision.cause is DropCause.STORE_FAILED:
                held_back[decision.req_id] += decision.ops
            if isinstance(decision, OpsDropped) and decision.cause in AT_ONCE and decision.ops:
                dropped = at_once.setdefault(decision.cause, {})
                dropped[decision.req_id] = dropped.get(decision.req_id, 0) + decision.ops
        for decision in outcome.decisions:
            if isinstance(decision, OpsDropped):
                self._dropped(decision)
            elif isinstance(decision, OpRejected) and decision.reason is RejectReason.UNHASHED:
                self._log.warning(
                    "lazy offload: skipping a store and every later one of its request: "
                    "covered blocks carry no prefix-cache hash",
                    req_id=decision.req_id, start_token=decision.start_token,
                    end_token=decision.end_token,
                )
            elif isinstance(decision, StoreSettled) and decision.failed and not decision.orphaned:
                self._log.warning(
                    "lazy offload: store failed", req_id=decision.req_id,
                    batch_id=decision.batch_id, ops=decision.ops,
                    held_back_ops_dropped=held_back[decision.req_id],
                )
            elif isinstance(decision, StoreAbandoned):
                self._log.warning(
                    "lazy offload: store abandoned, its receipts did not all arrive within "
                    "the receipt lease; its blocks are released", req_id=decision.req_id,
                    batch_id=decision.batch_id, ops=decision.ops,
                    receipts=decision.receipts, waited_s=round(decision.waited_s, 3),
                    held_back_ops_dropped=held_back[decision.req_id],
                )
            elif isinstance(decision, ShutdownLeft):
                self._left = decision
            elif isinstance(decision, TailFlushed):
                self._log.debug("lazy offload: tail flushed", trigger=decision.trigger.value,
                                requests=decision.requests, ops=decision.ops,
                                tokens=decision.tokens, idle_steps=decision.idle_steps)
            elif isinstance(decision, ReceiptIgnored):
                self._log.warning(
                    "lazy offload: ignoring a store-completion receipt with no in-flight "
                    "store batch", req_id=decision.req_id, reason=decision.reason.value,
                )
        for cause, dropped in at_once.items():
            ids = list(dropped)
            more = len(ids) - MAX_IDS_IN_LOG_LINE
            self._log.info(AT_ONCE[cause], **{f"{cause.value}_ops": sum(dropped.values())},
                           req_ids=",".join(ids[:MAX_IDS_IN_LOG_LINE])
                           + (f",+{more} more" if more > 0 else ""))

    def _dropped(self, decision: OpsDropped) -> None:
        cause = decision.cause
        if cause is DropCause.STALE and decision.block_id >= 0:
            self._log.warning(
                "lazy offload: block hashes missing or mismatched, skipping the stale store "
                "and the request's remaining store operations",
                req_id=decision.req_id, block_id=decision.block_id,
            )
        elif cause in (DropCause.EVICTED, DropCause.PREEMPTED) and decision.ops:
            self._lost[cause.value] += decision.ops
            if len(self._lost_ids) < MAX_IDS_IN_LOG_LINE:
                self._lost_ids.append(decision.req_id)

    def end_of_step(self, state: State) -> None:
        if self._lost:
            self._log.info(
                "lazy offload: dropped buffered store ops before their drain",
                **{f"{cause}_ops": ops for cause, ops in sorted(self._lost.items())},
                req_ids=",".join(self._lost_ids),
            )
            self._lost.clear()
            self._lost_ids = []
        now = self._clock()
        if now - self._last_counters_log_s < COUNTERS_LOG_INTERVAL_S:
            return
        snapshot = tuple(state.counters.values())
        if snapshot != self._last_counters:
            self._last_counters = snapshot
            self._last_counters_log_s = now
            self._log.info(f"Lazy offload counters: {counters_line(state)}")


def counters_line(state: State) -> str:
    counters = state.counters
    body = " ".join(f"{name}={value}" for name, value in counters.items() if value)
    terms = ledger_terms(state)
    closes = counters[Counter.ADMITTED_OPS] == sum(terms.values())
    return f"{body} pending={terms['pending']} ledger_closes={closes}"


def _drain_stats(drain: DrainOnly) -> dict[str, int]:
    stats = drain.stats
    return {
        "released_blocks": stats.released_now_blocks,
        "kept_blocks": stats.kept_blocks,
        "settled_batches": stats.settled_batches,
        "abandoned_batches": stats.abandoned_batches,
        "sessions_ended": stats.sessions_ended,
    }
