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

Primitives:
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

from collections.abc import Container, Mapping, Sequence
from typing import Any


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
