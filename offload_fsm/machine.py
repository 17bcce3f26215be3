"""The transition function: ``step(state, event) -> Outcome``, the only writer
of state.

Rules this module keeps
-----------------------
1. Everything that changes state happens here; ``policies`` only plans and
   ``invariants``/``digest`` only read.
2. No clock, no randomness, no I/O, no logging. Time arrives on events; ids
   (op, batch, admission order) are counters in the state; iteration follows
   dict insertion order. The same events give the same decisions, commands and
   state digest, in any process.
3. An event is validated before anything is written. An invalid event raises
   :class:`InvalidEvent` and poisons the state; later steps raise
   :class:`MachinePoisoned`. ``ShutdownRequested`` closes it the same way.

Theory of operation
-------------------
There are three lifecycles.

*Store op* (one chunk-aligned token range of a request)::

    offered --admit--> BUFFERED --select--> VERIFYING --hashes ok--> IN_FLIGHT
       |                  |                     |                       |
       +--> rejected      +--> dropped           +--> dropped(stale)     +--> stored | failed
          (unhashed,         (evicted, preempted,                          (all workers
           prefix broken)     id reuse, store failed,                       reported)
                              cache reset, shutdown)

Selection takes a *front slice* of the request's buffer into one *batch*. The
batch's blocks are protected (``ProtectBlocks``) and re-read (``ReadHashes``);
the answer (``HashesRead``) submits the valid prefix as one ``SubmitStore`` and
drops the first mismatching op and everything after it (never storing stale
KV). Receipts count up to the world size; then ``ReleaseBlocks`` unpins.
Any loss breaks the request's prefix chain: later ops are dropped or
rejected, because LMCache retrieves from token 0 and could never reach them.

*Request*: ACTIVE until ``RequestFinished`` (FINISHED). ``RequestPreempted``
drops its buffer, orphans its batch and restarts its chain; ``RequestArrived``
for a FINISHED id is id reuse (drop the predecessor's buffer, orphan its
batch, end its session now if nothing is in flight). A FINISHED request with
nothing buffered and no batch ends its session (``EndSession``) exactly once.

*Step*: ``StepScheduled`` with tokens updates the allocation EMA and the
danger depth, applies reported reallocations (incremental loss detection:
only blocks allocated this step are checked, through the block->op index),
then plans a drain (``policies``). Its commands are answered before the next
observation; a ``FreeQueueRead`` answer runs the pin-cascade round. A step
with zero scheduled tokens selects nothing (vLLM discards connector metadata
built on it); it only lifts the shields of finished requests, because an idle
engine must not hold pins.

Three rules beat LMCache's EVICTION_AWARE where it loses data (the rationale
is in ``policies``): the *shield* protects a finishing request's buffered ops
when its freed blocks would land within reach of the next ``schedule()`` (the
blind window; an empty step lifts shields, idle never holds pins); the *pin
cascade* re-reads the window after the drain's own pins; the *pin budget*
keeps the running requests' reserve free. Content dedup (EVICTION_AWARE)
trims chunks another batch stored or is storing (``DropCause.DUPLICATE``,
not a loss) and rejects candidates whose chunks are all stored.

Ledger (ops; the same holds for tokens)::

    admitted == pending + verifying + in_flight + stored + failed + abandoned
                + sum(dropped_<cause>)
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable

import attrs

from offload_fsm.commands import (
    Command,
    EndSession,
    ProtectBlocks,
    ReadFreeQueue,
    ReadHashes,
    ReleaseBlocks,
    SubmitStore,
)
from offload_fsm.config import Policy
from offload_fsm.decisions import (
    BatchOrphaned,
    Decision,
    DropCause,
    IgnoreReason,
    OpRejected,
    OpsDropped,
    OpsHeld,
    OpsSelected,
    OpsShielded,
    ReceiptIgnored,
    RejectReason,
    SelectReason,
    ShieldLifted,
    StoreSettled,
    StoreSubmitted,
)
from offload_fsm.errors import InvalidEvent, MachinePoisoned
from offload_fsm.events import (
    CandidateOffered,
    Event,
    FreeQueueRead,
    HashesRead,
    PrefixCacheReset,
    ReceiptsArrived,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    ShutdownRequested,
    StepScheduled,
)
from offload_fsm.policies import (
    EMA_ALPHA,
    Plan,
    danger_depth,
    next_ema,
    next_peak,
    plan_eviction_aware,
    plan_fifo,
)
from offload_fsm.state import (
    STORED_KEYS_MAX,
    Batch,
    BatchStatus,
    Op,
    Phase,
    RequestState,
    State,
    StepContext,
)


@attrs.frozen(kw_only=True)
class Outcome:
    decisions: tuple[Decision, ...]
    commands: tuple[Command, ...]


class _Emit:
    """Collects one step's decisions and commands."""

    __slots__ = ("decisions", "commands")

    def __init__(self) -> None:
        self.decisions: list[Decision] = []
        self.commands: list[Command] = []


