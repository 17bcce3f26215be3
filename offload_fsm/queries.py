"""Read-only questions the shell asks between steps."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Final

from offload_fsm.policies.ea_planner import next_ema
from offload_fsm.policies.registry import hooks_for
from offload_fsm.state import BatchStatus, State
from offload_fsm.vocabulary.config import Policy
from offload_fsm.vocabulary.events import BlockHash, PassedStep


class _Current(enum.Enum):
    STATE = "the state's"


CURRENT: Final = _Current.STATE


def window_depth(
    state: State, *, scheduled_tokens: int, allocated_blocks: int, next_step_blocks: int,
    ema_blocks: float | None | _Current = CURRENT,
) -> int:
    """How many free-queue blocks the shell must read into the next
    ``StepScheduled`` (it caps them by the queue length): the danger depth
    after this step's EMA update under EVICTION_AWARE; 0 for FIFO, for empty
    steps, and when no buffered op covers any block (the shell then skips
    the walk). ``ema_blocks``: the allocation EMA before this step, where the
    shell holds passed steps the core has not folded yet (:func:`ema_after`);
    the state's by default."""
    ema = state.ema_blocks if ema_blocks is CURRENT else ema_blocks
    return hooks_for(state.config.policy).window_depth(
        state, scheduled_tokens, allocated_blocks, next_step_blocks, ema
    )


def ema_after(ema_blocks: float | None, allocated_blocks: int) -> float:
    """The allocation EMA after a token step that allocated ``allocated_blocks``."""
    return next_ema(ema_blocks, allocated_blocks)


def step_passes(
    state: State, *, window_block_ids: Sequence[int], reallocated: Sequence[Any], time_s: float
) -> bool:
    """Whether a token step at ``time_s`` that read ``window_block_ids`` and
    saw ``reallocated`` may go in a ``StepsPassed``: under EVICTION_AWARE,
    no buffered block in the window, no watched block reallocated, nothing
    shielded, no op overdue and no receipt lease ending. A step this says no
    to goes as ``StepScheduled`` (always valid); so does every step under
    FIFO, whose token step is its threshold rule."""
    config = state.config
    if config.policy is not Policy.EVICTION_AWARE or reallocated or state.shielded:
        return False
    if not state.owners.keys().isdisjoint(window_block_ids):
        return False
    batches = state.batches
    if config.receipt_lease_s > 0 and batches and \
            time_s - next(iter(batches.values())).selected_time_s >= config.receipt_lease_s:
        return False
    deadlines = state.deadlines
    # A due deadline may be stale; only a StepScheduled clears it (``pop_overdue``).
    return not (config.max_deferral_seconds > 0 and deadlines
                and deadlines[0][0] <= time_s - config.max_deferral_seconds)


def finish_waits(state: State, req_id: str, *, free_blocks: int, next_step_max_blocks: int,
                 passed: Sequence[PassedStep]) -> bool:
    """Whether ``req_id``'s ``RequestFinished`` (with ``free_blocks`` and
    ``next_step_max_blocks``) may wait for the shell's next pass instead of
    being applied now: the policy would pin none of its buffered ops (the
    shield), once ``passed``, the token steps the core has not folded yet,
    were folded. Nothing else it decides is needed before the next
    ``schedule()``: the request's readiness and its session's end wait a
    step, and the same events reach the core in the same order."""
    rec = state.requests.get(req_id)
    if rec is None or not rec.ops:
        return True
    return not hooks_for(state.config.policy).finish_pins(
        state, rec, free_blocks, next_step_max_blocks, passed)


def watches(state: State, block_id: int) -> bool:
    """Whether a buffered op covers ``block_id`` (report it when reallocated)."""
    return block_id in state.owners


def changed_hashes(
    state: State, block_ids: Sequence[int], hashes_now: Sequence[BlockHash]
) -> tuple[tuple[int, BlockHash], ...]:
    """``StepScheduled.reallocated`` for blocks allocated this step: the
    ``(block id, hash now)`` of each watched block whose hash is no longer the
    one its buffered ops snapshotted. An allocation that keeps the hash (a
    prefix-cache hit on a cached free block) changes nothing and is left out."""
    snapshot = state.owner_hashes
    return tuple((block_id, now) for block_id, now in zip(block_ids, hashes_now, strict=True)
                 if snapshot.get(block_id, now) != now)


def has_in_flight(state: State) -> bool:
    """Whether vLLM must keep stepping: a submitted store awaits receipts, or
    shielded ops hold pins that the next empty step will lift."""
    return bool(state.shielded) or any(
        b.status is BatchStatus.IN_FLIGHT for b in state.batches.values()
    )


def keeps_stepping(state: State, now_s: float) -> bool:
    """Whether vLLM must keep stepping (``has_pending_push_work``), at the
    shell's time ``now_s``: :func:`has_in_flight`, or a ready request that a
    configured tail flush will select on a coming empty step (``tail_flush``).
    Once the shutdown wait has passed ``shutdown_until_s``, never: vLLM may
    stop, and what is left is recorded at ``ShutdownRequested``."""
    until = state.shutdown_until_s
    if until is not None and now_s >= until:
        return False
    if has_in_flight(state):
        return True
    return bool(state.ready) and (until is not None or state.config.idle_flush_steps > 0)
