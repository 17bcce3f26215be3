"""EVICTION_AWARE's transition rules: the danger window, the pin cascade,
the blind-window shield, and the hooks that keep its index and dedup state.

A token step updates the allocation EMA, the decaying peak and the danger
depth, applies the reported reallocations (``blockindex``: incremental loss
detection), then plans a drain over the free-queue window the shell read
(``ea_planner``) within the step's budget (``StepContext``: the drain cap and
the pin headroom, ``pins.pin_reserve``). A step with nothing due (no overdue
request, no shield, no buffered block in the window) costs one C-level set
test; otherwise one pass over the window (and over each cascade re-read)
keeps only the buffered blocks, and the planner works on those. A step
without scheduled tokens selects nothing (the spec evaluates drains on token
steps only; LMCache's manager says vLLM discards such a step's metadata, but
vLLM 0.32's workers do execute it, see ``tail_flush``, which uses that when a tail
flush is configured); it lifts the shields, because an idle engine must not
hold pins.

Three rules beat LMCache's EVICTION_AWARE where it loses data:

* The *shield* (``RequestFinished``): blocks freed now join the free-queue
  tail at rank ``free_blocks``; if the next ``schedule()`` can allocate that
  deep (the danger depth, its token budget, or the recent allocation peak,
  whichever is largest) it can reallocate them before any drain sees them.
  Protect them now, unless the engine is idle (depth 0). If the free queue
  cannot spare the running requests' reserve, protect only the longest
  chunk-aligned prefix that leaves that reserve in the queue once the rest
  of the freed blocks join it (``split``; ``OpSplit`` ``SHIELD``).
* The *lookup shield* (``LookupAnswered``): in one ``schedule()``, vLLM
  looks a waiting request up in LMCache and allocates for it at once: its
  LMCache hit (up to its whole prompt) and its new tokens, from the free
  queue's head, hundreds of blocks for a burst of repeated prompts, before
  any drain or window of this step sees them. The shell reads the reach of
  that allocation (the head, until as many blocks as it can take that no
  buffered op covers) and the core protects the buffered ops in it, each
  request's front through its last op in reach (prefix closure), most
  imminent first, within the pin headroom that leaves the allocation and
  the running requests' reserve in the queue (the request's op that crosses
  it cut to its longest chunk-aligned prefix, ``split``). The ops count as
  shielded: this step's drain selects them first; a step that schedules no
  token (its only work asynchronous loads) lifts them as it lifts every
  shield, and their blocks rejoin the free queue at its tail, out of reach.
* The *pin cascade*: selections made from the window pin window blocks,
  which pulls blocks from beyond ``D`` into it; the core asks for the window
  again (``ReadFreeQueue``) and plans over the newly visible blocks
  (``FreeQueueRead``), until nothing new is pinned or the cap is spent. The
  read goes ``cascade_lookahead_blocks`` beyond ``D``, and no further than
  the step's pin headroom left (the rounds after it cannot protect more of
  the queue's blocks than that): it is a prefix of the free queue,
  protecting a block only takes it out, and a released block rejoins at the
  tail, so while at least ``D`` of the read's blocks are still unprotected
  the next round's window is their first ``D``, and the rounds go on from
  the read without another (decided as one read a round would decide; 0
  reads once a round, as logs recorded before the key existed).
* The *pin budget* (``ea_planner``) keeps the running requests' reserve free.

Content dedup (``dedup``) trims chunks another batch stored, stores again
(or waits for, when waiting cannot lose them) chunks another batch is
storing, and rejects candidates whose chunks are all stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, filterfalse, islice

from offload_fsm.policies import blockindex, dedup
from offload_fsm.policies.ea_planner import (
    advanced,
    danger_depth,
    finish_reach,
    next_ema,
    plan_eviction_aware,
    queued_blocks,
)
from offload_fsm.rules import split
from offload_fsm.rules.buffer import pop_overdue
from offload_fsm.rules.drain import apply_plan
from offload_fsm.rules.pins import blocks_of, pin_reserve, protect, release
from offload_fsm.rules.plan import Plan
from offload_fsm.rules.scope import PolicyHooks, Scope
from offload_fsm.state import Op, RequestState, State, StepContext, holders
from offload_fsm.vocabulary.commands import ReadFreeQueue
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.decisions import OpsShielded, SelectReason, ShieldLifted, SplitReason
from offload_fsm.vocabulary.errors import InvalidEvent
from offload_fsm.vocabulary.events import (
    FreeQueueRead,
    LookupAnswered,
    PassedStep,
    RequestFinished,
    StepScheduled,
    StepsPassed,
)


def window_depth(
    state: State, scheduled_tokens: int, allocated_blocks: int, next_step_blocks: int,
    ema_blocks: float | None,
) -> int:
    """The danger depth after this step's update of the allocation EMA
    (``ema_blocks`` before it); 0 for empty steps and when no buffered op
    covers any block (then no rank can matter)."""
    if scheduled_tokens == 0 or not state.owners:
        return 0
    ema = next_ema(ema_blocks, allocated_blocks)
    return danger_depth(ema, next_step_blocks, state.config.horizon_steps)


def _advance(state: State, allocated_blocks: int, next_step_blocks: int,
             window_blocks: int) -> None:
    """A token step's allocation EMA, decaying peak, danger depth and window
    count: what every token step updates, passed or planned."""
    state.ema_blocks, state.peak_blocks, state.depth_blocks = advanced(
        state.ema_blocks, state.peak_blocks, allocated_blocks, next_step_blocks,
        state.config.horizon_steps)
    state.counters[Counter.WINDOW_BLOCKS_READ] += window_blocks


def _passed_step(state: State, allocated_blocks: int, next_step_blocks: int,
                 free_blocks: int, window_blocks: int) -> None:
    """A passed token step (``StepsPassed``): the shared update, and what the
    log can check of the shell's claim that it moved nothing: the window's
    length is the one a ``StepScheduled`` would have had, and no op fell
    overdue."""
    _advance(state, allocated_blocks, next_step_blocks, window_blocks)
    expected = min(state.depth_blocks if state.owners else 0, free_blocks)
    if window_blocks != expected:
        raise InvalidEvent(StepsPassed.TAG, None,
                           f"a passed step read {window_blocks} window blocks, expected "
                           f"{expected} (min of the danger depth and the free-queue length)")
    if pop_overdue(state):
        raise InvalidEvent(StepsPassed.TAG, None, "a passed step with an overdue op")


def _token_step(state: State, event: StepScheduled, scope: Scope) -> None:
    _advance(state, event.allocated_blocks, event.next_step_blocks, len(event.window_block_ids))
    blockindex.apply_reallocations(state, event.reallocated, scope)
    overdue = pop_overdue(state)
    window, owners = event.window_block_ids, state.owners
    if not overdue and not state.shielded and owners.keys().isdisjoint(window):
        return  # nothing due
    ctx = StepContext(
        ops_left=state.config.max_drain_per_step,
        pin_headroom_blocks=max(0, event.free_blocks - pin_reserve(state, event.reserve_blocks)),
        depth_blocks=state.depth_blocks,
        window_seen=set(window),
    )
    state.context = ctx
    owned = list(compress(enumerate(window), map(owners.__contains__, window)))
    plan = plan_eviction_aware(
        state, ctx, owned, reason=SelectReason.WINDOW, with_shielded=True, overdue=overdue
    )
    apply_plan(state, plan, scope)
    _cascade(state, ctx, plan, window, scope)


def on_queue_read(state: State, event: FreeQueueRead, scope: Scope) -> None:
    """The cascade's rounds over the blocks this step's pins pulled in."""
    ctx = state.context
    if not state.awaiting_queue or ctx is None:
        raise InvalidEvent(event.TAG, None, "no free-queue read was requested")
    read = event.window_block_ids
    if len(read) > ctx.read_depth_blocks:
        raise InvalidEvent(
            event.TAG, None,
            f"free-queue read returned {len(read)} blocks, "
            f"more than the {ctx.read_depth_blocks} asked for",
        )
    state.awaiting_queue = False
    state.counters[Counter.WINDOW_BLOCKS_READ] += len(read)
    _cascade(state, ctx, None, read, scope)


def _cascade(
    state: State, ctx: StepContext, plan: Plan | None, read: Sequence[int], scope: Scope
) -> None:
    """Rounds over ``read`` (a prefix of the free queue; ``plan``, when given,
    the round just planned on its first ``D``) while it shows the whole next
    window, then a new read when another round is due (module docstring).

    Work per round is what changed: the window drops the blocks the last
    round pinned and takes the next unprotected blocks of the read (those
    are new, and rank last); only a new read's window is compared whole
    with the blocks seen. Both are set and iterator operations, in C: a
    burst's drain runs thousands of blocks through its rounds."""
    lookahead, depth, pins = state.config.cascade_lookahead_blocks, ctx.depth_blocks, state.pins
    protected = pins.__contains__
    window: set[int] = set()  # the read's first D, made when a round first changes it
    beyond = islice(read, min(depth, len(read)), None)  # the read past the window, in order
    entered: list[int] | None = None  # None: a new read's whole window is to compare
    while True:
        if plan is not None:
            ctx.window_pinned_blocks += len(plan.window_pinned)
            if not (plan.window_pinned and ctx.ops_left > 0 and depth > 0):
                return
            if entered is None:
                window = set(read[:depth])  # a read holds no protected block
            entered = []
            if lookahead:
                # planned, and protected (dedup may trim a pick)
                window.difference_update(filter(protected, plan.window_pinned))
                entered = list(islice(filterfalse(protected, beyond), depth - len(window)))
                window.update(entered)
            if not lookahead or len(window) < depth:
                # The rounds after a read protect at most the headroom left of its blocks.
                ctx.read_depth_blocks = depth + min(lookahead, ctx.pin_headroom_blocks)
                scope.commands.append(ReadFreeQueue(depth_blocks=ctx.read_depth_blocks))
                state.awaiting_queue = True
                return
        seen, owners = ctx.window_seen, state.owners
        if entered is None:  # filtered in C; Python walks only new buffered blocks
            head = read[:depth]
            fresh = set(filterfalse(seen.__contains__, head))
            owned = owners.keys() & fresh
            ranked = list(compress(enumerate(head), map(owned.__contains__, head))) \
                if owned else []
        else:  # the entered blocks fill the window's end
            fresh = set(filterfalse(seen.__contains__, entered))
            first = depth - len(entered)
            ranked = [(first + i, block) for i, block in enumerate(entered)
                      if block in fresh and block in owners]
        seen.update(fresh)
        plan = plan_eviction_aware(
            state, ctx, ranked, reason=SelectReason.CASCADE, with_shielded=False, overdue=()
        )
        apply_plan(state, plan, scope)