# --------------------------------------------------------------------------
# Queries the shell may call (read-only).


def window_depth(
    state: State, *, scheduled_tokens: int, allocated_blocks: int, next_step_blocks: int
) -> int:
    """How many free-queue blocks the shell must read into the next
    ``StepScheduled``: the danger depth after this step's EMA update (the shell
    caps it by the queue length). 0 for FIFO, for empty steps, and when no
    buffered op covers any block: then no rank can matter, and the shell
    skips the walk."""
    if (
        state.config.policy is not Policy.EVICTION_AWARE
        or scheduled_tokens == 0
        or not state.owners
    ):
        return 0
    ema = next_ema(state.ema_blocks, allocated_blocks)
    return danger_depth(ema, next_step_blocks, state.config.horizon_steps)


def watches(state: State, block_id: int) -> bool:
    """Whether a buffered op covers ``block_id`` (report it when reallocated)."""
    return block_id in state.owners


def has_in_flight(state: State) -> bool:
    """Whether vLLM must keep stepping: a submitted store awaits receipts, or
    shielded ops hold pins that the next empty step will lift."""
    return bool(state.shielded) or any(
        b.status is BatchStatus.IN_FLIGHT for b in state.batches.values()
    )


# --------------------------------------------------------------------------
# The step function.


def step(state: State, event: Event) -> Outcome:
    """Apply one event. See the module docstring for the contract."""
    if state.poisoned is not None:
        raise MachinePoisoned(state.poisoned)
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"not an offload_fsm event: {event!r}")
    out = _Emit()
    try:
        if not isinstance(event, _ANSWERS) and (
            state.awaiting_hashes or state.awaiting_queue
        ):
            raise InvalidEvent(
                event.TAG,
                getattr(event, "req_id", None),
                f"{type(event).__name__} arrived while answers are outstanding "
                f"(hashes for batches {list(state.awaiting_hashes)}, "
                f"free queue {state.awaiting_queue})",
            )
        handler(state, event, out)
        if not state.awaiting_hashes and not state.awaiting_queue:
            state.context = None
    except InvalidEvent as error:
        state.poisoned = str(error)
        raise
    return Outcome(decisions=tuple(out.decisions), commands=tuple(out.commands))


def drive(
    state: State,
    event: Event,
    execute: Callable[[Command], Event | None],
) -> list[tuple[Event, Outcome]]:
    """Apply an observation and run its command loop to completion.

    ``execute`` performs each command in order and returns the answer event
    for ``ReadHashes``/``ReadFreeQueue`` (``None`` otherwise). Answers are fed
    back in command order. Returns every (event, outcome) applied, the
    observation first, so the shell can log all inputs.
    """
    applied: list[tuple[Event, Outcome]] = []
    queue = [event]
    while queue:
        current = queue.pop(0)
        outcome = step(state, current)
        applied.append((current, outcome))
        for command in outcome.commands:
            answer = execute(command)
            if answer is not None:
                queue.append(answer)
    return applied


# --------------------------------------------------------------------------
# Observations.


def _on_arrived(state: State, event: RequestArrived, out: _Emit) -> None:
    rec = state.requests.get(event.req_id)
    if rec is None:
        state.requests[event.req_id] = RequestState(req_id=event.req_id)
        return
    if rec.phase is Phase.ACTIVE:
        return  # re-arrival after preemption: the reset already happened
    # Id reuse: the predecessor finished but its teardown was deferred.
    _drop_pending(state, rec, DropCause.ID_REUSE, out)
    rec.broken = False
    rec.next_start_token = None
    rec.phase = Phase.ACTIVE
    if rec.batch is None:
        out.commands.append(EndSession(req_id=rec.req_id))
    else:
        _orphan(rec, out)


