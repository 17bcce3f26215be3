"""FIFO, exactly as the spec (``lazy-offload.md``).

A request is *ready* when it has finished, has buffered ops and no batch in
flight (``State.ready``). When the ready count reaches ``threshold`` on a
token-producing step, up to ``select_count`` ready requests are selected
whole, in the order their first op entered the buffer. Nothing happens on a
step without scheduled tokens, nor while idle (unless a tail flush is
configured: ``tail_flush``). FIFO keeps no state of its own: every other hook is
a no-op.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_fsm.rules.drain import apply_plan
from offload_fsm.rules.plan import NO_PLAN, Pick, Plan
from offload_fsm.rules.scope import PolicyHooks, Scope
from offload_fsm.state import Op, RequestState, State
from offload_fsm.vocabulary.decisions import SelectReason
from offload_fsm.vocabulary.errors import InvalidEvent
from offload_fsm.vocabulary.events import (
    LookupAnswered,
    PassedStep,
    RequestFinished,
    StepScheduled,
    StepsPassed,
)


def plan_fifo(state: State) -> Plan:
    """Select up to ``select_count`` ready requests, whole, in buffer order,
    once at least ``threshold`` are ready."""
    config = state.config
    if len(state.ready) < config.threshold:
        return NO_PLAN
    picks: list[Pick] = []
    for req_id, rec in state.pending.items():
        if req_id in state.ready:
            picks.append(Pick(rec=rec, count=len(rec.ops), reason=SelectReason.FIFO, rank=-1))
            if len(picks) >= config.select_count:
                break
    return Plan(picks=tuple(picks), ops_used=sum(p.count for p in picks))


def _token_step(state: State, event: StepScheduled, scope: Scope) -> None:
    apply_plan(state, plan_fifo(state), scope)


def _no_window(state: State, scheduled_tokens: int, allocated: int, next_blocks: int,
               ema_blocks: float | None) -> int:
    return 0


def _never_passes(state: State, allocated: int, next_blocks: int, free: int,
                  window: int) -> None:
    """FIFO's token step is its threshold rule: the shell never passes one."""
    raise InvalidEvent(StepsPassed.TAG, None, "FIFO takes every token step as StepScheduled")


def _no_lookup_shield(state: State, event: LookupAnswered, scope: Scope) -> None:
    """FIFO watches no free-queue rank: the shell never feeds a lookup."""
    raise InvalidEvent(LookupAnswered.TAG, event.req_id,
                       "FIFO takes no LookupAnswered (it watches no free-queue rank)")


def _never_stored(state: State, op: Op) -> bool:
    return False


def _nothing_admitted(state: State, op: Op, block_ids: tuple[int, ...],
                      block_hashes: tuple[int, ...], scope: Scope) -> None:
    return


def _nothing_unbuffered(state: State, ops: Sequence[Op]) -> None:
    return


def _nothing_all_unbuffered(state: State) -> None:
    return


def _nothing_on_empty(state: State, scope: Scope) -> None:
    return


def _nothing_finished(
    state: State, rec: RequestState, event: RequestFinished, scope: Scope
) -> None:
    return


def _finish_pins_nothing(state: State, rec: RequestState, free_blocks: int,
                         next_step_max_blocks: int, passed: Sequence[PassedStep]) -> bool:
    return False


def _all_selected(state: State, rec: RequestState, ops: list[Op], scope: Scope) -> list[Op]:
    return ops


def _nothing_released(state: State, ops: Sequence[Op], stored: bool) -> None:
    return


HOOKS = PolicyHooks(
    window_depth=_no_window,
    already_stored=_never_stored,
    admitted=_nothing_admitted,
    unbuffered=_nothing_unbuffered,
    all_unbuffered=_nothing_all_unbuffered,
    token_step=_token_step,
    passed_step=_never_passes,
    empty_step=_nothing_on_empty,
    lookup_answered=_no_lookup_shield,
    finished=_nothing_finished,
    finish_pins=_finish_pins_nothing,
    selecting=_all_selected,
    released=_nothing_released,
)
