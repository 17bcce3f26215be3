"""Engine lifecycle helpers for tests, the demo and the benchmarks."""

from __future__ import annotations

from typing import Any

# vLLM force-kills an EngineCore that has not exited 5 s after SIGTERM by
# default. Its scheduler-side connector shuts down last (after the workers),
# so on a loaded 2-core machine the kill can land before our connector writes
# the event log's END record. Tests give teardown room instead.
SHUTDOWN_TIMEOUT_S = 60.0


def shutdown(llm: Any) -> None:
    """Stop an offline ``vllm.LLM``'s engine, letting its teardown finish."""
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)


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