def _on_offered(state: State, event: CandidateOffered, out: _Emit) -> None:
    rec = state.requests.get(event.req_id)
    tag, req_id = event.TAG, event.req_id
    if rec is None:
        raise InvalidEvent(tag, req_id, "store candidate for a request that never arrived")
    if rec.phase is Phase.FINISHED:
        raise InvalidEvent(tag, req_id, "store candidate after the request finished")
    if not 0 <= event.start_token < event.end_token:
        raise InvalidEvent(
            tag, req_id, f"token range [{event.start_token}, {event.end_token}) is empty"
        )
    if not event.block_ids or len(event.block_ids) != len(event.block_hashes):
        raise InvalidEvent(
            tag,
            req_id,
            f"{len(event.block_ids)} block ids but {len(event.block_hashes)} hashes "
            "(need equal, non-zero counts)",
        )
    if event.blocks_per_chunk < 0 or (
        event.blocks_per_chunk and len(event.block_ids) % event.blocks_per_chunk
    ):
        raise InvalidEvent(
            tag, req_id,
            f"{len(event.block_ids)} blocks are not whole chunks of {event.blocks_per_chunk}",
        )
    if rec.next_start_token is not None and event.start_token != rec.next_start_token:
        raise InvalidEvent(
            tag,
            req_id,
            f"range starts at {event.start_token}, expected {rec.next_start_token} "
            "(ranges of a request must be contiguous)",
        )
    rec.next_start_token = event.end_token
    counters = state.counters
    if rec.broken:
        counters["rejected_prefix_broken_ops"] += 1
        out.decisions.append(
            OpRejected(req_id=req_id, start_token=event.start_token,
                       end_token=event.end_token, reason=RejectReason.PREFIX_BROKEN)
        )
        return
    if None in event.block_hashes:
        rec.broken = True
        counters["rejected_unhashed_ops"] += 1
        out.decisions.append(
            OpRejected(req_id=req_id, start_token=event.start_token,
                       end_token=event.end_token, reason=RejectReason.UNHASHED)
        )
        return
    op = Op(
        op_id=state.next_op_id,
        req=rec,
        start_token=event.start_token,
        end_token=event.end_token,
        block_ids=event.block_ids,
        block_hashes=event.block_hashes,
        time_s=event.time_s,
        blocks_per_chunk=event.blocks_per_chunk,
    )
    ea = state.config.policy is Policy.EVICTION_AWARE
    if ea and all(key in state.stored_keys for key in op.chunk_keys):
        # Content dedup: LMCache keys chunks by their token prefix, which the last
        # block's (chained) hash names; every chunk is already stored. Not a loss:
        # the request's chain stays intact.
        counters["rejected_already_stored_ops"] += 1
        out.decisions.append(
            OpRejected(req_id=req_id, start_token=event.start_token,
                       end_token=event.end_token, reason=RejectReason.ALREADY_STORED)
        )
        return
    state.next_op_id += 1
    counters["admitted_ops"] += 1
    counters["admitted_tokens"] += op.tokens
    if not rec.ops:
        rec.order = state.next_order
        state.next_order += 1
        state.pending[req_id] = rec
    rec.ops.append(op)
    if len(rec.ops) == 1:
        _push_deadline(state, rec)
    if ea:
        _index(state, op, out)


def _on_step(state: State, event: StepScheduled, out: _Emit) -> None:
    tag = event.TAG
    if min(event.scheduled_tokens, event.allocated_blocks, event.next_step_blocks,
           event.reserve_blocks, event.free_blocks) < 0:
        raise InvalidEvent(tag, None, f"negative count in {event!r}")
    if event.time_s < state.time_s:
        raise InvalidEvent(tag, None, f"time went back from {state.time_s} to {event.time_s}")
    counters = state.counters
    if event.scheduled_tokens == 0:
        if event.window_block_ids or event.reallocated:
            raise InvalidEvent(tag, None, "an empty step carries a window or reallocations")
        state.last_step_tokens = 0
        state.selected_in_step = 0
        counters["empty_steps"] += 1
        _lift_shields(state, out)
        return
    expected = min(
        window_depth(
            state,
            scheduled_tokens=event.scheduled_tokens,
            allocated_blocks=event.allocated_blocks,
            next_step_blocks=event.next_step_blocks,
        ),
        event.free_blocks,
    )
    if len(event.window_block_ids) != expected:
        raise InvalidEvent(
            tag, None,
            f"window has {len(event.window_block_ids)} blocks, expected {expected} "
            "(min of the danger depth and the free-queue length)",
        )
    state.last_step_tokens = event.scheduled_tokens
    state.selected_in_step = 0
    counters["token_steps"] += 1
    state.step_index += 1
    state.time_s = event.time_s
    state.free_blocks = event.free_blocks
    state.next_step_blocks = event.next_step_blocks
    state.reserve_blocks = event.reserve_blocks
    if state.config.policy is Policy.FIFO:
        _apply_plan(state, plan_fifo(state), out)
        return
    state.ema_blocks = next_ema(state.ema_blocks, event.allocated_blocks)
    state.peak_blocks = next_peak(state.peak_blocks, event.allocated_blocks)
    state.depth_blocks = danger_depth(
        state.ema_blocks, event.next_step_blocks, state.config.horizon_steps
    )
    counters["window_blocks_read"] += len(event.window_block_ids)
    _apply_reallocations(state, event.reallocated, out)
    overdue = _pop_overdue(state)
    if not overdue and not state.shielded and state.owners.keys().isdisjoint(
        event.window_block_ids
    ):
        return  # nothing due: the common step costs one C-level set test
    ctx = StepContext(
        ops_left=state.config.max_drain_per_step,
        pin_headroom_blocks=max(0, event.free_blocks - _pin_reserve(state, event.reserve_blocks)),
        depth_blocks=state.depth_blocks,
        window_seen=set(event.window_block_ids),
    )
    state.context = ctx
    plan = plan_eviction_aware(
        state,
        ctx,
        enumerate(event.window_block_ids),
        reason=SelectReason.WINDOW,
        with_shielded=True,
        overdue=overdue,
    )
    _apply_plan(state, plan, out)
    _maybe_cascade(state, ctx, plan, out)


