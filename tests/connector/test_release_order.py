"""Where the shell puts the blocks the core releases (``connector.shell.pool_commands``,
"Where released blocks go"), on a real vLLM ``BlockPool``: a batch every worker
stored goes back to the free queue's head, its last block first; a failed
store's blocks and a release outside the receipts (a stale batch, one
abandoned at its lease) join the tail, as vLLM frees any block."""

from __future__ import annotations

from typing import Any

from testkit.env import require_stack

require_stack()

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from tests.connector.test_blocks import _linked  # noqa: E402
from tests.connector.test_manager_faults import Shell  # noqa: E402


def _submitted(**config: Any) -> tuple[Shell, list[int]]:
    """"a" finished, its blocks freed by vLLM and pinned by its store in flight."""
    s = Shell(**config)
    a = s.offer("a")
    s.finish("a")
    s.step()
    assert s.submitted == ["a"] and s.refs(a) == [1, 1]
    return s, a


def test_a_stored_batch_is_evicted_next_its_last_block_first() -> None:
    s, a = _submitted()
    s.receipts({"a": 1})
    assert s.refs(a) == [0, 0]
    assert _linked(s.pool)[:2] == a[::-1]


def test_a_failed_store_leaves_its_blocks_at_the_tail() -> None:
    s, a = _submitted()
    s.receipts({"a": 1}, failed={"a"})
    assert s.refs(a) == [0, 0]
    assert _linked(s.pool)[-2:] == a


def test_a_stale_batch_released_before_its_store_joins_the_tail() -> None:
    s = Shell()
    a = s.offer("a")
    s.finish("a")
    block = s.pool.blocks[a[1]]  # reallocated before the drain read it: new content
    block.reset_hash()
    block.set_block_hash(make_block_hash_with_group_id((999).to_bytes(32, "big"), 0))
    s.step()
    assert s.submitted == [] and s.refs(a) == [0, 0]
    assert _linked(s.pool)[-2:] == a


def test_a_batch_abandoned_at_its_lease_joins_the_tail() -> None:
    s, a = _submitted(receipt_lease_s=2.0)
    for _ in range(3):
        s.step()
    assert s.refs(a) == [0, 0]  # abandoned: LMCache may or may not hold it
    assert _linked(s.pool)[-2:] == a
