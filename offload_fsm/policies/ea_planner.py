"""EVICTION_AWARE's planner: pure, read-only, over the free-queue window.

LMCache G3 semantics, plus two rules of ours:

* A request is *due* when a block of its buffered ops has a free-queue rank
  below the danger depth ``D`` (the window). Its due segment runs from its
  first op through the last op with a block in the window (prefix closure:
  a stored chunk never lacks its stored prefix).
* ``D = ceil(max(EMA of per-step allocation, next-step estimate) * horizon)``,
  or 0 below 0.5 (idle).
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
  request cannot get its next block; a plan may take at most the step's pin
  headroom (``free_blocks - pins.pin_reserve``) of queued blocks. Requests
  that do not fit wait, which costs no recomputation. A block counts as
  queued when it is in the window or belongs to a finished request
  (conservative for shared prefix blocks), and is not protected already;
  each distinct block is charged once per plan, however many picks share it.
  Chunk granularity (``split``): in a round that no cascade re-read follows
  (its whole picks pinned no window block), the headroom the whole picks
  leave goes, in the same order, to the requests that round held whole for
  the pin budget: each gets its first op's longest chunk-aligned prefix that
  fits (``OpSplit``). Whole ops first, and no cut in a round a cascade
  follows: its re-read may show whole ops that need the headroom, which a
  part op cut before it would take (so neither cut in place, nor in the last
  round for every round's holds: both lose whole ops when requests repeat in
  bursts).
* Ours: content dedup may hold a due request whose whole selection another
  batch is storing, when waiting cannot lose it (``dedup``,
  ``HoldReason.CLAIMED``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from offload_fsm.policies import dedup
from offload_fsm.rules.plan import Hold, Pick, Plan, ema_update
from offload_fsm.rules.split import fitting_prefix
from offload_fsm.state import Op, Phase, RequestState, State, StepContext, holders
from offload_fsm.vocabulary.decisions import HoldReason, SelectReason

DEPTH_CUTOFF = 0.5
OVERDUE_RANK = 1 << 62
SHIELDED_RANK = -1
PEAK_DECAY = 0.95

# (rank, admission order, request, end token of its due segment, reason)
Candidate = tuple[int, int, RequestState, int, SelectReason]


def next_ema(ema_blocks: float | None, allocated_blocks: int) -> float:
    """EMA of gross per-step block allocation (the first step seeds it)."""
    if ema_blocks is None:
        return float(allocated_blocks)
    return ema_update(ema_blocks, allocated_blocks)


def next_peak(peak_blocks: float, allocated_blocks: int) -> float:
    """A peak of per-step allocation that decays by 5% a token step. The EMA
    averages bursts away; a finished request's freed blocks must survive the
    next burst (an LMCache hit allocates every external token at once)."""
    return max(float(allocated_blocks), PEAK_DECAY * peak_blocks)


def advanced(ema_blocks: float | None, peak_blocks: float, allocated_blocks: int,
             next_step_blocks: int, horizon_steps: float) -> tuple[float, float, int]:
    """A token step's allocation EMA, decaying peak and danger depth after it."""
    ema = next_ema(ema_blocks, allocated_blocks)
    return (ema, next_peak(peak_blocks, allocated_blocks),
            danger_depth(ema, next_step_blocks, horizon_steps))


def finish_reach(depth_blocks: int, peak_blocks: float, next_step_max_blocks: int) -> int | None:
    """How deep the next ``schedule()`` can allocate (the danger depth, its
    token budget, or the recent allocation peak, whichever is largest): a
    finish whose freed blocks join the free queue at a rank below this must
    shield them; None when the engine is idle (depth 0): nothing to shield."""
    if depth_blocks == 0:
        return None
    return max(depth_blocks, next_step_max_blocks, math.ceil(peak_blocks))


def danger_depth(ema_blocks: float, next_step_blocks: int, horizon_steps: float) -> int:
    """``ceil(max(EMA, next-step estimate) * horizon)``, or 0 below 0.5 (idle)."""
    horizon_blocks = max(ema_blocks, float(next_step_blocks)) * horizon_steps
    if horizon_blocks < DEPTH_CUTOFF:
        return 0
    return math.ceil(horizon_blocks)


def plan_eviction_aware(
    state: State,
    ctx: StepContext,
    ranked_blocks: Iterable[tuple[int, int]],
    *,
    reason: SelectReason,
    with_shielded: bool,
    overdue: Iterable[RequestState],
) -> Plan:
    """Plan one drain round over ``(rank, block_id)`` pairs of the window's
    buffered blocks (those ``State.owners`` covers), lowest rank first.

    ``with_shielded`` adds requests protected at finish; ``overdue`` lists the
    requests past ``max_deferral_seconds`` (``buffer.pop_overdue`` finds them).
    """
    due, in_flight = _due(state, ranked_blocks)
    candidates = _candidates(state, due, reason, with_shielded, overdue)
    holds = [Hold(rec=r, ops=len(r.ops), reason=HoldReason.IN_FLIGHT) for r in in_flight]
    return _fit(state, ctx, candidates, holds)


