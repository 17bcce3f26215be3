"""What the shell reports in ``StepScheduled.reallocated`` over a real vLLM
``BlockPool``: a watched block allocated with its hash unchanged (a prefix-cache
hit on a buffered op's block) is left out, and one whose hash changed is
reported, so the core drops the op that lost its data."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from testkit.env import require_stack

require_stack()

from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestMetadata  # noqa: E402
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from connector.shell.manager import EventSourcedManager  # noqa: E402
from offload_fsm import OffloadConfig, Policy  # noqa: E402
from offload_fsm.vocabulary.events import Event, StepScheduled  # noqa: E402

BLOCK = 16


def _hash(value: int) -> Any:
    return make_block_hash_with_group_id(value.to_bytes(32, "big"), 0)


def _new_request(req_id: str, block_ids: list[int]) -> Any:
    tokens = len(block_ids) * BLOCK
    return SimpleNamespace(
        total_num_scheduled_tokens=tokens, num_scheduled_tokens={req_id: tokens},
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id, block_ids=(block_ids,),
                                            num_computed_tokens=0,
                                            prompt_token_ids=list(range(tokens)))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[],
                                              new_block_ids=[]),
    )


def test_a_prefix_hit_is_no_reallocation_and_a_changed_hash_is() -> None:
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=BLOCK)
    mgr = EventSourcedManager(OffloadConfig(policy=Policy.EVICTION_AWARE),
                              world_size=1, group_tokens_per_block=[BLOCK])
    mgr.bind_block_pool(pool)
    steps: list[StepScheduled] = []
    feed = mgr._core.feed

    def spy(event: Event) -> None:
        if isinstance(event, StepScheduled):
            steps.append(event)
        feed(event)

    mgr._core.feed = spy  # type: ignore[method-assign]
    blocks = pool.get_new_blocks(2)
    for n, block in enumerate(blocks):
        block.set_block_hash(_hash(n + 1))
    ids = [b.block_id for b in blocks]
    mgr.on_request_arrived("a")
    mgr.add_store_candidate(LMCacheMPRequestMetadata(
        request_id="a", direction="STORE",
        op=LoadStoreOp(token_ids=list(range(2 * BLOCK)), block_ids=[ids], start=0,
                       end=2 * BLOCK)))
    mgr._core.apply_pending()  # what the step applies first
    assert all(b in mgr.state.owners for b in ids)

    pool.touch(blocks)  # "b" hits "a"'s blocks in the prefix cache: same content
    mgr.on_request_arrived("b")
    mgr.on_scheduler_step(_new_request("b", ids))
    assert steps == [] and len(mgr._reader.passed) == 1  # nothing moved: the step passed
    assert all(b in mgr.state.owners for b in ids)  # still watched, still buffered

    blocks[1].reset_hash()  # the block was evicted and now holds other content
    blocks[1].set_block_hash(_hash(99))
    mgr.on_request_arrived("c")
    mgr.on_scheduler_step(_new_request("c", [ids[1]]))
    assert steps[-1].reallocated == ((ids[1], hash(_hash(99))),)
    assert not any(b in mgr.state.owners for b in ids)  # the op lost its data: dropped