def _on_finished(state: State, event: RequestFinished, out: _Emit) -> None:
    rec = state.requests.get(event.req_id)
    if rec is None:
        out.commands.append(EndSession(req_id=event.req_id))
        return
    if rec.phase is Phase.FINISHED:
        raise InvalidEvent(event.TAG, event.req_id, "request finished twice")
    rec.phase = Phase.FINISHED
    if state.config.policy is Policy.EVICTION_AWARE and rec.ops:
        # Even behind an in-flight batch: the shielded ops wait pinned, not exposed.
        _maybe_shield(state, rec, event.free_blocks, event.next_step_max_blocks, out)
    _refresh_ready(state, rec)
    _maybe_end(state, rec, out)


def _on_preempted(state: State, event: RequestPreempted, out: _Emit) -> None:
    rec = state.requests.get(event.req_id)
    if rec is None:
        return
    if rec.phase is Phase.FINISHED:
        raise InvalidEvent(event.TAG, event.req_id, "a finished request was preempted")
    _drop_pending(state, rec, DropCause.PREEMPTED, out)
    rec.broken = False
    rec.next_start_token = None
    if rec.batch is not None and not rec.batch.orphaned:
        _orphan(rec, out)


def _on_receipts(state: State, event: ReceiptsArrived, out: _Emit) -> None:
    for req_id, count in event.completed:
        if count < 1:
            raise InvalidEvent(event.TAG, req_id, f"receipt count {count} is not positive")
    # Failures first: dropping a finished request's held-back ops lets the
    # completion in the same event end its session.
    for req_id in event.failed:
        batch = _in_flight(state, req_id)
        if batch is None:
            _ignore(state, req_id, 0, True, IgnoreReason.UNKNOWN_REQUEST, out)
            continue
        if not batch.failed and not batch.orphaned:
            rec = batch.req
            _drop_pending(state, rec, DropCause.STORE_FAILED, out)
            rec.broken = True
        batch.failed = True
    for req_id, count in event.completed:
        batch = _in_flight(state, req_id)
        if batch is None:
            _ignore(state, req_id, count, False, IgnoreReason.UNKNOWN_REQUEST, out)
            continue
        batch.receipts += count
        if batch.receipts > state.world_size:
            _ignore(state, req_id, batch.receipts - state.world_size, False,
                    IgnoreReason.EXCESS_COUNT, out)
        if batch.receipts >= state.world_size:
            _settle(state, batch, out)


def _on_cache_reset(state: State, event: PrefixCacheReset, out: _Emit) -> None:
    for rec in list(state.pending.values()):
        _drop_pending(state, rec, DropCause.CACHE_RESET, out)
        rec.broken = True
        _maybe_end(state, rec, out)


def _on_shutdown(state: State, event: ShutdownRequested, out: _Emit) -> None:
    counters = state.counters
    for rec in list(state.pending.values()):
        _drop_pending(state, rec, DropCause.SHUTDOWN, out)
    for batch in list(state.batches.values()):
        ops = batch.ops
        counters["abandoned_ops"] += len(ops)
        counters["abandoned_tokens"] += sum(op.tokens for op in ops)
        _unclaim(state, ops, stored=False)
        _release(state, batch.batch_id, ops, out)
        batch.req.batch = None
        del state.batches[batch.batch_id]
    for rec in list(state.requests.values()):
        if rec.phase is Phase.FINISHED:
            _maybe_end(state, rec, out)
    state.closed = True
    state.poisoned = "the machine was shut down"


# --------------------------------------------------------------------------
# Answers.


