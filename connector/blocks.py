"""The connector's view of vLLM's ``BlockPool``: the only module that touches
block objects. Everything it hands the core is plain ints.

* :func:`hashes_of` turns each block's ``BlockHashWithGroupId`` (hash bytes
  plus a 4-byte group id; None while the block is unhashed) into a 64-bit
  fingerprint: Python's SipHash of the bytes, which CPython caches on the bytes
  object, so a block is hashed once however often it is read. Two different
  contents collide with probability 2^-64 per comparison; the core compares a
  block only against its own snapshot. The value is per-process
  (``PYTHONHASHSEED``): the log records it, so replay is exact, but
  fingerprints are not comparable across runs.
* :func:`free_queue_head` walks the free queue from the eviction head and
  stops after ``depth`` blocks: O(depth), never the whole queue.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

BlockPool = Any  # vllm.v1.core.block_pool.BlockPool (kept untyped: vLLM is optional here)


def hashes_of(pool: BlockPool, block_ids: Iterable[int]) -> tuple[int | None, ...]:
    blocks = pool.blocks
    out = []
    for block_id in block_ids:
        block_hash = blocks[block_id].block_hash
        out.append(None if block_hash is None else hash(block_hash))
    return tuple(out)


def free_queue_head(pool: BlockPool, depth: int) -> tuple[int, ...]:
    """The first ``depth`` block ids of the free queue, eviction head first."""
    if depth <= 0:
        return ()
    queue = pool.free_block_queue
    tail = queue.fake_free_list_tail
    block = queue.fake_free_list_head.next_free_block
    out: list[int] = []
    while block is not None and block is not tail and len(out) < depth:
        out.append(block.block_id)
        block = block.next_free_block
    return tuple(out)


def touch(pool: BlockPool, block_ids: Iterable[int]) -> None:
    pool.touch([pool.blocks[b] for b in block_ids])


def release(pool: BlockPool, block_ids: Iterable[int]) -> None:
    pool.free_blocks([pool.blocks[b] for b in block_ids])


def free_count(pool: BlockPool) -> int:
    return int(pool.get_num_free_blocks())