def _due(
    state: State, ranked_blocks: Iterable[tuple[int, int]]
) -> tuple[dict[str, tuple[int, int, RequestState]], list[RequestState]]:
    """Requests with a buffered block in the window: req -> (best rank, due
    end, request); and those held back by a batch still in flight."""
    due: dict[str, tuple[int, int, RequestState]] = {}
    held: dict[str, RequestState] = {}
    owners = state.owners
    taken: set[int] = set()  # entries seen (lowest rank first: a later block adds nothing)
    for rank, block_id in ranked_blocks:
        entry = owners[block_id]
        if id(entry) in taken:
            continue
        taken.add(id(entry))
        for op in holders(entry):
            rec = op.req
            if rec.batch is not None:
                held[rec.req_id] = rec
                continue
            seen = due.get(rec.req_id)
            if seen is None:
                due[rec.req_id] = (rank, op.end_token, rec)
            elif op.end_token > seen[1]:
                due[rec.req_id] = (seen[0], op.end_token, rec)
    return due, list(held.values())


def _candidates(
    state: State,
    due: dict[str, tuple[int, int, RequestState]],
    reason: SelectReason,
    with_shielded: bool,
    overdue: Iterable[RequestState],
) -> list[Candidate]:
    candidates: list[Candidate] = [
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
    return candidates


def _fit(
    state: State, ctx: StepContext, candidates: list[Candidate], holds: list[Hold]
) -> Plan:
    """Take candidates in order within the drain cap and the pin headroom.

    The headroom is charged per distinct free-queue block: a block two picks
    share (a prefix-cache hit) leaves the queue once, and a block already
    protected is not in it at all. A selection whose content another batch
    is storing may wait for it (``dedup.waits_for_claimant``)."""
    picks: list[Pick] = []
    ops_left = ctx.ops_left
    headroom = ctx.pin_headroom_blocks
    charged: set[int] = set()  # queued blocks this plan pins, each charged once
    claiming: set[int] = set()  # content keys this plan's picks claim (dedup)
    pinning: set[int] = set()  # blocks of those claims
    window_pinned: set[int] = set()
    cuttable: list[tuple[Candidate, Hold]] = []  # held whole for the pin budget
    for candidate in candidates:
        rank, _order, rec, due_end, why = candidate
        segment = [op for op in rec.ops if op.end_token <= due_end]
        if ops_left <= 0:
            holds.append(Hold(rec=rec, ops=len(segment), reason=HoldReason.DRAIN_CAP))
            continue
        segment = segment[:ops_left]
        count = 0
        taking: set[int] = set()
        for op in segment:
            more = queued_blocks(op, ctx.window_seen, state.pins) - charged - taking
            if len(taking) + len(more) > headroom:
                break
            taking |= more
            count += 1
        if count == 0:
            holds.append(Hold(rec=rec, ops=len(segment), reason=HoldReason.PIN_BUDGET))
            cuttable.append((candidate, holds[-1]))
            continue
        chosen = segment[:count]
        if dedup.waits_for_claimant(state, chosen, claiming, pinning):
            holds.append(Hold(rec=rec, ops=count, reason=HoldReason.CLAIMED))
            continue
        picks.append(Pick(rec=rec, count=count, reason=why, rank=rank))
        ops_left -= count
        headroom -= len(taking)
        charged |= taking
        dedup.note_pick(state, chosen, claiming, pinning)
        for op in chosen:
            if not op.pinned:
                window_pinned.update(ctx.window_seen.intersection(op.block_ids))
    if (window_pinned and ctx.depth_blocks) or not state.config.chunk_split:
        cuttable = []  # a cascade round follows: its whole ops come before any cut
    for (rank, _order, rec, _end, why), hold in cuttable:
        if ops_left <= 0 or headroom <= 0:
            break
        op = rec.ops[0]
        cut, taking = fitting_prefix(
            op, queued_blocks(op, ctx.window_seen, state.pins) - charged, headroom)
        if not cut or dedup.waits_for_claimant(state, [op], claiming, pinning):
            continue
        holds.remove(hold)
        picks.append(Pick(rec=rec, count=1, reason=why, rank=rank, split_blocks=cut))
        ops_left -= 1
        headroom -= len(taking)
        charged |= taking
        dedup.note_pick(state, [op], claiming, pinning)
        if not op.pinned:
            window_pinned.update(ctx.window_seen.intersection(op.block_ids[:cut]))
    return Plan(
        picks=tuple(picks),
        holds=tuple(holds),
        ops_used=ctx.ops_left - ops_left,
        headroom_used_blocks=ctx.pin_headroom_blocks - headroom,
        window_pinned=frozenset(window_pinned),
    )


def queued_blocks(op: Op, window: set[int], pins: dict[int, int]) -> set[int]:
    """Free-queue blocks that protecting ``op`` would take from the allocator."""
    if op.pinned:
        return set()
    if op.req.phase is Phase.FINISHED:
        return set(op.block_ids).difference(pins)
    return window.intersection(op.block_ids).difference(pins)
