"""The drain: steps, selection, verification, submission and settlement.

A token step updates the shared step fields and hands over to the policy
(``PolicyHooks.token_step``), which plans and calls :func:`apply_plan`.
Selection (:func:`select`) takes a *front slice* of a request's buffer into
one *batch* (ops VERIFYING), protects its blocks (``ProtectBlocks``) and
asks for their hashes (``ReadHashes``). The answer (:func:`on_hashes`)
submits the valid prefix as one ``SubmitStore`` (ops IN_FLIGHT) and drops the
first mismatching op and everything after it as stale: stale KV is never
stored. Receipts (:func:`on_receipts`) count up to the world size, then
:func:`settle` books the batch stored or failed and releases its pins. A
failure breaks the request's chain: its held-back ops are dropped, because
LMCache retrieves from token 0 and could never reach them.

The receipt lease (``receipt_lease_s``, logical time from ``StepScheduled``):
a batch still short of receipts that long after its selection is abandoned
(:func:`expire_leases`): booked ABANDONED, its pins released, its chain
broken, and the receipts still due from it swallowed when they come late
(``ReceiptIgnored`` ``LEASE_EXPIRED``), so a late report never settles a
later batch of the same request. Batches sit in ``State.batches`` in
selection order, so the check stops at the first young batch: O(expired).
"""

from __future__ import annotations

from offload_fsm.rules.buffer import (
    after_buffer_change,
    count_drop,
    drop_pending,
    maybe_end,
    refresh_ready,
)
from offload_fsm.rules.legality import move
from offload_fsm.rules.pins import blocks_of, protect, release
from offload_fsm.rules.plan import Plan, ema_update
from offload_fsm.rules.scope import Scope
from offload_fsm.rules.split import split
from offload_fsm.state import Batch, BatchStatus, Op, OpStatus, RequestState, State
from offload_fsm.vocabulary.commands import ReadHashes, SubmitStore
from offload_fsm.vocabulary.counters import HELD, SELECTED_BY, Counter
from offload_fsm.vocabulary.decisions import (
    DropCause,
    IgnoreReason,
    OpsHeld,
    OpsSelected,
    ReceiptIgnored,
    SelectReason,
    SplitReason,
    StoreAbandoned,
    StoreSettled,
    StoreSubmitted,
)
from offload_fsm.vocabulary.errors import InvalidEvent
from offload_fsm.vocabulary.events import (
    MAX_STEPS_PASSED,
    HashesRead,
    ReceiptsArrived,
    StepScheduled,
    StepsPassed,
)


def on_step(state: State, event: StepScheduled, scope: Scope) -> None:
    _check_step(state, event, scope)
    if state.config.receipt_lease_s > 0 and state.batches:
        expire_leases(state, event.time_s, scope)
    state.selected_in_step = 0
    if event.scheduled_tokens == 0:
        state.last_step_tokens = 0
        state.counters[Counter.EMPTY_STEPS] += 1
        scope.hooks.empty_step(state, scope)
        return
    _advance(state, event.scheduled_tokens, event.time_s, event.free_blocks,
             event.next_step_blocks, event.reserve_blocks)
    scope.hooks.token_step(state, event, scope)


def on_steps_passed(state: State, event: StepsPassed, scope: Scope) -> None:
    """Each passed token step, in order, as :func:`on_step` takes a token
    step that selects nothing (``StepsPassed``): checked, then the shared
    bookkeeping and the policy's ``passed_step``."""
    tag = event.TAG
    if not 0 < len(event.steps) <= MAX_STEPS_PASSED:
        raise InvalidEvent(tag, None, f"{len(event.steps)} passed steps; expected 1 to "
                           f"{MAX_STEPS_PASSED}")
    lease_s = state.config.receipt_lease_s
    for passed in event.steps:
        if len(passed) != 7:
            raise InvalidEvent(tag, None, f"a passed step of {len(passed)} fields, expected 7")
        tokens, allocated, next_blocks, reserve, free, window, time_s = passed
        if min(allocated, next_blocks, reserve, free, window) < 0 or tokens <= 0:
            raise InvalidEvent(tag, None, f"a passed step with a count out of range: {passed}")
        if time_s < state.time_s:
            raise InvalidEvent(tag, None, f"time went back from {state.time_s} to {time_s}")
        if state.shielded:
            raise InvalidEvent(tag, None, "a passed step while ops are shielded")
        if lease_s > 0 and state.batches and \
                time_s - next(iter(state.batches.values())).selected_time_s >= lease_s:
            raise InvalidEvent(tag, None, "a passed step at which a receipt lease ended")
        state.selected_in_step = 0
        _advance(state, tokens, time_s, free, next_blocks, reserve)
        scope.hooks.passed_step(state, allocated, next_blocks, free, window)


