"""The connector's view of vLLM's ``BlockPool``: the only module that touches
block objects. Everything it hands the core is plain ints.

* :func:`fingerprint` turns vLLM's ``BlockHashWithGroupId`` (hash bytes plus a
  4-byte group id) into a 64-bit int: the first 8 bytes of the hash XOR the
  group id. Two different block contents collide with probability 2^-64 per
  comparison; the core compares a block only against its own snapshot.
* :func:`free_queue_head` walks the free queue from the eviction head and
  stops after ``depth`` blocks: O(depth), never the whole queue.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

BlockPool = Any  # vllm.v1.core.block_pool.BlockPool (kept untyped: vLLM is optional here)


def fingerprint(block_hash: bytes | None) -> int | None:
    if block_hash is None:
        return None
    raw = bytes(block_hash)
    return int.from_bytes(raw[:8], "little") ^ int.from_bytes(raw[-4:], "big")


def hashes_of(pool: BlockPool, block_ids: Iterable[int]) -> tuple[int | None, ...]:
    blocks = pool.blocks
    return tuple(fingerprint(blocks[b].block_hash) for b in block_ids)


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