def _on_hashes(state: State, event: HashesRead, out: _Emit) -> None:
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
    state.counters["blocks_checked"] += expected
    good = len(batch.ops)
    bad_block = -1
    offset = 0
    for index, op in enumerate(batch.ops):
        now = event.block_hashes[offset : offset + len(op.block_ids)]
        offset += len(op.block_ids)
        if now != op.block_hashes:
            good = index
            bad_block = next(
                b for b, h, s in zip(op.block_ids, now, op.block_hashes, strict=True) if h != s
            )
            break
    rec = batch.req
    stale = batch.ops[good:]
    if stale:
        _unclaim(state, stale, stored=False)
        _release(state, batch.batch_id, stale, out)
        _count_drop(state, rec, stale, DropCause.STALE, bad_block, out)
        if not batch.orphaned:
            rec.broken = True
            _drop_pending(state, rec, DropCause.STALE, out)
    batch.ops = batch.ops[:good]
    if not batch.ops:
        del state.batches[batch.batch_id]
        rec.batch = None
        _refresh_ready(state, rec)
        _maybe_end(state, rec, out)
        return
    batch.status = BatchStatus.IN_FLIGHT
    block_ids = tuple(b for op in batch.ops for b in op.block_ids)
    tokens = sum(op.tokens for op in batch.ops)
    state.counters["submitted_ops"] += len(batch.ops)
    state.counters["submitted_tokens"] += tokens
    start, end = batch.ops[0].start_token, batch.ops[-1].end_token
    out.decisions.append(
        StoreSubmitted(req_id=rec.req_id, batch_id=batch.batch_id, start_token=start,
                       end_token=end, ops=len(batch.ops), blocks=len(block_ids))
    )
    out.commands.append(
        SubmitStore(batch_id=batch.batch_id, req_id=rec.req_id, start_token=start,
                    end_token=end, block_ids=block_ids)
    )


def _on_queue_read(state: State, event: FreeQueueRead, out: _Emit) -> None:
    ctx = state.context
    if not state.awaiting_queue or ctx is None:
        raise InvalidEvent(event.TAG, None, "no free-queue read was requested")
    if len(event.window_block_ids) > ctx.depth_blocks:
        raise InvalidEvent(
            event.TAG, None,
            f"free-queue read returned {len(event.window_block_ids)} blocks, "
            f"more than the {ctx.depth_blocks} asked for",
        )
    state.awaiting_queue = False
    fresh = [(rank, b) for rank, b in enumerate(event.window_block_ids)
             if b not in ctx.window_seen]
    state.counters["window_blocks_read"] += len(event.window_block_ids)
    ctx.window_seen.update(b for _, b in fresh)
    plan = plan_eviction_aware(
        state, ctx, fresh, reason=SelectReason.CASCADE, with_shielded=False, overdue=()
    )
    _apply_plan(state, plan, out)
    _maybe_cascade(state, ctx, plan, out)


# --------------------------------------------------------------------------
# Helpers (all writes go through these).


def _apply_plan(state: State, plan: Plan, out: _Emit) -> None:
    counters = state.counters
    for hold in plan.holds:
        counters[f"held_{hold.reason.value}"] += 1
        out.decisions.append(OpsHeld(req_id=hold.rec.req_id, ops=hold.ops, reason=hold.reason))
    for pick in plan.picks:
        _select(state, pick.rec, pick.count, pick.reason, pick.rank, out)
    if state.context is not None:
        state.context.ops_left -= plan.ops_used
        state.context.pin_headroom_blocks -= plan.headroom_used_blocks


def _select(
    state: State, rec: RequestState, count: int, reason: SelectReason, rank: int, out: _Emit
) -> None:
    assert rec.batch is None, "a request with a batch in flight was selected"
    ops = rec.ops[:count]
    assert ops, "an empty selection"
    del rec.ops[:count]
    _unindex(state, ops)
    if state.config.policy is Policy.EVICTION_AWARE:
        ops = _skip_duplicates(state, rec, ops, out)
        if not ops:
            _after_buffer_change(state, rec)
            _maybe_end(state, rec, out)
            return
        claimed = state.claimed_keys
        for op in ops:
            for key in op.chunk_keys:
                claimed[key] = claimed.get(key, 0) + 1
    batch = Batch(batch_id=state.next_batch_id, req=rec, ops=ops,
                  selected_step=state.step_index)
    state.next_batch_id += 1
    state.batches[batch.batch_id] = batch
    rec.batch = batch
    state.selected_in_step += len(ops)
    counters = state.counters
    counters["selected_ops"] += len(ops)
    if reason is not SelectReason.WINDOW and reason is not SelectReason.FIFO:
        counters[f"selected_{reason.value}_ops"] += len(ops)
    to_protect = tuple(b for op in ops if not op.pinned for b in op.block_ids)
    for op in ops:
        op.pinned = True
    if to_protect:
        _protect(state, batch.batch_id, to_protect, out)
    out.decisions.append(
        OpsSelected(req_id=rec.req_id, batch_id=batch.batch_id,
                    start_token=ops[0].start_token, end_token=ops[-1].end_token,
                    ops=len(ops), reason=reason, rank=rank)
    )
    out.commands.append(
        ReadHashes(batch_id=batch.batch_id, block_ids=tuple(b for op in ops for b in op.block_ids))
    )
    state.awaiting_hashes[batch.batch_id] = None
    _after_buffer_change(state, rec)