def _advance(state: State, tokens: int, time_s: float, free_blocks: int,
             next_step_blocks: int, reserve_blocks: int) -> None:
    """What every token step records, planned or passed."""
    state.last_step_tokens = tokens
    state.counters[Counter.TOKEN_STEPS] += 1
    state.step_index += 1
    state.time_s = time_s
    state.free_blocks = free_blocks
    state.next_step_blocks = next_step_blocks
    state.reserve_blocks = reserve_blocks


def _check_step(state: State, event: StepScheduled, scope: Scope) -> None:
    tag = event.TAG
    if min(event.scheduled_tokens, event.allocated_blocks, event.next_step_blocks,
           event.reserve_blocks, event.free_blocks) < 0:
        raise InvalidEvent(tag, None, f"negative count in {event!r}")
    if event.time_s < state.time_s:
        raise InvalidEvent(tag, None, f"time went back from {state.time_s} to {event.time_s}")
    if event.scheduled_tokens == 0:
        if event.window_block_ids or event.reallocated:
            raise InvalidEvent(tag, None, "an empty step carries a window or reallocations")
        return
    depth = scope.hooks.window_depth(
        state, event.scheduled_tokens, event.allocated_blocks, event.next_step_blocks,
        state.ema_blocks,
    )
    expected = min(depth, event.free_blocks)
    if len(event.window_block_ids) != expected:
        raise InvalidEvent(
            tag, None,
            f"window has {len(event.window_block_ids)} blocks, expected {expected} "
            "(min of the danger depth and the free-queue length)",
        )


def apply_plan(state: State, plan: Plan, scope: Scope) -> None:
    counters = state.counters
    for hold in plan.holds:
        counters[HELD[hold.reason]] += 1
        scope.decisions.append(
            OpsHeld(req_id=hold.rec.req_id, ops=hold.ops, reason=hold.reason)
        )
    for pick in plan.picks:
        if pick.split_blocks:
            split(state, pick.rec, pick.rec.ops[pick.count - 1], pick.split_blocks,
                  SplitReason.PIN_BUDGET, scope)
        select(state, pick.rec, pick.count, pick.reason, pick.rank, scope)
    if state.context is not None:
        state.context.ops_left -= plan.ops_used
        state.context.pin_headroom_blocks -= plan.headroom_used_blocks


def select(
    state: State, rec: RequestState, count: int, reason: SelectReason, rank: int, scope: Scope
) -> None:
    assert rec.batch is None, "a request with a batch in flight was selected"
    ops = rec.ops[:count]
    assert ops, "an empty selection"
    del rec.ops[:count]
    hooks = scope.hooks
    hooks.unbuffered(state, ops)
    ops = hooks.selecting(state, rec, ops, scope)
    if not ops:
        after_buffer_change(state, rec)
        maybe_end(state, rec, scope)
        return
    move(state, ops, OpStatus.VERIFYING)
    batch = Batch(batch_id=state.next_batch_id, req=rec, ops=ops,
                  selected_step=state.step_index, selected_time_s=state.time_s)
    state.next_batch_id += 1
    state.batches[batch.batch_id] = batch
    rec.batch = batch
    state.selected_in_step += len(ops)
    state.counters[Counter.SELECTED_OPS] += len(ops)
    extra = SELECTED_BY.get(reason)
    if extra is not None:
        state.counters[extra] += len(ops)
    to_protect = blocks_of(op for op in ops if not op.pinned)
    for op in ops:
        op.pinned = True
    if to_protect:
        protect(state, batch.batch_id, to_protect, scope)
    scope.decisions.append(
        OpsSelected(req_id=rec.req_id, batch_id=batch.batch_id,
                    start_token=ops[0].start_token, end_token=ops[-1].end_token,
                    ops=len(ops), reason=reason, rank=rank)
    )
    scope.commands.append(
        ReadHashes(batch_id=batch.batch_id, block_ids=blocks_of(ops))
    )
    state.awaiting_hashes[batch.batch_id] = None
    after_buffer_change(state, rec)


