"""The tail flush: opt-in stores of the buffered tail when the engine idles
or shuts down (``idle_flush_steps``, ``shutdown_flush_s``; both off by
default, as the spec says: "the idle tail is not flushed automatically").

The drains of both policies run only on steps that schedule tokens, so the
ops of requests that finished before traffic stopped stay buffered until
their blocks are reallocated (``evicted``) or the engine stops
(``shutdown``). Two knobs flush that tail instead. They are the only
selections on a step without tokens (``invariants.quiet_on_empty_steps``
allows exactly these), and with both off this module does nothing: the
machine decides and digests as before they existed.

* **Idle** (``idle_flush_steps`` = N > 0): each ``StepScheduled`` with zero
  tokens counts one idle step (``State.idle_steps``; a token step resets it).
  From the N-th consecutive one on, each empty step selects every *ready*
  request (finished, buffered, no batch in flight: ``State.ready``) whole,
  reason ``IDLE_FLUSH``. The usual path follows: protect, re-read the
  hashes, submit the verified prefix, drop the stale rest (never stale KV).
  Running requests are never flushed, and neither are ops already dropped
  (evicted, broken chains). The count lives on events, so replay is exact.
* **Shutdown** (``shutdown_flush_s`` = T > 0): ``ShutdownBegan`` (vLLM got
  SIGTERM/SIGINT and keeps stepping while the connector reports work) sets
  ``State.shutdown_until_s`` to its time + T; every empty step before then
  selects the ready requests the same way, reason ``SHUTDOWN_FLUSH``.
  ``ShutdownRequested`` (the connector's own shutdown, after vLLM's
  workers stopped) then records what never reached LMCache
  (:class:`~offload_fsm.vocabulary.decisions.ShutdownLeft`, ``shutdown_left_*``).

Why it ends. The shell keeps vLLM stepping while ``queries.keeps_stepping``
says so: a batch in flight, or a ready request with a flush on. Each empty
step either counts towards N or moves every ready request into a batch (or
drops it stale or duplicate); a request is ready again only when its batch
settles, with fewer ops. So an idle engine spins at most N steps plus one
per receipt round, and the shutdown wait ends at ``shutdown_until_s`` (the
shell compares its clock; nothing here reads one).

Cost: every flushed op is a write the policy alone would not have made
(``idle_flush_ops``/``…_tokens`` with ``idle_flushes``,
``shutdown_flush_ops``/``…_tokens``), for tail KV that survives eviction
and restarts.
"""

from __future__ import annotations

from offload_fsm.rules import drain
from offload_fsm.rules.scope import Scope
from offload_fsm.state import State
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.decisions import (
    FlushTrigger,
    SelectReason,
    ShutdownFlushBegan,
    ShutdownLeft,
    TailFlushed,
)
from offload_fsm.vocabulary.errors import InvalidEvent
from offload_fsm.vocabulary.events import ShutdownBegan, StepScheduled, StepsPassed

_TRIGGERS = {
    FlushTrigger.IDLE: (SelectReason.IDLE_FLUSH, Counter.IDLE_FLUSH_TOKENS),
    FlushTrigger.SHUTDOWN: (SelectReason.SHUTDOWN_FLUSH, Counter.SHUTDOWN_FLUSH_TOKENS),
}


def flush_on(state: State) -> bool:
    """Whether either flush is configured (otherwise this module is inert)."""
    config = state.config
    return config.idle_flush_steps > 0 or config.shutdown_flush_s > 0


def on_step(state: State, event: StepScheduled, scope: Scope) -> None:
    """The shared step (``drain.on_step``), then the idle count and a flush."""
    drain.on_step(state, event, scope)
    state.flushed_in_step = 0
    if not flush_on(state):
        return
    if event.scheduled_tokens:
        state.idle_steps = 0
        return
    state.idle_steps += 1
    until = state.shutdown_until_s
    if until is not None:
        if event.time_s < until:
            _flush(state, FlushTrigger.SHUTDOWN, event.time_s, scope)
        return
    limit = state.config.idle_flush_steps
    if limit and state.idle_steps >= limit:
        _flush(state, FlushTrigger.IDLE, event.time_s, scope)


def on_steps_passed(state: State, event: StepsPassed, scope: Scope) -> None:
    """Passed token steps (``drain.on_steps_passed``): each ends an idle run,
    as a token step does."""
    drain.on_steps_passed(state, event, scope)
    state.flushed_in_step = 0
    if flush_on(state):
        state.idle_steps = 0


def on_shutdown_began(state: State, event: ShutdownBegan, scope: Scope) -> None:
    """Start the shutdown wait; ignored (recorded, no decision) with the
    shutdown flush off, so a what-if with it off replays the same log."""
    if event.time_s < state.time_s:
        raise InvalidEvent(event.TAG, None,
                           f"time went back from {state.time_s} to {event.time_s}")
    if state.config.shutdown_flush_s <= 0:
        return
    if state.shutdown_until_s is not None:
        raise InvalidEvent(event.TAG, None, "shutdown began twice")
    state.shutdown_until_s = event.time_s + state.config.shutdown_flush_s
    scope.decisions.append(ShutdownFlushBegan(until_s=state.shutdown_until_s))


def record_left(state: State, scope: Scope) -> None:
    """At ``ShutdownRequested``, before it drops and abandons: count what
    never reached LMCache (only with a flush on, so older logs keep their
    digests)."""
    if not flush_on(state):
        return
    buffered = [op for rec in state.pending.values() for op in rec.ops]
    in_flight = [op for batch in state.batches.values() for op in batch.ops]
    requests = {op.req.req_id for op in buffered} | {op.req.req_id for op in in_flight}
    counters = state.counters
    counters[Counter.SHUTDOWN_LEFT_OPS] += len(buffered) + len(in_flight)
    counters[Counter.SHUTDOWN_LEFT_TOKENS] += sum(op.tokens for op in (*buffered, *in_flight))
    counters[Counter.SHUTDOWN_LEFT_REQUESTS] += len(requests)
    scope.decisions.append(ShutdownLeft(
        requests=len(requests),
        buffered_ops=len(buffered), buffered_tokens=sum(op.tokens for op in buffered),
        in_flight_ops=len(in_flight), in_flight_tokens=sum(op.tokens for op in in_flight),
    ))


def _flush(state: State, trigger: FlushTrigger, now_s: float, scope: Scope) -> None:
    """Select every ready request whole (the module docstring)."""
    if not state.ready:
        return
    reason, tokens_counter = _TRIGGERS[trigger]
    # The batches' lease counts from now, not from the last token step.
    state.time_s = now_s
    requests = ops = tokens = 0
    for req_id in list(state.ready):
        rec = state.requests[req_id]
        drain.select(state, rec, len(rec.ops), reason, -1, scope)
        batch = rec.batch
        if batch is not None:  # None: content dedup dropped every op
            requests += 1
            ops += len(batch.ops)
            tokens += sum(op.tokens for op in batch.ops)
    state.flushed_in_step += ops
    counters = state.counters
    counters[tokens_counter] += tokens
    if trigger is FlushTrigger.IDLE and ops:
        counters[Counter.IDLE_FLUSHES] += 1
    scope.decisions.append(TailFlushed(trigger=trigger, requests=requests, ops=ops,
                                       tokens=tokens, idle_steps=state.idle_steps))