def _skip_duplicates(state: State, rec: RequestState, ops: list[Op], out: _Emit) -> list[Op]:
    """Leave out the leading chunks whose content another batch already stored
    or is storing (the server keys chunks by content, so the chain keeps no
    hole): whole duplicate ops are dropped, a partly duplicate first op is
    trimmed to its first new chunk."""
    stored, claimed = state.stored_keys, state.claimed_keys
    for index, op in enumerate(ops):
        keys = op.chunk_keys
        known = 0
        while known < len(keys) and (keys[known] in stored or keys[known] in claimed):
            known += 1
        if known == len(keys):
            continue
        if index:
            duplicates = ops[:index]
            _release_pinned(state, duplicates, out)
            _count_drop(state, rec, duplicates, DropCause.DUPLICATE, -1, out)
        if known:
            _trim(state, rec, op, known, out)
        return ops[index:]
    _release_pinned(state, ops, out)
    _count_drop(state, rec, ops, DropCause.DUPLICATE, -1, out)
    return []


def _trim(state: State, rec: RequestState, op: Op, chunks: int, out: _Emit) -> None:
    """Cut ``chunks`` leading chunks (already stored elsewhere) off ``op``."""
    chunk_tokens = op.tokens // len(op.chunk_keys)
    cut_blocks = chunks * op.blocks_per_chunk
    cut_tokens = chunks * chunk_tokens
    if op.pinned:
        _unpin(state, -1, op.block_ids[:cut_blocks], out)
    state.counters["dropped_duplicate_tokens"] += cut_tokens
    out.decisions.append(
        OpsDropped(req_id=rec.req_id, start_token=op.start_token,
                   end_token=op.start_token + cut_tokens, ops=0, tokens=cut_tokens,
                   cause=DropCause.DUPLICATE, block_id=-1)
    )
    op.start_token += cut_tokens
    op.block_ids = op.block_ids[cut_blocks:]
    op.block_hashes = op.block_hashes[cut_blocks:]


def _unclaim(state: State, ops: list[Op], *, stored: bool) -> None:
    if state.config.policy is not Policy.EVICTION_AWARE:
        return
    claimed = state.claimed_keys
    for op in ops:
        for key in op.chunk_keys:
            left = claimed[key] - 1
            if left:
                claimed[key] = left
            else:
                del claimed[key]
            if stored and key not in state.stored_keys:
                state.stored_keys[key] = None
                state.stored_keys_xor ^= key
                if len(state.stored_keys) > STORED_KEYS_MAX:
                    oldest = next(iter(state.stored_keys))
                    del state.stored_keys[oldest]
                    state.stored_keys_xor ^= oldest


PIN_RESERVE_SAFETY = 2.0


def _pin_reserve(state: State, reserve_blocks: int) -> int:
    """Free blocks a drain must leave: the running requests' per-step need
    (the shell's ``reserve_blocks``) for every step a pin is expected to live
    (selection to release, learned from settled batches) plus this one,
    doubled because the per-step need is a mean and arrives in bursts
    (measured on the tight multi-turn trace: 1x left one preemption more
    than no connector, 2x none, at equal recall; bench/README.md)."""
    return math.ceil(PIN_RESERVE_SAFETY * reserve_blocks * (1.0 + state.pin_steps_ema))


def _maybe_cascade(state: State, ctx: StepContext, plan: Plan, out: _Emit) -> None:
    ctx.window_pinned_blocks += plan.window_pinned_blocks
    if plan.window_pinned_blocks and ctx.ops_left > 0 and ctx.depth_blocks > 0:
        out.commands.append(ReadFreeQueue(depth_blocks=ctx.depth_blocks))
        state.awaiting_queue = True


def _maybe_shield(
    state: State, rec: RequestState, free_blocks: int, next_step_max_blocks: int, out: _Emit
) -> None:
    """The blind-window rule: blocks freed now join the free-queue tail at rank
    ``free_blocks``; if the next schedule() can allocate that deep (the danger
    depth, its token budget, or a recent allocation peak, whichever is
    largest) it can reallocate them before any drain sees them. Protect them
    now, unless the engine is idle (depth 0: idle never drains) or the free
    queue cannot spare the running requests' reserve (the pin budget)."""
    depth = state.depth_blocks
    reach = max(depth, next_step_max_blocks, math.ceil(state.peak_blocks))
    if depth == 0 or free_blocks >= reach or free_blocks < state.reserve_blocks:
        return
    ops = [op for op in rec.ops if not op.pinned]
    block_ids = tuple(b for op in ops for b in op.block_ids)
    if not block_ids:
        return
    for op in ops:
        op.pinned = True
    _protect(state, -1, block_ids, out)
    state.shielded[rec.req_id] = None
    state.counters["shielded_ops"] += len(ops)
    out.decisions.append(
        OpsShielded(req_id=rec.req_id, ops=len(ops), blocks=len(block_ids),
                    free_blocks=free_blocks, reach_blocks=reach)
    )


