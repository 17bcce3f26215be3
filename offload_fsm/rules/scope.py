"""The seams where the two drain policies differ, and one step's scope.

The shared transition modules (``lifecycle``, ``drain``, ``buffer``) run the
same code for every policy and call a :class:`PolicyHooks` at the fixed points
below; ``fifo`` and ``eviction_aware`` each provide one
(``policies.registry`` maps a policy to its hooks). FIFO's hooks do nothing
where EVICTION_AWARE keeps state of its own (the block->op index, content
dedup, shields, the danger depth), so a reader of the FIFO path never meets
an EVICTION_AWARE branch.

A :class:`Scope` lives for one ``step``: the hooks of the state's policy and
the decisions and commands the step emits, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from offload_fsm.state import Op, RequestState, State
from offload_fsm.vocabulary.commands import Command
from offload_fsm.vocabulary.decisions import Decision
from offload_fsm.vocabulary.events import (
    LookupAnswered,
    PassedStep,
    RequestFinished,
    StepScheduled,
)


class Scope:
    """One step's hooks and output; handlers append, ``step`` freezes."""

    __slots__ = ("hooks", "decisions", "commands")

    def __init__(self, hooks: PolicyHooks) -> None:
        self.hooks = hooks
        self.decisions: list[Decision] = []
        self.commands: list[Command] = []


@attrs.frozen(kw_only=True)
class PolicyHooks:
    # Query: free-queue blocks the shell must read into this StepScheduled
    # (scheduled_tokens, allocated_blocks, next_step_blocks, the allocation
    # EMA before the step) -> blocks.
    window_depth: Callable[[State, int, int, int, float | None], int]
    # Admission: reject an offered op whose content is all stored already.
    already_stored: Callable[[State, Op], bool]
    # An op entered its request's buffer, with its block ids and hashes as
    # tuples (the caller has them at hand: the op holds them packed).
    admitted: Callable[[State, Op, tuple[int, ...], tuple[int, ...], Scope], None]
    # Ops left their request's buffer (selected, dropped).
    unbuffered: Callable[[State, Sequence[Op]], None]
    # Every buffered op leaves at once (shutdown): ``unbuffered`` of them all.
    all_unbuffered: Callable[[State], None]
    # A step with scheduled tokens, after the shared bookkeeping: plan a drain.
    token_step: Callable[[State, StepScheduled, Scope], None]
    # A passed token step (``StepsPassed``), after the shared bookkeeping:
    # (allocated_blocks, next_step_blocks, free_blocks, window_blocks); it
    # plans nothing, and raises ``InvalidEvent`` where the policy cannot pass.
    passed_step: Callable[[State, int, int, int, int], None]
    # A step with no scheduled tokens.
    empty_step: Callable[[State, Scope], None]
    # A waiting request's lookup was answered and its allocation may reach
    # buffered blocks (``LookupAnswered``); raises ``InvalidEvent`` where the
    # policy takes none.
    lookup_answered: Callable[[State, LookupAnswered, Scope], None]
    # A request with buffered ops finished (before its ready/end bookkeeping).
    finished: Callable[[State, RequestState, RequestFinished, Scope], None]
    # Query: whether ``finished`` would pin for a request with buffered ops
    # finishing with (free_blocks, next_step_max_blocks), once the passed
    # steps the core has not folded yet were folded.
    finish_pins: Callable[[State, RequestState, int, int, Sequence[PassedStep]], bool]
    # Front ops taken for a batch: returns the ops to verify (may drop some).
    selecting: Callable[[State, RequestState, list[Op], Scope], list[Op]]
    # A batch's ops left it: stored (True) or not (False).
    released: Callable[[State, Sequence[Op], bool], None]
