"""``connector.shell.blocks`` over a real vLLM ``BlockPool``: the free-queue head
is the list's first blocks in every state the pool gets into (allocations,
prefix-cache touches out of the middle, frees), even when the free count
disagrees with the list; a hash read gives each block's fingerprint, None
for a block not hashed."""

from __future__ import annotations

import random
from typing import Any

import pytest

from testkit.env import require_stack

require_stack()

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from connector.shell import blocks  # noqa: E402

BLOCK = 16


def _linked(pool: Any) -> list[int]:
    """The whole free list, link by link (the reference)."""
    queue = pool.free_block_queue
    out, block = [], queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail:
        out.append(block.block_id)
        block = block.next_free_block
    return out


def test_the_free_queue_head_matches_the_list_as_the_pool_changes() -> None:
    rng = random.Random(7)
    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BLOCK)
    held: list[Any] = []
    for _ in range(300):
        move = rng.random()
        if move < 0.4 and pool.get_num_free_blocks() > 4:
            held.extend(pool.get_new_blocks(rng.randint(1, 4)))
        elif move < 0.7 and held:
            rng.shuffle(held)
            cut = rng.randint(1, len(held))
            pool.free_blocks(held[:cut])
            held = held[cut:]
        else:
            free = _linked(pool)
            if free:  # a prefix-cache hit takes a block out of the middle of the queue
                block = pool.blocks[rng.choice(free)]
                pool.touch([block])
                held.append(block)
        whole = _linked(pool)
        for depth in (0, 1, 5, len(whole), len(whole) + 3, 200):
            assert blocks.free_queue_head(pool, depth) == tuple(whole[:depth])


def test_a_free_count_the_list_disagrees_with_does_not_matter() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK)
    held = pool.get_new_blocks(3)
    whole = _linked(pool)
    queue = pool.free_block_queue
    queue.num_free_blocks += 2  # more than the list holds: the walk stops at its end
    assert blocks.free_queue_head(pool, 100) == tuple(whole)
    queue.num_free_blocks -= 2
    pool.free_blocks(held)


def test_hashes_of_reads_each_blocks_fingerprint_or_none() -> None:
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=BLOCK)
    got = pool.get_new_blocks(4)
    hashes = [make_block_hash_with_group_id(n.to_bytes(32, "big"), 0) for n in range(4)]
    for block, block_hash in zip(got, hashes, strict=True):
        block.set_block_hash(block_hash)
    ids = [b.block_id for b in got]
    assert blocks.hashes_of(pool, ids) == tuple(hash(h) for h in hashes)
    got[2].reset_hash()  # not hashed (a block still filling)
    assert blocks.hashes_of(pool, ids) == (hash(hashes[0]), hash(hashes[1]), None,
                                           hash(hashes[3]))
    assert blocks.hashes_of(pool, []) == ()


def test_fingerprints_are_keyed_by_a_secret_of_the_run() -> None:
    """vLLM's block hashes depend on content only: a fingerprint a reader of
    the log could compute (``hash`` under a fixed ``PYTHONHASHSEED``) would
    tell them which prompts were served. Under a fixed seed the fingerprint
    is keyed by a random secret of the process; two runs do not agree."""
    block_hash = b"\x01" * 32 + b"\x00\x00\x00\x00"
    assert blocks.fingerprinter({}) is hash  # CPython's own per-process key
    assert blocks.fingerprinter({"PYTHONHASHSEED": "random"}) is hash
    one = blocks.fingerprinter({"PYTHONHASHSEED": "0"})
    two = blocks.fingerprinter({"PYTHONHASHSEED": "0"})
    assert one(block_hash) == one(block_hash)
    assert one(block_hash) != two(block_hash)
    assert one(block_hash) != hash(block_hash)
    assert -(2**63) <= one(block_hash) < 2**63


def test_a_fixed_key_is_asked_for_explicitly_and_checked() -> None:
    block_hash = b"\x02" * 36
    env = {blocks.KEY_ENV: "00112233445566778899aabbccddeeff", "PYTHONHASHSEED": "0"}
    assert blocks.fingerprinter(env)(block_hash) == blocks.fingerprinter(env)(block_hash)
    with pytest.raises(ValueError, match=blocks.KEY_ENV):
        blocks.fingerprinter({blocks.KEY_ENV: "not hex"})


def test_the_engine_index_is_vllms_data_parallel_index_not_the_reset_rank() -> None:
    """For a dense model vLLM resets ``data_parallel_rank`` to 0 in every
    engine; ``data_parallel_index`` keeps the engine's own."""
    from types import SimpleNamespace

    from connector.shell.lmcache_connector import engine_index_of

    assert engine_index_of(SimpleNamespace(data_parallel_rank=0, data_parallel_index=1)) == 1
    assert engine_index_of(SimpleNamespace(data_parallel_rank=2)) == 2  # an older vLLM
    assert engine_index_of(SimpleNamespace()) == 0
