"""The tail flush on real vLLM-CPU against a real LMCache server.

FIFO with a threshold the workload never reaches, so the policy alone stores
nothing: whatever reaches the server is the tail flush's doing. Two prompts
of 600 unrelated tokens (two whole 256-token chunks each) are generated
together; one engine start per case:

* ``idle_flush_steps`` on: after ``generate`` returns the engine has no
  request, yet keeps stepping (``has_pending_push_work``) until the flush's
  stores are in: the server holds both prompts' chunks, and after
  ``reset_prefix_cache()`` a rerun of the first prompt is served from it.
* ``idle_flush_steps`` off, ``shutdown_flush_s`` on: the idle tail stays
  buffered (the server stays empty, the rerun gets no hit) until
  ``reset_prefix_cache()`` drops it (``cache_reset``: the connector hears of
  the reset from the block pool, though vLLM tells no connector), and the
  shutdown flush writes the rerun's tail while vLLM shuts down; the log's
  ``ShutdownLeft`` says nothing was left.

Both: greedy output equal across the cases, the event log replays clean.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from testkit.engine import shutdown as engine_shutdown
from testkit.engine import tiny_llm
from testkit.lmcache_server import LMCacheServer
from tests.e2e.test_connector import our_kv_transfer_config
from tests.e2e.test_stock_baseline import reset_prefix_cache_when_idle

pytestmark = pytest.mark.e2e

CHUNK_TOKENS = 256
PROMPT_TOKENS = 600  # two whole chunks each
CHUNKS_PER_PROMPT = PROMPT_TOKENS // CHUNK_TOKENS
POOL_BLOCKS = 96
WAIT_S = 60.0  # the loaded 2-core machine; a healthy run takes well under a second
QUIET_S = 3.0  # how long the server must stay empty without the idle flush

FIFO_NEVER = {
    "lmcache.mp.lazy_offload_policy": "FIFO",
    "lmcache.mp.lazy_offload_threshold": 100,
}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 2048) for _ in range(PROMPT_TOKENS)] for _ in range(2)]


def _wait_for_objects(server: LMCacheServer, count: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    seen = server.object_count()
    while seen < count and time.monotonic() < deadline:
        time.sleep(0.2)
        seen = server.object_count()
    return seen


def _run(model_dir: Path, server: LMCacheServer, log_dir: Path,
         **lazy: Any) -> dict[str, Any]:
    """Both prompts, the server's objects once idle, a rerun after a reset."""
    from vllm import SamplingParams, TokensPrompt

    idle_flush = bool(lazy.get("lmcache.mp.lazy_offload_idle_flush_steps"))
    config = our_kv_transfer_config(server, log_dir, **FIFO_NEVER, **lazy)
    llm = tiny_llm(model_dir, config, pool_blocks=POOL_BLOCKS)
    try:
        sampling = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in _prompts()]
        first = llm.generate(prompts, sampling, use_tqdm=False)
        want = 2 * CHUNKS_PER_PROMPT
        idle_objects = _wait_for_objects(server, want, WAIT_S if idle_flush else QUIET_S)
        reset_prefix_cache_when_idle(llm)
        rerun = llm.generate(prompts[:1], sampling, use_tqdm=False)
    finally:
        engine_shutdown(llm)
        del llm
    return {
        "ids": [list(o.outputs[0].token_ids) for o in (*first, *rerun)],
        "idle_objects": idle_objects,
        "rerun_hit": rerun[0].num_cached_tokens,
        "final_objects": server.object_count(),
    }


