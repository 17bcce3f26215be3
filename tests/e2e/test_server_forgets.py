"""The LMCache server forgets (its L1 is a small LRU) and our core learns it.

Workload (EVICTION_AWARE, 96-block pool): prompt P and seven other distinct
prompts (four 256-token chunks each) run two at a time; a deferral deadline
of a millisecond makes the core store every op at the next token step (an
idle gap between the pairs would otherwise let the next pair reallocate a
finished pair's blocks before any drain); the server's L1 holds only a few
chunks, so P's chunks are evicted on the server by the later ones. After
``reset_prefix_cache()`` P runs again: LMCache's lookup misses P's prefix
although the core remembers it stored. The connector reports those chunks
(``ChunksMissing``), the core forgets them (``StoredChunksForgotten``), and
P's new candidates are admitted, not rejected as already stored (before the
fix, dedup rejected them forever).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from testkit.engine import shutdown as engine_shutdown
from testkit.lmcache_server import LMCacheServer
from tests.e2e.test_connector import our_kv_transfer_config
from tests.e2e.test_stock_baseline import reset_prefix_cache_when_idle

pytestmark = pytest.mark.e2e

PROMPT_TOKENS = 1112  # four whole chunks and a tail
NUM_PROMPTS = 8
POOL_BLOCKS = 96
# A 256-token chunk of the tiny model is 256 KiB (2 layers x K,V x 2 heads x 32 x fp32):
# about two chunks fit, the workload writes up to 32.
L1_SIZE_GB = 0.0006


def prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2048) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_PROMPTS)]


def run(model_dir: Path, kv_transfer_config: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(model_dir), dtype="float32", block_size=32, max_model_len=2048,
              enable_prefix_caching=True, enforce_eager=True, seed=0,
              num_gpu_blocks_override=POOL_BLOCKS, kv_transfer_config=kv_transfer_config)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts()]
        for i in range(0, NUM_PROMPTS, 2):
            llm.generate(requests[i : i + 2], sampling, use_tqdm=False)
        reset_prefix_cache_when_idle(llm)
        llm.generate(requests[:1], sampling, use_tqdm=False)  # P again: request 8
    finally:
        engine_shutdown(llm)
        del llm


def test_chunks_the_server_evicted_are_forgotten_and_offered_again(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    from offload_fsm.vocabulary.decisions import (
        OpRejected,
        RejectReason,
        StoredChunksForgotten,
        StoreSettled,
    )
    from replay.runner import replay

    log_dir = tmp_path / "events"
    with LMCacheServer(log_dir=tmp_path / "server", l1_size_gb=L1_SIZE_GB) as server:
        run(tiny_model_dir, our_kv_transfer_config(
            server, log_dir, **{"lmcache.mp.lazy_offload_policy": "EVICTION_AWARE",
                                "lmcache.mp.lazy_offload_max_deferral_seconds": 0.001}))
        objects = server.object_count()

    forgotten: list[StoredChunksForgotten] = []
    rejected_again: list[OpRejected] = []
    settled_first: list[str] = []

    def observe(_seq: int, _event: object, outcome: Any, _state: object) -> None:
        for decision in outcome.decisions:
            if isinstance(decision, StoredChunksForgotten):
                forgotten.append(decision)
            elif isinstance(decision, StoreSettled) and not decision.failed:
                settled_first.append(decision.req_id)
            elif (isinstance(decision, OpRejected) and decision.req_id.startswith("8-")
                    and decision.reason is RejectReason.ALREADY_STORED):
                rejected_again.append(decision)

    result = replay(log_dir, observer=observe)
    assert result.ok, (result.divergence, result.damage, result.lost)
    assert any(r.startswith("0-") for r in settled_first), "P was never stored: no pressure"
    assert forgotten, f"no lookup showed a remembered chunk missing ({objects} objects held)"
    assert rejected_again == []
