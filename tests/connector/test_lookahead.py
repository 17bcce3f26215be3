"""``connector.shell.lookahead`` over a real vLLM ``BlockPool``: the walk stops
after the allocation's count of blocks no buffered op covers (a covered block
does not count: protecting it takes it out of the queue, and the allocation
takes the next block), reports nothing when none is covered, and ends with
the queue; the cheap test counts the window's head clear only when every
covered block in it was protected; the allocation bound follows vLLM's
``schedule()``."""

from __future__ import annotations

from testkit.env import require_stack

require_stack()

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from connector.shell.lookahead import allocation_tokens, clear_depth, reach  # noqa: E402


def _pool(blocks: int = 20) -> BlockPool:
    return BlockPool(num_gpu_blocks=blocks, enable_caching=True, hash_block_size=16)


def test_the_walk_counts_only_blocks_no_buffered_op_covers() -> None:
    pool = _pool()  # block 0 is vLLM's null block: the queue is 1..19
    assert reach(pool, 4, {3: None, 5: None}) == (1, 2, 3, 4, 5, 6)
    assert reach(pool, 2, {3: None}) is None  # the allocation ends before block 3
    assert reach(pool, 3, {3: None}) == (1, 2, 3, 4)


def test_the_walk_ends_with_the_queue() -> None:
    pool = _pool(6)
    assert reach(pool, 50, {5: None}) == (1, 2, 3, 4, 5)


def test_the_walk_follows_the_queue_as_vllm_changed_it() -> None:
    pool = _pool()
    taken = pool.get_new_blocks(3)  # blocks 1-3 leave the head
    assert reach(pool, 2, {5: None}) == (4, 5, 6)
    pool.touch([pool.blocks[5]])  # protected: out of the queue
    assert reach(pool, 2, {5: None}) is None
    pool.free_blocks(taken)  # no hash: back at the head, in order
    assert reach(pool, 3, {2: None}) == (1, 2, 3, 4)


def test_the_clear_head_needs_every_covered_window_block_protected() -> None:
    window = (10, 11, 12, 13)
    assert clear_depth(window, {}, {}) == 4
    assert clear_depth(window, {12: None}, {}) == 0  # a buffered block left unprotected
    assert clear_depth(window, {12: None}, {12: 1}) == 3  # protected: out of the queue
    assert clear_depth(window, {99: None}, {11: 1}) == 3


def test_the_allocation_bound_follows_the_scheduler() -> None:
    hit = allocation_tokens(prompt_tokens=8000, local_tokens=512, hit_tokens=6000,
                            loads_async=True, budget_tokens=2048)
    assert hit == 6512  # an asynchronous load schedules no new token this step
    assert allocation_tokens(prompt_tokens=8000, local_tokens=512, hit_tokens=0,
                             loads_async=False, budget_tokens=2048) == 2560
    assert allocation_tokens(prompt_tokens=1000, local_tokens=512, hit_tokens=0,
                             loads_async=False, budget_tokens=2048) == 1000
