"""Request lifecycle observations: arrival, offers, a waiting request's
answered lookup, finish, preemption, prefix-cache reset and shutdown.

A request is ACTIVE until ``RequestFinished`` (FINISHED). ``RequestPreempted``
drops its buffer, orphans its batch and restarts its chain; ``RequestArrived``
for a FINISHED id is id reuse (drop the predecessor's buffer, orphan its
batch, end its session now if nothing is in flight). Which of these may
happen in which phase is ``legality.REQUEST_LEGAL``; this module checks only
the values an event carries.

``CandidateOffered`` admits a store op into the request's buffer unless the
chain is broken (an earlier range was lost: ``PREFIX_BROKEN``), a block has
no hash (``UNHASHED``, which breaks the chain) or the policy finds its
content stored already (``ALREADY_STORED``). Rejections are outside the
ledger; admissions start it.
"""

from __future__ import annotations

from typing import cast

from offload_fsm.rules import tail_flush
from offload_fsm.rules.buffer import (
    drop_pending,
    maybe_end,
    orphan,
    push_deadline,
    refresh_ready,
)
from offload_fsm.rules.legality import move
from offload_fsm.rules.pins import release
from offload_fsm.rules.scope import Scope
from offload_fsm.state import Op, OpStatus, Phase, RequestState, State, pack_ints
from offload_fsm.vocabulary.commands import EndSession
from offload_fsm.vocabulary.counters import REJECTED, Counter
from offload_fsm.vocabulary.decisions import DropCause, OpRejected, RejectReason
from offload_fsm.vocabulary.errors import InvalidEvent
from offload_fsm.vocabulary.events import (
    CandidateOffered,
    LookupAnswered,
    PrefixCacheReset,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    ShutdownRequested,
)

SHUT_DOWN = "the machine was shut down"


def on_arrived(state: State, event: RequestArrived, scope: Scope) -> None:
    rec = state.requests.get(event.req_id)
    if rec is None:
        state.requests[event.req_id] = RequestState(req_id=event.req_id)
        return
    if rec.phase is Phase.ACTIVE:
        return  # re-arrival after preemption: the reset already happened
    # Id reuse: the predecessor finished but its teardown was deferred.
    drop_pending(state, rec, DropCause.ID_REUSE, scope)
    rec.stray_receipts = 0  # a new generation: the old one's late receipts are not its
    rec.broken = False
    rec.next_start_token = None
    rec.phase = Phase.ACTIVE
    if rec.batch is None:
        scope.commands.append(EndSession(req_id=rec.req_id))
    else:
        orphan(rec, scope)


def on_lookup_answered(state: State, event: LookupAnswered, scope: Scope) -> None:
    """A waiting request's lookup was answered: the policy may protect the
    buffered ops its allocation can reach (``PolicyHooks.lookup_answered``)."""
    scope.hooks.lookup_answered(state, event, scope)


def on_offered(state: State, event: CandidateOffered, scope: Scope) -> None:
    rec = state.requests[event.req_id]
    _check_offer(rec, event)
    hashed = None not in event.block_hashes
    packed_ids, packed_hashes = _packed(event, hashed)
    rec.next_start_token = event.end_token
    if rec.broken:
        _reject(state, event, RejectReason.PREFIX_BROKEN, scope)
        return
    if not hashed:
        rec.broken = True
        _reject(state, event, RejectReason.UNHASHED, scope)
        return
    op = Op(
        op_id=state.next_op_id,
        req=rec,
        start_token=event.start_token,
        end_token=event.end_token,
        packed_ids=packed_ids,
        packed_hashes=packed_hashes,
        time_s=event.time_s,
        blocks_per_chunk=event.blocks_per_chunk,
    )
    hooks = scope.hooks
    if hooks.already_stored(state, op):
        # Not a loss: the request's chain stays intact.
        _reject(state, event, RejectReason.ALREADY_STORED, scope)
        return
    state.next_op_id += 1
    state.counters[Counter.ADMITTED_OPS] += 1
    state.counters[Counter.ADMITTED_TOKENS] += op.tokens
    if not rec.ops:
        rec.order = state.next_order
        state.next_order += 1
        state.pending[rec.req_id] = rec
    rec.ops.append(op)
    state.live_ops[OpStatus.BUFFERED] += 1
    state.live_tokens[OpStatus.BUFFERED] += op.tokens
    if len(rec.ops) == 1:
        push_deadline(state, rec)
    hooks.admitted(state, op, event.block_ids, cast("tuple[int, ...]", event.block_hashes), scope)


