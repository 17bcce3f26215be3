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