def _lift_shields(state: State, out: _Emit) -> None:
    for req_id in list(state.shielded):
        rec = state.requests[req_id]
        pinned = [op for op in rec.ops if op.pinned]
        blocks = sum(len(op.block_ids) for op in pinned)
        _release(state, -1, pinned, out)
        del state.shielded[req_id]
        out.decisions.append(ShieldLifted(req_id=req_id, ops=len(pinned), blocks=blocks))


def _apply_reallocations(
    state: State, reallocated: Iterable[tuple[int, int | None]], out: _Emit
) -> None:
    """Incremental loss detection: only blocks allocated this step are checked,
    each in O(1) unless it really changed (all holders share one snapshot)."""
    for block_id, hash_now in reallocated:
        holder = state.owners.get(block_id)
        if holder is None:
            continue
        first = holder if isinstance(holder, Op) else next(iter(holder.values()))
        if first.block_hashes[first.block_ids.index(block_id)] != hash_now:
            _lose_holders(state, block_id, out)


def _lose_holders(state: State, block_id: int, out: _Emit) -> None:
    """Every buffered op on ``block_id`` lost its data: drop each with the rest
    of its request (prefix closure) and break the chain."""
    holder = state.owners.get(block_id)
    victims = [holder] if isinstance(holder, Op) else list((holder or {}).values())
    for op in victims:
        rec = op.req
        if op not in rec.ops:
            continue  # already dropped with an earlier op of its request
        lost = rec.ops[rec.ops.index(op):]
        del rec.ops[rec.ops.index(op):]
        _unindex(state, lost)
        _release_pinned(state, lost, out)
        _count_drop(state, rec, lost, DropCause.EVICTED, block_id, out)
        rec.broken = True
        _after_buffer_change(state, rec)
        _maybe_end(state, rec, out)


def _index(state: State, op: Op, out: _Emit) -> None:
    owners = state.owners
    for position, block_id in enumerate(op.block_ids):
        holder = owners.get(block_id)
        if holder is None:
            owners[block_id] = op
            continue
        first = holder if isinstance(holder, Op) else next(iter(holder.values()))
        if first.block_hashes[first.block_ids.index(block_id)] != op.block_hashes[position]:
            # The block was reallocated without a report (e.g. a prefix-cache
            # reset): its earlier holders' data is gone.
            _lose_holders(state, block_id, out)
            owners[block_id] = op
        elif isinstance(holder, Op):
            owners[block_id] = {holder.op_id: holder, op.op_id: op}
        else:
            holder[op.op_id] = op


def _drop_pending(state: State, rec: RequestState, cause: DropCause, out: _Emit) -> None:
    if not rec.ops:
        return
    lost = rec.ops[:]
    rec.ops.clear()
    _unindex(state, lost)
    _release_pinned(state, lost, out)
    _count_drop(state, rec, lost, cause, -1, out)
    _after_buffer_change(state, rec)


def _count_drop(
    state: State, rec: RequestState, ops: list[Op], cause: DropCause, block_id: int, out: _Emit
) -> None:
    tokens = sum(op.tokens for op in ops)
    state.counters[f"dropped_{cause.value}_ops"] += len(ops)
    state.counters[f"dropped_{cause.value}_tokens"] += tokens
    out.decisions.append(
        OpsDropped(req_id=rec.req_id, start_token=ops[0].start_token,
                   end_token=ops[-1].end_token, ops=len(ops), tokens=tokens,
                   cause=cause, block_id=block_id)
    )


def _release_pinned(state: State, ops: list[Op], out: _Emit) -> None:
    pinned = [op for op in ops if op.pinned]
    if pinned:
        _release(state, -1, pinned, out)


def _protect(state: State, batch_id: int, block_ids: tuple[int, ...], out: _Emit) -> None:
    pins = state.pins
    for block_id in block_ids:
        pins[block_id] = pins.get(block_id, 0) + 1
    state.counters["protected_blocks"] += len(block_ids)
    out.commands.append(ProtectBlocks(batch_id=batch_id, block_ids=block_ids))


def _release(state: State, batch_id: int, ops: list[Op], out: _Emit) -> None:
    block_ids = tuple(b for op in ops if op.pinned for b in op.block_ids)
    for op in ops:
        op.pinned = False
    _unpin(state, batch_id, block_ids, out)


def _unpin(state: State, batch_id: int, block_ids: tuple[int, ...], out: _Emit) -> None:
    if not block_ids:
        return
    pins = state.pins
    for block_id in block_ids:
        left = pins[block_id] - 1
        if left:
            pins[block_id] = left
        else:
            del pins[block_id]
    state.counters["released_blocks"] += len(block_ids)
    out.commands.append(ReleaseBlocks(batch_id=batch_id, block_ids=block_ids))