def on_hashes(state: State, event: HashesRead, scope: Scope) -> None:
    batch = state.batches.get(event.batch_id)
    if event.batch_id not in state.awaiting_hashes or batch is None:
        raise InvalidEvent(event.TAG, None, f"no hashes were requested for batch {event.batch_id}")
    expected = sum(len(op.block_ids) for op in batch.ops)
    if len(event.block_hashes) != expected:
        raise InvalidEvent(
            event.TAG, batch.req.req_id,
            f"batch {batch.batch_id}: {len(event.block_hashes)} hashes read, expected {expected}",
        )
    del state.awaiting_hashes[event.batch_id]
    state.counters[Counter.BLOCKS_CHECKED] += expected
    good, bad_block = _verified_prefix(batch.ops, event.block_hashes)
    rec = batch.req
    stale = batch.ops[good:]
    if stale:
        scope.hooks.released(state, stale, False)
        release(state, batch.batch_id, stale, scope)
        count_drop(state, rec, stale, DropCause.STALE, bad_block, scope)
        if not batch.orphaned:
            rec.broken = True
            drop_pending(state, rec, DropCause.STALE, scope)
    batch.ops = batch.ops[:good]
    if not batch.ops:
        del state.batches[batch.batch_id]
        rec.batch = None
        refresh_ready(state, rec)
        maybe_end(state, rec, scope)
        return
    _submit(state, batch, scope)


def _verified_prefix(ops: list[Op], hashes_now: tuple[int | None, ...]) -> tuple[int, int]:
    """How many leading ops still hold their snapshot, and the first block
    that does not (-1 when all do)."""
    offset = 0
    for position, op in enumerate(ops):
        now = hashes_now[offset : offset + len(op.block_ids)]
        offset += len(op.block_ids)
        if now != op.block_hashes:
            bad = next(
                b for b, h, s in zip(op.block_ids, now, op.block_hashes, strict=True) if h != s
            )
            return position, bad
    return len(ops), -1


def _submit(state: State, batch: Batch, scope: Scope) -> None:
    rec = batch.req
    batch.status = BatchStatus.IN_FLIGHT
    move(state, batch.ops, OpStatus.IN_FLIGHT)
    block_ids = blocks_of(batch.ops)
    tokens = sum(op.tokens for op in batch.ops)
    state.counters[Counter.SUBMITTED_OPS] += len(batch.ops)
    state.counters[Counter.SUBMITTED_TOKENS] += tokens
    start, end = batch.ops[0].start_token, batch.ops[-1].end_token
    scope.decisions.append(
        StoreSubmitted(req_id=rec.req_id, batch_id=batch.batch_id, start_token=start,
                       end_token=end, ops=len(batch.ops), blocks=len(block_ids))
    )
    scope.commands.append(
        SubmitStore(batch_id=batch.batch_id, req_id=rec.req_id, start_token=start,
                    end_token=end, block_ids=block_ids)
    )


def on_receipts(state: State, event: ReceiptsArrived, scope: Scope) -> None:
    for req_id, count in event.completed:
        if count < 1:
            raise InvalidEvent(event.TAG, req_id, f"receipt count {count} is not positive")
    # Failures first: dropping a finished request's held-back ops lets the
    # completion in the same event end its session.
    # A failure is never ignored while a batch could be the one that failed:
    # failing a batch that had not is safe (nothing is stored), the reverse
    # is not.
    for req_id in event.failed:
        batch = _in_flight(state, req_id)
        if batch is None:
            rec = state.requests.get(req_id)
            reason = (IgnoreReason.LEASE_EXPIRED if rec is not None and rec.stray_receipts
                      else IgnoreReason.UNKNOWN_REQUEST)
            _ignore(state, req_id, 0, True, reason, scope)
            continue
        if not batch.failed and not batch.orphaned:
            drop_pending(state, batch.req, DropCause.STORE_FAILED, scope)
            batch.req.broken = True
        batch.failed = True
    for req_id, count in event.completed:
        count = _swallow_stray(state, req_id, count, scope)
        if not count:
            continue
        batch = _in_flight(state, req_id)
        if batch is None:
            _ignore(state, req_id, count, False, IgnoreReason.UNKNOWN_REQUEST, scope)
            continue
        batch.receipts += count
        if batch.receipts > state.world_size:
            _ignore(state, req_id, batch.receipts - state.world_size, False,
                    IgnoreReason.EXCESS_COUNT, scope)
        if batch.receipts >= state.world_size:
            settle(state, batch, scope)


