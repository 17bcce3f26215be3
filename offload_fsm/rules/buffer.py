"""Per-request buffer bookkeeping: drops, the ready/pending/shielded indexes,
deadlines, orphaned batches and the end of a session.

A request's ``ops`` are its buffered store ops in token order. Whenever they
change, :func:`after_buffer_change` keeps ``State.pending`` (has buffered
ops, in entry order), ``State.shielded`` (has pinned buffered ops),
``State.ready`` (FIFO: finished, buffered, no batch) and the deadline heap
in step. A FINISHED request with nothing buffered and no batch ends: the
core forgets it and emits ``EndSession`` exactly once (:func:`maybe_end`).
"""

from __future__ import annotations

import heapq

from offload_fsm.rules.legality import move
from offload_fsm.rules.pins import release_pinned
from offload_fsm.rules.scope import Scope
from offload_fsm.state import Op, OpStatus, Phase, RequestState, State
from offload_fsm.vocabulary.commands import EndSession
from offload_fsm.vocabulary.counters import DROPPED_OPS, DROPPED_TOKENS
from offload_fsm.vocabulary.decisions import BatchOrphaned, DropCause, OpsDropped


def drop_pending(state: State, rec: RequestState, cause: DropCause, scope: Scope, *,
                 unbuffer: bool = True) -> None:
    """Drop the request's whole buffer for ``cause``; ``unbuffer`` False when
    the policy has let go of every buffered op already (``all_unbuffered``)."""
    if not rec.ops:
        return
    lost = rec.ops[:]
    rec.ops.clear()
    if unbuffer:
        scope.hooks.unbuffered(state, lost)
    release_pinned(state, lost, scope)
    count_drop(state, rec, lost, cause, -1, scope)
    after_buffer_change(state, rec)


def count_drop(
    state: State, rec: RequestState, ops: list[Op], cause: DropCause, block_id: int,
    scope: Scope,
) -> None:
    """Book ``ops`` (already out of every container) as dropped for ``cause``."""
    move(state, ops, OpStatus.DROPPED)
    tokens = sum(op.tokens for op in ops)
    state.counters[DROPPED_OPS[cause]] += len(ops)
    state.counters[DROPPED_TOKENS[cause]] += tokens
    scope.decisions.append(
        OpsDropped(req_id=rec.req_id, start_token=ops[0].start_token,
                   end_token=ops[-1].end_token, ops=len(ops), tokens=tokens,
                   cause=cause, block_id=block_id)
    )


def after_buffer_change(state: State, rec: RequestState) -> None:
    """Keep the pending/shielded/ready indexes and the deadline heap in step
    with ``rec.ops``."""
    if rec.ops:
        push_deadline(state, rec)
    else:
        state.pending.pop(rec.req_id, None)
    if not any(op.pinned for op in rec.ops):
        state.shielded.pop(rec.req_id, None)
    refresh_ready(state, rec)


def refresh_ready(state: State, rec: RequestState) -> None:
    if rec.phase is Phase.FINISHED and rec.ops and rec.batch is None:
        state.ready[rec.req_id] = None
    else:
        state.ready.pop(rec.req_id, None)


def maybe_end(state: State, rec: RequestState, scope: Scope) -> None:
    if rec.phase is Phase.FINISHED and not rec.ops and rec.batch is None:
        del state.requests[rec.req_id]
        state.pending.pop(rec.req_id, None)
        state.ready.pop(rec.req_id, None)
        state.shielded.pop(rec.req_id, None)
        scope.commands.append(EndSession(req_id=rec.req_id))


def orphan(rec: RequestState, scope: Scope) -> None:
    """The request's in-flight batch no longer belongs to its current run
    (preemption, id reuse): its receipts settle it, nothing follows it."""
    assert rec.batch is not None
    rec.batch.orphaned = True
    scope.decisions.append(BatchOrphaned(req_id=rec.req_id, batch_id=rec.batch.batch_id))


def push_deadline(state: State, rec: RequestState) -> None:
    if state.config.max_deferral_seconds > 0 and rec.ops:
        front = rec.ops[0]
        heapq.heappush(state.deadlines, (front.time_s, rec.order, rec.req_id, front.op_id))


def pop_overdue(state: State) -> list[RequestState]:
    """Requests whose front op has waited ``max_deferral_seconds``, oldest
    first. Pops their heap entries (dropping stale ones) and pushes the live
    ones back, so a request that is not selected now stays overdue."""
    if state.config.max_deferral_seconds <= 0:
        return []
    limit = state.time_s - state.config.max_deferral_seconds
    heap = state.deadlines
    live: dict[str, tuple[float, int, str, int]] = {}
    while heap and heap[0][0] <= limit:
        entry = heapq.heappop(heap)
        rec = state.requests.get(entry[2])
        if rec is not None and rec.ops and rec.ops[0].op_id == entry[3]:
            live.setdefault(entry[2], entry)
    for entry in live.values():
        heapq.heappush(heap, entry)
    return [state.requests[req_id] for req_id in live]