def _check_offer(rec: RequestState, event: CandidateOffered) -> None:
    tag, req_id = event.TAG, event.req_id
    if not 0 <= event.start_token < event.end_token:
        raise InvalidEvent(
            tag, req_id, f"token range [{event.start_token}, {event.end_token}) is empty"
        )
    blocks = len(event.block_ids)
    if not blocks or blocks != len(event.block_hashes):
        raise InvalidEvent(
            tag, req_id,
            f"{blocks} block ids but {len(event.block_hashes)} hashes "
            "(need equal, non-zero counts)",
        )
    per_chunk = event.blocks_per_chunk
    if per_chunk < 0 or (per_chunk and blocks % per_chunk):
        raise InvalidEvent(
            tag, req_id, f"{blocks} blocks are not whole chunks of {per_chunk}"
        )
    if rec.next_start_token is not None and event.start_token != rec.next_start_token:
        raise InvalidEvent(
            tag, req_id,
            f"range starts at {event.start_token}, expected {rec.next_start_token} "
            "(ranges of a request must be contiguous)",
        )


def _packed(event: CandidateOffered, hashed: bool) -> tuple[bytes, bytes]:
    """The offer's block ids and (``hashed``: all there) hashes, packed as an
    op holds them; refuses a value that is no 64-bit signed integer."""
    try:
        hashes = cast("tuple[int, ...]", event.block_hashes)  # ``hashed``: no None
        return pack_ints(event.block_ids), pack_ints(hashes) if hashed else b""
    except (TypeError, OverflowError):
        raise InvalidEvent(
            event.TAG, event.req_id,
            "block ids and hashes must be integers from -2**63 to 2**63 - 1",
        ) from None


def _reject(
    state: State, event: CandidateOffered, reason: RejectReason, scope: Scope
) -> None:
    state.counters[REJECTED[reason]] += 1
    scope.decisions.append(
        OpRejected(req_id=event.req_id, start_token=event.start_token,
                   end_token=event.end_token, reason=reason)
    )


def on_finished(state: State, event: RequestFinished, scope: Scope) -> None:
    rec = state.requests.get(event.req_id)
    if rec is None:
        scope.commands.append(EndSession(req_id=event.req_id))
        return
    rec.phase = Phase.FINISHED
    if rec.ops:
        # Even behind an in-flight batch (EVICTION_AWARE shields wait pinned).
        scope.hooks.finished(state, rec, event, scope)
    refresh_ready(state, rec)
    maybe_end(state, rec, scope)


def on_preempted(state: State, event: RequestPreempted, scope: Scope) -> None:
    rec = state.requests.get(event.req_id)
    if rec is None:
        return
    drop_pending(state, rec, DropCause.PREEMPTED, scope)
    rec.stray_receipts = 0  # the stores start over: an abandoned batch's receipts end here
    rec.broken = False
    rec.next_start_token = None
    if rec.batch is not None and not rec.batch.orphaned:
        orphan(rec, scope)


def on_cache_reset(state: State, event: PrefixCacheReset, scope: Scope) -> None:
    for rec in list(state.pending.values()):
        drop_pending(state, rec, DropCause.CACHE_RESET, scope)
        rec.broken = True
        maybe_end(state, rec, scope)


def on_shutdown(state: State, event: ShutdownRequested, scope: Scope) -> None:
    """Drop every buffer, abandon every batch in flight (releasing its pins),
    end every finished request's session, and close the machine. With a tail
    flush on, what is left is counted first (``tail_flush.record_left``)."""
    tail_flush.record_left(state, scope)
    counters = state.counters
    scope.hooks.all_unbuffered(state)
    for rec in list(state.pending.values()):
        drop_pending(state, rec, DropCause.SHUTDOWN, scope, unbuffer=False)
    for batch in list(state.batches.values()):
        ops = batch.ops
        move(state, ops, OpStatus.ABANDONED)
        counters[Counter.ABANDONED_OPS] += len(ops)
        counters[Counter.ABANDONED_TOKENS] += sum(op.tokens for op in ops)
        scope.hooks.released(state, ops, False)
        release(state, batch.batch_id, ops, scope)
        batch.req.batch = None
        del state.batches[batch.batch_id]
    for rec in list(state.requests.values()):
        if rec.phase is Phase.FINISHED:
            maybe_end(state, rec, scope)
    state.closed = SHUT_DOWN
