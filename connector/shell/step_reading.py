"""What the shell reads from vLLM's ``SchedulerOutput`` and ``BlockPool`` for a
scheduler step: a ``StepScheduled``, or, when the core says nothing can move
(``offload_fsm.queries.step_passes``), one ``PassedStep`` of the next
``StepsPassed`` run.

Contract: :meth:`StepReader.read` reads ``scheduler_output`` and the pool
only, never changes them, and reads the core's state without writing it;
its time is proportional to the step's scheduled requests and allocated
blocks plus the window's depth (never the whole free queue).
:class:`ReserveForecast` keeps at most one entry per running request (the
prompt length of each one still prefilling). No vLLM import: the output is
read by attribute.

What a step reports: its scheduled tokens and the blocks it handed out
(:func:`allocated_block_ids`), which of those the core watched and what
their hashes are now (reallocations), the free-queue length and its head as
deep as the danger window (``offload_fsm.queries.window_depth``), and the
reserve below.

Theory. A request's next step opens new blocks when its next tokens cross
a block boundary: a decode whose next token starts a block, or a prefill
that continues with a chunk like this step's, but never past its prompt's
end. The prompt's length is known from the request's first scheduling
(``scheduled_new_reqs``) and kept while it prefills; a request whose length
is not known is charged another chunk like this one. An overestimate holds
drains back (what they would have stored may be lost); an underestimate
risks preemptions.
"""

from __future__ import annotations

import math
from typing import Any

from connector.shell import blocks
from offload_fsm.queries import changed_hashes, ema_after, step_passes, window_depth
from offload_fsm.state import State
from offload_fsm.vocabulary.events import MAX_STEPS_PASSED, PassedStep, StepScheduled, StepsPassed


class StepReader:
    """A step as the core sees it (module docstring). ``group_tokens_per_block``:
    the tokens per block of each KV group that allocates (a scratch group's 0
    left out); ``fingerprint``: of a block hash (``connector.shell.blocks``)."""

    def __init__(self, group_tokens_per_block: list[int], fingerprint: blocks.Fingerprint) -> None:
        self._group_tokens_per_block = group_tokens_per_block
        self._fingerprint = fingerprint
        self.reserve = ReserveForecast(group_tokens_per_block)
        # The last step's window and reserve (``connector.shell.lookahead``).
        self.window: tuple[int, ...] = ()
        self.reserve_blocks = 0
        # Token steps passed since the core's last event, at most
        # MAX_STEPS_PASSED, and the allocation EMA after them.
        self.passed: list[PassedStep] = []
        self._ema: float | None = None

    def blocks_for(self, tokens: int) -> int:
        """The blocks ``tokens`` new tokens take across the KV groups."""
        return sum(math.ceil(tokens / t) for t in self._group_tokens_per_block)

    @property
    def run_full(self) -> bool:
        """Whether the passed run is as long as one ``StepsPassed`` holds."""
        return len(self.passed) >= MAX_STEPS_PASSED

    def take_passed(self) -> StepsPassed:
        """The passed run as one event (the caller feeds it before any other)."""
        passed, self.passed = tuple(self.passed), []
        return StepsPassed(steps=passed)

    def read(self, state: State, scheduler_output: Any, pool: Any, *,
             time_s: float) -> StepScheduled | None:
        """The step: a ``StepScheduled``, or None when a token step passes
        (it joins :attr:`passed`, the run the next ``StepsPassed`` reports)."""
        ema_blocks = self._ema if self.passed else state.ema_blocks
        tokens = int(scheduler_output.total_num_scheduled_tokens)
        allocated = allocated_block_ids(scheduler_output)
        next_step_blocks = self.blocks_for(tokens)
        free = blocks.free_count(pool)
        depth = window_depth(state, scheduled_tokens=tokens, allocated_blocks=len(allocated),
                             next_step_blocks=next_step_blocks, ema_blocks=ema_blocks)
        reallocated: tuple[tuple[int, int | None], ...] = ()
        if tokens:
            owners = state.owners  # read-only: the core's watch set
            watched = [b for b in allocated if b in owners]
            if watched:
                reallocated = changed_hashes(state, watched,
                                             blocks.hashes_of(pool, watched, self._fingerprint))
        reserve = self.reserve.blocks(scheduler_output)
        window = blocks.free_queue_head(pool, min(depth, free))
        self.window, self.reserve_blocks = window, reserve
        if tokens and step_passes(state, window_block_ids=window, reallocated=reallocated,
                                  time_s=time_s):
            self.passed.append((tokens, len(allocated), next_step_blocks, reserve, free,
                                len(window), time_s))
            self._ema = ema_after(ema_blocks, len(allocated))
            return None
        return StepScheduled(
            scheduled_tokens=tokens,
            allocated_blocks=len(allocated),
            next_step_blocks=next_step_blocks,
            reserve_blocks=reserve,
            free_blocks=free,
            window_block_ids=window,
            reallocated=reallocated,
            time_s=time_s,
        )


def allocated_block_ids(scheduler_output: Any) -> list[int]:
    """Every block id handed to a request this step (all groups): new
    requests' whole tables and cached requests' new blocks."""
    out: list[int] = []
    for request in scheduler_output.scheduled_new_reqs:
        for group in request.block_ids:
            out.extend(group)
    for groups in scheduler_output.scheduled_cached_reqs.new_block_ids:
        if groups:
            for group in groups:
                out.extend(group)
    return out


class ReserveForecast:
    """The next step's reserve, step after step (module docstring)."""

    def __init__(self, group_tokens_per_block: list[int]) -> None:
        self._block_tokens = group_tokens_per_block[0] if group_tokens_per_block else 1
        self._groups = max(1, len(group_tokens_per_block))
        # Prompt length of each request still prefilling.
        self.prefilling: dict[str, int] = {}

    def blocks(self, scheduler_output: Any) -> int:
        """Blocks this step's running requests are expected to need next step."""
        block = self._block_tokens
        scheduled = scheduler_output.num_scheduled_tokens
        known = self.prefilling
        prefilling: dict[str, int] = {}
        need = 0
        for request in scheduler_output.scheduled_new_reqs:
            prompt = request.prompt_token_ids
            known_tokens = len(prompt) if prompt is not None else None
            need += next_need(request.req_id, request.num_computed_tokens,
                              scheduled[request.req_id], known_tokens, block, prefilling)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, done in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            tokens = scheduled[req_id]
            if req_id in known:
                need += next_need(req_id, done, tokens, known[req_id], block, prefilling)
            elif tokens > 1:
                need += -(-tokens // block)  # prompt length unknown: another chunk
            elif (done + 1) % block == 0:
                need += 1  # a decode whose next token opens a new block
        self.prefilling = prefilling
        return need * self._groups


def next_need(req_id: str, computed_tokens: int, scheduled_tokens: int,
              prompt_tokens: int | None, block_tokens: int, prefilling: dict[str, int]) -> int:
    """Blocks one scheduled request needs next step; records it in
    ``prefilling`` when its prompt continues past this step."""
    done = computed_tokens + scheduled_tokens
    if prompt_tokens is None:
        if scheduled_tokens > 1:
            return -(-scheduled_tokens // block_tokens)
        return 1 if done % block_tokens == 0 else 0
    if done >= prompt_tokens:
        return 1 if done % block_tokens == 0 else 0  # decodes next
    prefilling[req_id] = prompt_tokens
    later = done + min(prompt_tokens - done, scheduled_tokens)
    return -(-later // block_tokens) - -(-done // block_tokens)
