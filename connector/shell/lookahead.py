"""What a waiting request's allocation can reach in vLLM's free queue, read
at its lookup (``LookupAnswered``).

vLLM 0.32's ``Scheduler.schedule()`` takes its waiting requests one by one:
``get_num_new_matched_tokens`` (LMCache's lookup), then at once
``allocate_slots`` for the request, from the free queue's head. With an
LMCache hit the request's whole hit is allocated in that call (an
asynchronous load: no new tokens this step); without one, its new tokens up
to the step's token budget. A burst of repeated prompts so takes hundreds of
blocks in one ``schedule()``, before the step's drain or its danger window
sees any of them: the shell reads the reach of each allocation here, where
it runs after the lookup and before the allocation.

:class:`Lookahead` does it for a manager (the cheap test, then the walk);
primitives:
  missing_chunk_keys(...) what the same lookup shows gone from the server:
                          the stored chunks past its hit
  allocation_tokens(...)  the tokens the request's slots will cover once
                          allocated: the bound on what it takes
  reach(pool, ...)        the free queue's head, read until ``allocation``
                          blocks no buffered op covers were seen; None when
                          none of the blocks read is covered (nothing to
                          protect, no event)
  clear_depth(...)        how much of a step's window holds no buffered
                          block left unprotected: the cheap test before a walk

The walk is exact, not an estimate: a covered block the core protects
leaves the queue (``BlockPool.touch``) and the allocation takes the next one
instead, so the blocks read are every block the allocation can reach. It
costs one step per block read, at most the allocation plus the covered
blocks met; the shell walks only while the core holds buffered ops. Blocks
of the request's own local prefix-cache hit that sit in the free queue leave
it too when vLLM touches them, which takes the allocation one block further
per such block; the walk does not tell them apart, and falls short by one
block per such block within its reach (a local hit is a prefix another
request computed lately, seldom at the queue's eviction head).

The cheap test (``clear_depth``, at the first lookup of a ``schedule()``):
the last step's window was the free queue's head before its drain. Where
every buffered block in it is protected now, its other blocks are the
queue's head, none of them buffered, and this ``schedule()``'s allocations
take only those as long as they stay within them: a block freed since joins
the queue's tail (or, with no hash, so never buffered, its head), and the
head loses only what is allocated or touched. The running requests come
first in a ``schedule()``, so their expected need (the step's
``reserve_blocks``) counts before the lookups'. It is an estimate where that
need is (a running request may take more than expected, and a local
prefix-cache hit touched out of the window takes the reach one block
deeper); an allocation past the clear head is walked.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

from connector.shell import blocks
from connector.shell.step_reading import StepReader
from offload_fsm.state import State
from offload_fsm.vocabulary.events import LookupAnswered


def missing_chunk_keys(stored: Container[int], last_blocks: Sequence[Any],
                       pool_hash: Callable[[Any], Any], fingerprint: Callable[[Any], int]
                       ) -> tuple[int, ...]:
    """The content keys (``Op.chunk_keys``) of the chunks past a lookup's hit
    that are ``stored`` as far as the core knows: LMCache's lookup stopped
    before them, so they are gone from the server (its L1 is LRU, and
    retrieval stops at the first missing chunk). ``last_blocks``: the last
    block hash of each chunk past the hit, in order; only those are turned
    into pool hashes and fingerprinted."""
    keys = (fingerprint(pool_hash(h)) for h in last_blocks)
    return tuple(key for key in keys if key in stored)


class Lookahead:
    """The lookups of one ``schedule()`` against the free queue (module
    docstring): ``reader`` is the manager's, whose last step gives the
    window and the running requests' expected need; ``budget_tokens`` the
    step's token budget."""

    def __init__(self, reader: StepReader, budget_tokens: int) -> None:
        self._reader = reader
        self._budget_tokens = budget_tokens
        self._clear_blocks: int | None = 0  # None: not asked yet this schedule()
        self._taken_blocks = 0  # what this schedule() took from the head so far

    def stepped(self) -> None:
        """A step was read: the next ``schedule()`` starts from its window."""
        self._clear_blocks, self._taken_blocks = None, self._reader.reserve_blocks

    def answered(self, state: State, pool: Any, req_id: str, *, prompt_tokens: int,
                 local_tokens: int, hit_tokens: int, loads_async: bool
                 ) -> LookupAnswered | None:
        """The event for one answered lookup, or None when its allocation
        stays within the clear head or reaches no buffered block."""
        blocks_for = self._reader.blocks_for
        tokens = allocation_tokens(
            prompt_tokens=prompt_tokens, local_tokens=local_tokens, hit_tokens=hit_tokens,
            loads_async=loads_async, budget_tokens=self._budget_tokens)
        allocation = blocks_for(tokens) - blocks_for(local_tokens)
        if allocation <= 0:
            return None
        if self._clear_blocks is None:  # once a schedule(), and only where a lookup comes
            self._clear_blocks = clear_depth(self._reader.window, state.owners, state.pins)
        self._taken_blocks += allocation
        if self._taken_blocks <= self._clear_blocks:
            return None  # within the queue's head the last step's drain left clear
        window = reach(pool, allocation, state.owners)
        if window is None:
            return None
        return LookupAnswered(req_id=req_id, allocation_blocks=allocation,
                              free_blocks=blocks.free_count(pool), window_block_ids=window)


def allocation_tokens(*, prompt_tokens: int, local_tokens: int, hit_tokens: int,
                      loads_async: bool, budget_tokens: int) -> int:
    """The tokens a waiting request's slots cover after its allocation in
    this ``schedule()``: its local hit and LMCache hit, and, unless the hit
    loads asynchronously (vLLM then schedules no new token this step), its
    new tokens up to the step's token budget; never past its prompt
    (``prompt_tokens``: all its tokens, output included after a
    preemption)."""
    new_tokens = 0 if loads_async else budget_tokens
    return min(prompt_tokens, local_tokens + hit_tokens + new_tokens)


def reach(pool: Any, allocation_blocks: int, watched: Container[int]) -> tuple[int, ...] | None:
    """The free queue's first block ids (eviction head first) through the
    ``allocation_blocks``-th block not in ``watched`` (or to its end); None
    when no block read is in ``watched``."""
    queue = pool.free_block_queue
    tail = queue.fake_free_list_tail
    block = queue.fake_free_list_head.next_free_block
    out: list[int] = []
    left = allocation_blocks
    covered = False
    while left and block is not None and block is not tail:
        block_id = block.block_id
        out.append(block_id)
        if block_id in watched:
            covered = True
        else:
            left -= 1
        block = block.next_free_block
    return tuple(out) if covered else None


def clear_depth(window: Sequence[int], watched: Mapping[int, Any],
                protected: Mapping[int, Any]) -> int:
    """How many blocks at the free queue's head are none of ``watched``, from
    a step's ``window`` read before its drain and the blocks ``protected``
    after it: the window's unprotected blocks (a protected block left the
    queue) when every watched one among them is protected, else 0 (set
    tests in C, no walk)."""
    pinned = protected.keys() & window
    if not watched.keys() & window <= pinned:
        return 0
    return len(window) - len(pinned)