def _shield(state: State, rec: RequestState, event: RequestFinished, scope: Scope) -> None:
    """The blind-window rule (module docstring)."""
    free_blocks = event.free_blocks
    reach = finish_reach(state.depth_blocks, state.peak_blocks, event.next_step_max_blocks)
    if reach is None or free_blocks >= reach:
        return
    ops = [op for op in rec.ops if not op.pinned]
    if free_blocks < state.reserve_blocks:  # not all of it: its longest prefix that fits
        if not state.config.chunk_split:
            return
        freed = len(set(blocks_of(ops)).difference(state.pins))
        budget = free_blocks + freed - state.reserve_blocks
        ops = split.shield_prefix(state, rec, ops, budget, scope)
    _shield_ops(state, rec, ops, Counter.SHIELDED_OPS, free_blocks=free_blocks,
                reach_blocks=reach, scope=scope)


def _finish_pins(state: State, rec: RequestState, free_blocks: int,
                 next_step_max_blocks: int, passed: Sequence[PassedStep]) -> bool:
    """Query: whether ``rec``'s ``RequestFinished`` would shield ops, once
    ``passed`` (token steps the core has not folded yet) were folded."""
    if all(op.pinned for op in rec.ops):
        return False
    ema, peak, depth = state.ema_blocks, state.peak_blocks, state.depth_blocks
    horizon = state.config.horizon_steps
    for _, allocated, next_blocks, *_ in passed:
        ema, peak, depth = advanced(ema, peak, allocated, next_blocks, horizon)
    reach = finish_reach(depth, peak, next_step_max_blocks)
    return reach is not None and free_blocks < reach