def _replayed(log_dir: Path) -> Any:
    from offload_fsm.invariants import ledger_closes
    from replay.runner import replay

    decisions: list[Any] = []
    result = replay(log_dir, observer=lambda _s, _e, outcome, _st: decisions.extend(
        outcome.decisions))
    assert result.ok, (result.divergence, result.damage, result.lost)
    assert result.ended_cleanly
    assert result.state is not None and ledger_closes(result.state) == []
    return result.state, decisions


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cases = {
        "idle": {"lmcache.mp.lazy_offload_idle_flush_steps": 4},
        # The wait ends at the last receipt; 10 s only bounds a slow CI box (the
        # kill grace is testkit.engine.SHUTDOWN_TIMEOUT_S).
        "shutdown": {"lmcache.mp.lazy_offload_shutdown_flush_s": 10},
    }
    for name, lazy in cases.items():
        root = tmp_path_factory.mktemp(f"tail-{name}")
        with LMCacheServer(log_dir=root / "server") as server:
            out[name] = _run(tiny_model_dir, server, root / "events", **lazy)
            out[name]["log_dir"] = root / "events"
    return out


def test_the_idle_flush_stores_the_tail_after_the_last_request(runs: dict[str, Any]) -> None:
    from offload_fsm.vocabulary.counters import Counter
    from offload_fsm.vocabulary.decisions import FlushTrigger, TailFlushed

    run = runs["idle"]
    assert run["idle_objects"] == 2 * CHUNKS_PER_PROMPT, run
    assert run["rerun_hit"] == CHUNKS_PER_PROMPT * CHUNK_TOKENS, run
    state, decisions = _replayed(run["log_dir"])
    flushes = [d for d in decisions if isinstance(d, TailFlushed)]
    assert flushes and {d.trigger for d in flushes} == {FlushTrigger.IDLE}
    assert all(d.idle_steps >= 4 for d in flushes)
    counters = state.counters
    # Both prompts' whole chunks (one op each: their prefill offered [0, 512) at once).
    assert counters[Counter.IDLE_FLUSH_TOKENS] == 2 * CHUNKS_PER_PROMPT * CHUNK_TOKENS
    assert counters[Counter.STORED_OPS] == counters[Counter.IDLE_FLUSH_OPS]  # nothing else
    assert counters[Counter.IDLE_FLUSHES] >= 1
    assert counters[Counter.SHUTDOWN_FLUSH_OPS] == 0


def test_without_it_the_tail_waits_and_the_shutdown_flush_stores_it(
    runs: dict[str, Any],
) -> None:
    from offload_fsm.vocabulary.counters import Counter
    from offload_fsm.vocabulary.decisions import ShutdownFlushBegan, ShutdownLeft, TailFlushed

    run = runs["shutdown"]
    assert run["idle_objects"] == 0, run  # the idle tail is not flushed
    assert run["rerun_hit"] == 0, run
    # The first pass's tail was dropped at the reset (the block pool's reset is
    # recorded, though LLM.reset_prefix_cache() tells no connector); the rerun's two
    # chunks were flushed while vLLM shut down.
    state, decisions = _replayed(run["log_dir"])
    story = {"counters": {k.value: v for k, v in state.counters.items() if v},
             "decisions": [type(d).__name__ for d in decisions]}
    assert run["final_objects"] == CHUNKS_PER_PROMPT, (run, story)
    assert run["ids"] == runs["idle"]["ids"]  # the same greedy output either way
    assert len([d for d in decisions if isinstance(d, ShutdownFlushBegan)]) == 1
    assert {d.trigger.value for d in decisions if isinstance(d, TailFlushed)} == {"shutdown"}
    left = [d for d in decisions if isinstance(d, ShutdownLeft)]
    assert left == [ShutdownLeft(requests=0, buffered_ops=0, buffered_tokens=0,
                                 in_flight_ops=0, in_flight_tokens=0)]
    counters = state.counters
    assert counters[Counter.DROPPED_CACHE_RESET_OPS] == 2  # the first pass's two requests
    assert counters[Counter.SHUTDOWN_FLUSH_OPS] == 1  # the rerun
    assert counters[Counter.SHUTDOWN_FLUSH_TOKENS] == CHUNKS_PER_PROMPT * CHUNK_TOKENS
    assert counters[Counter.STORED_TOKENS] == counters[Counter.SHUTDOWN_FLUSH_TOKENS]
    assert counters[Counter.DROPPED_STALE_TOKENS] == 0
    assert counters[Counter.IDLE_FLUSH_OPS] == 0