def _settle(state: State, batch: Batch, out: _Emit) -> None:
    rec = batch.req
    ops = batch.ops
    tokens = sum(op.tokens for op in ops)
    outcome = "failed" if batch.failed else "stored"
    _unclaim(state, ops, stored=not batch.failed)
    state.counters[f"{outcome}_ops"] += len(ops)
    state.counters[f"{outcome}_tokens"] += tokens
    _release(state, batch.batch_id, ops, out)
    lifetime = state.step_index - batch.selected_step
    state.pin_steps_ema = EMA_ALPHA * lifetime + (1.0 - EMA_ALPHA) * state.pin_steps_ema
    out.decisions.append(
        StoreSettled(req_id=rec.req_id, batch_id=batch.batch_id, ops=len(ops), tokens=tokens,
                     failed=batch.failed, orphaned=batch.orphaned)
    )
    del state.batches[batch.batch_id]
    rec.batch = None
    _refresh_ready(state, rec)
    _maybe_end(state, rec, out)


def _orphan(rec: RequestState, out: _Emit) -> None:
    assert rec.batch is not None
    rec.batch.orphaned = True
    out.decisions.append(BatchOrphaned(req_id=rec.req_id, batch_id=rec.batch.batch_id))


def _in_flight(state: State, req_id: str) -> Batch | None:
    rec = state.requests.get(req_id)
    if rec is None or rec.batch is None or rec.batch.status is not BatchStatus.IN_FLIGHT:
        return None
    return rec.batch


def _ignore(
    state: State, req_id: str, count: int, failed: bool, reason: IgnoreReason, out: _Emit
) -> None:
    state.counters["receipts_ignored"] += 1
    out.decisions.append(ReceiptIgnored(req_id=req_id, count=count, failed=failed, reason=reason))


def _unindex(state: State, ops: list[Op]) -> None:
    if state.config.policy is not Policy.EVICTION_AWARE:
        return
    owners = state.owners
    for op in ops:
        for block_id in op.block_ids:
            holder = owners.get(block_id)
            if holder is op:
                del owners[block_id]
            elif isinstance(holder, dict) and op.op_id in holder:
                del holder[op.op_id]
                if len(holder) == 1:
                    owners[block_id] = next(iter(holder.values()))


def _after_buffer_change(state: State, rec: RequestState) -> None:
    """Keep the pending/shielded/ready indexes and the deadline heap in step
    with ``rec.ops``."""
    if rec.ops:
        _push_deadline(state, rec)
    else:
        state.pending.pop(rec.req_id, None)
    if not any(op.pinned for op in rec.ops):
        state.shielded.pop(rec.req_id, None)
    _refresh_ready(state, rec)


def _refresh_ready(state: State, rec: RequestState) -> None:
    if rec.phase is Phase.FINISHED and rec.ops and rec.batch is None:
        state.ready[rec.req_id] = None
    else:
        state.ready.pop(rec.req_id, None)


def _maybe_end(state: State, rec: RequestState, out: _Emit) -> None:
    if rec.phase is Phase.FINISHED and not rec.ops and rec.batch is None:
        del state.requests[rec.req_id]
        state.pending.pop(rec.req_id, None)
        state.ready.pop(rec.req_id, None)
        state.shielded.pop(rec.req_id, None)
        out.commands.append(EndSession(req_id=rec.req_id))


def _push_deadline(state: State, rec: RequestState) -> None:
    if state.config.max_deferral_seconds > 0 and rec.ops:
        front = rec.ops[0]
        heapq.heappush(state.deadlines, (front.time_s, rec.order, rec.req_id, front.op_id))


def _pop_overdue(state: State) -> list[RequestState]:
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


_ANSWERS = (HashesRead, FreeQueueRead)

_HANDLERS: dict[type, Callable[[State, Event, _Emit], None]] = {
    RequestArrived: _on_arrived,  # type: ignore[dict-item]
    CandidateOffered: _on_offered,  # type: ignore[dict-item]
    StepScheduled: _on_step,  # type: ignore[dict-item]
    RequestFinished: _on_finished,  # type: ignore[dict-item]
    RequestPreempted: _on_preempted,  # type: ignore[dict-item]
    ReceiptsArrived: _on_receipts,  # type: ignore[dict-item]
    PrefixCacheReset: _on_cache_reset,  # type: ignore[dict-item]
    ShutdownRequested: _on_shutdown,  # type: ignore[dict-item]
    HashesRead: _on_hashes,  # type: ignore[dict-item]
    FreeQueueRead: _on_queue_read,  # type: ignore[dict-item]
}
