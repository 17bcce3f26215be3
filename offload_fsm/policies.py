"""Drain policies: pure, read-only planning over the state.

A policy never writes state. It returns a :class:`Plan` (which requests'
front ops to select, which due requests to hold and why, and the budget it
used); ``machine`` applies the plan. Both policies emit only front slices of a
request's buffer, at most one batch per request per step, and nothing for a
request whose previous batch is still verifying or in flight.

FIFO (spec ``lazy-offload.md``): a request is *ready* when it has finished,
has buffered ops and no batch in flight. When the ready count reaches
``threshold`` on a token-producing step, up to ``select_count`` ready requests
are selected whole, in the order their first op entered the buffer.

EVICTION_AWARE (LMCache G3 semantics, plus three rules of ours):

* A request is *due* when a block of its buffered ops has a free-queue rank
  below the danger depth ``D`` (the window). Its due segment runs from its
  first op through the last op with a block in the window (prefix closure:
  a stored chunk never lacks its stored prefix).
* Candidates go most imminent first (lowest rank), admission order breaking
  ties; overdue-only requests (``max_deferral_seconds``) come after every
  at-risk one and release their whole buffer. At most ``max_drain_per_step``
  ops are selected per step; the cap may cut a segment, only ever to a front
  slice.
* Ours: *shielded* requests (protected at finish, the blind-window rule) rank
  before everything (-1): their blocks are already pinned, so storing them
  costs no free blocks and releases pins soonest.
* Ours: the *pin budget*. Protecting a block that sits in the free queue takes
  it away from the next ``schedule()``. vLLM preempts only when a *running*
  request cannot get its next block; the shell estimates what the running
  requests need per step (``reserve_blocks``: decodes that cross a block
  boundary plus continuing prefill chunks); a pin lives from selection to the
  last receipt (``pin_steps_ema`` token steps, learned from settled batches),
  so a plan may take at most ``free_blocks - reserve_blocks * (1 +
  pin_steps_ema)`` queued blocks per step (upstream's unbudgeted pins raised
  preemptions). New requests that do not fit simply
  wait, which costs no recomputation.
  A block counts as queued when it is in the window or belongs to a finished
  request (conservative for shared prefix blocks).
* Ours: the *pin cascade*. Selections made from the window pin window blocks,
  which pulls blocks from beyond ``D`` into it; the machine re-reads the
  window (``ReadFreeQueue``) and plans again over the newly visible blocks,
  until nothing new is pinned or the cap is spent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import attrs

from offload_fsm.decisions import HoldReason, SelectReason
from offload_fsm.state import Op, Phase, RequestState, State, StepContext

EMA_ALPHA = 0.3
DEPTH_CUTOFF = 0.5
OVERDUE_RANK = 1 << 62
SHIELDED_RANK = -1


@attrs.frozen(kw_only=True)
class Pick:
    rec: RequestState
    count: int  # front ops to select
    reason: SelectReason
    rank: int


@attrs.frozen(kw_only=True)
class Hold:
    rec: RequestState
    ops: int
    reason: HoldReason


@attrs.frozen(kw_only=True)
class Plan:
    picks: tuple[Pick, ...]
    holds: tuple[Hold, ...]
    ops_used: int
    headroom_used_blocks: int
    window_pinned_blocks: int


def next_ema(ema_blocks: float | None, allocated_blocks: int) -> float:
    """EMA of gross per-step block allocation (alpha 0.3; the first step seeds it)."""
    if ema_blocks is None:
        return float(allocated_blocks)
    return EMA_ALPHA * allocated_blocks + (1.0 - EMA_ALPHA) * ema_blocks


PEAK_DECAY = 0.95


def next_peak(peak_blocks: float, allocated_blocks: int) -> float:
    """A peak of per-step allocation that decays by 5% a token step. The EMA
    averages bursts away; a finished request's freed blocks must survive the
    next burst (an LMCache hit allocates every external token at once)."""
    return max(float(allocated_blocks), PEAK_DECAY * peak_blocks)


def danger_depth(ema_blocks: float, next_step_blocks: int, horizon_steps: float) -> int:
    """``ceil(max(EMA, next-step estimate) * horizon)``, or 0 below 0.5 (idle)."""
    horizon_blocks = max(ema_blocks, float(next_step_blocks)) * horizon_steps
    if horizon_blocks < DEPTH_CUTOFF:
        return 0
    return math.ceil(horizon_blocks)


def _queued_cost(op: Op, window: set[int]) -> int:
    """Free-queue blocks that protecting ``op`` would take from the allocator."""
    if op.pinned:
        return 0
    if op.req.phase is Phase.FINISHED:
        return len(op.block_ids)
    return sum(1 for block_id in op.block_ids if block_id in window)


def plan_eviction_aware(
    state: State,
    ctx: StepContext,
    ranked_blocks: Iterable[tuple[int, int]],
    *,
    reason: SelectReason,
    with_shielded: bool,
    overdue: Iterable[RequestState],
) -> Plan:
    """Plan one EA drain round over ``(rank, block_id)`` pairs of the window.

    ``with_shielded`` adds requests protected at finish; ``overdue`` lists the
    requests past ``max_deferral_seconds`` (the machine finds them).
    """
    due: dict[str, tuple[int, int, RequestState]] = {}  # req -> (rank, due_end, rec)
    held_in_flight: dict[str, RequestState] = {}
    owners = state.owners
    for rank, block_id in ranked_blocks:
        entry = owners.get(block_id)
        if entry is None:
            continue
        for op in (entry,) if isinstance(entry, Op) else tuple(entry.values()):
            rec = op.req
            if rec.batch is not None:
                held_in_flight[rec.req_id] = rec
                continue
            seen = due.get(rec.req_id)
            if seen is None:
                due[rec.req_id] = (rank, op.end_token, rec)
            elif op.end_token > seen[1]:
                due[rec.req_id] = (seen[0], op.end_token, rec)
    candidates: list[tuple[int, int, RequestState, int, SelectReason]] = [
        (rank, rec.order, rec, end, reason) for rank, end, rec in due.values()
    ]
    if with_shielded:
        for req_id in state.shielded:
            rec = state.requests[req_id]
            if rec.batch is None and req_id not in due:
                candidates.append(
                    (SHIELDED_RANK, rec.order, rec, rec.ops[-1].end_token, SelectReason.SHIELDED)
                )
    taken = {c[2].req_id for c in candidates}
    for rec in overdue:
        if rec.req_id not in taken and rec.batch is None:
            candidates.append(
                (OVERDUE_RANK, rec.order, rec, rec.ops[-1].end_token, SelectReason.OVERDUE)
            )
    candidates.sort(key=lambda c: (c[0], c[1]))

    picks: list[Pick] = []
    holds: list[Hold] = [Hold(rec=r, ops=len(r.ops), reason=HoldReason.IN_FLIGHT)
                         for r in held_in_flight.values()]
    ops_left = ctx.ops_left
    headroom = ctx.pin_headroom_blocks
    window_pinned: set[int] = set()
    for rank, _order, rec, due_end, why in candidates:
        segment = [op for op in rec.ops if op.end_token <= due_end]
        if ops_left <= 0:
            holds.append(Hold(rec=rec, ops=len(segment), reason=HoldReason.DRAIN_CAP))
            continue
        segment = segment[:ops_left]
        count = 0
        cost = 0
        for op in segment:
            op_cost = _queued_cost(op, ctx.window_seen)
            if cost + op_cost > headroom:
                break
            cost += op_cost
            count += 1
        if count == 0:
            holds.append(Hold(rec=rec, ops=len(segment), reason=HoldReason.PIN_BUDGET))
            continue
        picks.append(Pick(rec=rec, count=count, reason=why, rank=rank))
        ops_left -= count
        headroom -= cost
        for op in segment[:count]:
            if not op.pinned:
                window_pinned.update(b for b in op.block_ids if b in ctx.window_seen)
    return Plan(
        picks=tuple(picks),
        holds=tuple(holds),
        ops_used=ctx.ops_left - ops_left,
        headroom_used_blocks=ctx.pin_headroom_blocks - headroom,
        window_pinned_blocks=len(window_pinned),
    )


def plan_fifo(state: State) -> Plan:
    """Select up to ``select_count`` ready requests, whole, in buffer order,
    once at least ``threshold`` are ready."""
    config = state.config
    if len(state.ready) < config.threshold:
        return Plan(picks=(), holds=(), ops_used=0, headroom_used_blocks=0,
                    window_pinned_blocks=0)
    picks: list[Pick] = []
    for req_id, rec in state.pending.items():
        if req_id in state.ready:
            picks.append(Pick(rec=rec, count=len(rec.ops), reason=SelectReason.FIFO, rank=-1))
            if len(picks) >= config.select_count:
                break
    return Plan(
        picks=tuple(picks),
        holds=(),
        ops_used=sum(p.count for p in picks),
        headroom_used_blocks=0,
        window_pinned_blocks=0,
    )