def settle(state: State, batch: Batch, scope: Scope) -> None:
    """Every worker reported: book the batch, release its pins, go on."""
    rec = batch.req
    ops = batch.ops
    tokens = sum(op.tokens for op in ops)
    scope.hooks.released(state, ops, not batch.failed)
    if batch.failed:
        move(state, ops, OpStatus.FAILED)
        state.counters[Counter.FAILED_OPS] += len(ops)
        state.counters[Counter.FAILED_TOKENS] += tokens
    else:
        move(state, ops, OpStatus.STORED)
        state.counters[Counter.STORED_OPS] += len(ops)
        state.counters[Counter.STORED_TOKENS] += tokens
    release(state, batch.batch_id, ops, scope)
    lifetime = state.step_index - batch.selected_step
    state.pin_steps_ema = ema_update(state.pin_steps_ema, lifetime)
    scope.decisions.append(
        StoreSettled(req_id=rec.req_id, batch_id=batch.batch_id, ops=len(ops), tokens=tokens,
                     failed=batch.failed, orphaned=batch.orphaned)
    )
    del state.batches[batch.batch_id]
    rec.batch = None
    # Every worker reported on a later store: an abandoned batch's receipts,
    # which the workers send in order, can no longer come.
    rec.stray_receipts = 0
    refresh_ready(state, rec)
    maybe_end(state, rec, scope)


def expire_leases(state: State, now_s: float, scope: Scope) -> None:
    lease_s = state.config.receipt_lease_s
    expired = []
    for batch in state.batches.values():
        if now_s - batch.selected_time_s < lease_s:
            break
        expired.append(batch)
    for batch in expired:
        _abandon(state, batch, now_s, scope)


def _abandon(state: State, batch: Batch, now_s: float, scope: Scope) -> None:
    rec = batch.req
    ops = batch.ops
    tokens = sum(op.tokens for op in ops)
    scope.hooks.released(state, ops, False)
    move(state, ops, OpStatus.ABANDONED)
    counters = state.counters
    counters[Counter.ABANDONED_OPS] += len(ops)
    counters[Counter.ABANDONED_TOKENS] += tokens
    counters[Counter.ABANDONED_BATCHES] += 1
    release(state, batch.batch_id, ops, scope)
    scope.decisions.append(
        StoreAbandoned(req_id=rec.req_id, batch_id=batch.batch_id, ops=len(ops), tokens=tokens,
                       receipts=batch.receipts, waited_s=now_s - batch.selected_time_s)
    )
    del state.batches[batch.batch_id]
    rec.batch = None
    rec.stray_receipts += state.world_size - batch.receipts
    if not batch.orphaned:
        rec.broken = True
        drop_pending(state, rec, DropCause.STORE_FAILED, scope)
    refresh_ready(state, rec)
    maybe_end(state, rec, scope)


def _swallow_stray(state: State, req_id: str, count: int, scope: Scope) -> int:
    """Take late receipts of an abandoned batch out of ``count``."""
    rec = state.requests.get(req_id)
    if rec is None or not rec.stray_receipts:
        return count
    swallowed = min(count, rec.stray_receipts)
    rec.stray_receipts -= swallowed
    _ignore(state, req_id, swallowed, False, IgnoreReason.LEASE_EXPIRED, scope)
    return count - swallowed


def _in_flight(state: State, req_id: str) -> Batch | None:
    rec = state.requests.get(req_id)
    if rec is None or rec.batch is None or rec.batch.status is not BatchStatus.IN_FLIGHT:
        return None
    return rec.batch


def _ignore(
    state: State, req_id: str, count: int, failed: bool, reason: IgnoreReason, scope: Scope
) -> None:
    state.counters[Counter.RECEIPTS_IGNORED] += 1
    scope.decisions.append(
        ReceiptIgnored(req_id=req_id, count=count, failed=failed, reason=reason)
    )

