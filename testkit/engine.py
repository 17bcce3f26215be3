"""Engine lifecycle helpers for tests, the demo and the benchmarks."""

from __future__ import annotations

import os
from typing import Any

from testkit import engine_log

# vLLM force-kills an EngineCore that has not exited 5 s after SIGTERM by
# default, and stops its workers (their own 5 s grace) before the scheduler-side
# connector's shutdown runs. Our connector seals its event log before that
# (``EventSourcedManager.has_inflight_store_work``), but on a loaded 2-core box
# an engine core can take longer than 5 s just to reach its SIGTERM handler
# (seen once, with a store in flight), so tests give teardown room
# (``E2E_SHUTDOWN_TIMEOUT_S`` overrides it: 5 is vLLM's default).
SHUTDOWN_TIMEOUT_S = float(os.environ.get("E2E_SHUTDOWN_TIMEOUT_S", "60"))


def shutdown(llm: Any, timeout_s: float | None = SHUTDOWN_TIMEOUT_S) -> None:
    """Stop an offline ``vllm.LLM``'s engine (``timeout_s``: its grace before the
    kill; None is vLLM's default); note the engine processes' exit codes in the
    session's engine log (``testkit.engine_log``)."""
    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes = list(getattr(manager, "processes", ()))
    client.shutdown(timeout=timeout_s)
    if processes:
        engine_log.note(f"engine processes exit codes: {[p.exitcode for p in processes]}")


def tiny_llm(model_dir: Any, kv_transfer_config: dict[str, Any] | None, *,
             pool_blocks: int, **options: Any) -> Any:
    """The offline engine every end-to-end test runs: the tiny model in float32,
    32-token blocks, prefix caching, eager, seed 0, a pool of ``pool_blocks``."""
    from vllm import LLM

    return LLM(
        model=str(model_dir),
        dtype="float32",
        block_size=32,
        max_model_len=2048,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        num_gpu_blocks_override=pool_blocks,
        kv_transfer_config=kv_transfer_config,
        **options,
    )