def _shield_reach(state: State, event: LookupAnswered, scope: Scope) -> None:
    """The lookup shield (module docstring)."""
    window, owners, pins = event.window_block_ids, state.owners, state.pins
    owned = [block for block in window if block in owners]
    _check_reach(state, event, len(owned))
    headroom = event.free_blocks - event.allocation_blocks - \
        pin_reserve(state, state.reserve_blocks)
    reach: dict[str, tuple[RequestState, int]] = {}  # most imminent first: req -> (rec, end)
    for block in owned:
        for op in holders(owners[block]):
            rec = op.req
            seen = reach.get(rec.req_id)
            if seen is None or op.end_token > seen[1]:
                reach[rec.req_id] = (rec, op.end_token)
    queue = set(window)
    charged: set[int] = set()  # queued blocks this shield takes, each charged once
    for rec, end in reach.values():
        if headroom <= len(charged):
            break
        chosen: list[Op] = []
        for op in [op for op in rec.ops if op.end_token <= end and not op.pinned]:
            more = queued_blocks(op, queue, pins) - charged
            if len(charged) + len(more) <= headroom:
                charged |= more
                chosen.append(op)
                continue
            cut, part = split.fitting_prefix(op, more, headroom - len(charged)) \
                if state.config.chunk_split else (0, set())
            if cut:
                split.split(state, rec, op, cut, SplitReason.SHIELD, scope)
                charged |= part
                chosen.append(op)
            break
        _shield_ops(state, rec, chosen, Counter.LOOKUP_SHIELDED_OPS,
                    free_blocks=event.free_blocks, reach_blocks=len(window), scope=scope)


def _shield_ops(state: State, rec: RequestState, ops: list[Op], counter: Counter, *,
                free_blocks: int, reach_blocks: int, scope: Scope) -> None:
    """Protect ``ops`` of ``rec`` until a drain selects them or the shields
    lift (an empty step), count them under ``counter`` and say so."""
    block_ids = blocks_of(ops)
    if not block_ids:
        return
    for op in ops:
        op.pinned = True
    protect(state, -1, block_ids, scope)
    state.shielded[rec.req_id] = None
    state.counters[counter] += len(ops)
    scope.decisions.append(
        OpsShielded(req_id=rec.req_id, ops=len(ops), blocks=len(block_ids),
                    free_blocks=free_blocks, reach_blocks=reach_blocks)
    )


def _check_reach(state: State, event: LookupAnswered, owned: int) -> None:
    """What the log can check of the shell's walk: a prefix of the free
    queue holding exactly the allocation's blocks that no buffered op
    covers (fewer only where it read the whole queue), none twice, and no
    block the core protects (a protected block is not in the queue)."""
    window, tag, req_id = event.window_block_ids, event.TAG, event.req_id
    if event.allocation_blocks <= 0 or event.free_blocks < 0:
        raise InvalidEvent(tag, req_id, f"allocation_blocks={event.allocation_blocks} and "
                           f"free_blocks={event.free_blocks}: expected a positive allocation "
                           "and a non-negative queue length")
    if len(window) > event.free_blocks or len(set(window)) != len(window):
        raise InvalidEvent(tag, req_id, f"a lookup window of {len(window)} blocks "
                           f"({len(set(window))} distinct) in a free queue of "
                           f"{event.free_blocks}: expected distinct ids, no more than the queue")
    unwatched = len(window) - owned
    if unwatched != event.allocation_blocks and not (
            unwatched < event.allocation_blocks and len(window) == event.free_blocks):
        raise InvalidEvent(tag, req_id, f"a lookup window with {unwatched} blocks no buffered "
                           f"op covers, expected allocation_blocks={event.allocation_blocks} "
                           "(fewer only when it holds the whole free queue)")
    pinned = next((block for block in window if block in state.pins), None)
    if pinned is not None:
        raise InvalidEvent(tag, req_id, f"block {pinned} is in a lookup window, but the core "
                           "protects it (a protected block is not in the free queue)")


def _lift_shields(state: State, scope: Scope) -> None:
    for req_id in list(state.shielded):
        rec = state.requests[req_id]
        pinned = [op for op in rec.ops if op.pinned]
        blocks = sum(len(op.block_ids) for op in pinned)
        release(state, -1, pinned, scope)
        del state.shielded[req_id]
        scope.decisions.append(ShieldLifted(req_id=req_id, ops=len(pinned), blocks=blocks))


def _selecting(state: State, rec: RequestState, ops: list[Op], scope: Scope) -> list[Op]:
    ops = dedup.skip_duplicates(state, rec, ops, scope)
    dedup.claim(state, ops)
    return ops


def _released(state: State, ops: Sequence[Op], stored: bool) -> None:
    dedup.unclaim(state, ops, stored)


HOOKS = PolicyHooks(
    window_depth=window_depth,
    already_stored=dedup.already_stored,
    admitted=blockindex.index,
    unbuffered=blockindex.unindex,
    all_unbuffered=blockindex.unindex_all,
    token_step=_token_step,
    passed_step=_passed_step,
    empty_step=_lift_shields,
    lookup_answered=_shield_reach,
    finished=_shield,
    finish_pins=_finish_pins,
    selecting=_selecting,
    released=_released,
)
