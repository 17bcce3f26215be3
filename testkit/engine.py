"""Engine lifecycle helpers for tests, the demo and the benchmarks."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
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
# An engine process still alive this long before the grace ends is sent SIGABRT:
# with ``PYTHONFAULTHANDLER`` (``testkit.env``) it writes every thread's stack to its
# stderr before it dies, which a test's captured output then shows. vLLM's kill at
# the end of the grace leaves no such evidence.
ABORT_LEAD_S = 5.0
# vLLM 0.32's idle engine core waits on its input queue with no timeout, and its
# SIGTERM handler is Python: CPython runs it only when the main thread wakes. When
# the kernel delivers the process's SIGTERM to another of its threads, the main
# thread never wakes and the engine never shuts down (vLLM's own behaviour: it
# happens without any KV connector when SIGTERM lands on one of the engine's other
# threads). So an engine still alive this long after shutdown began gets SIGTERM
# again, sent to its main thread, which wakes it; the engine log says so. An engine
# running our connector does that itself (``connector.shell.shutdown_signal``); this is
# for the others (no connector, LMCache's own).
REDELIVER_AFTER_S = 10.0


def shutdown(llm: Any, timeout_s: float | None = SHUTDOWN_TIMEOUT_S) -> None:
    """Stop an offline ``vllm.LLM``'s engine (``timeout_s``: its grace before the
    kill; None is vLLM's default); note the engine processes' exit codes in the
    session's engine log (``testkit.engine_log``)."""
    client = llm.llm_engine.engine_core
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes = list(getattr(manager, "processes", ()))
    watchdogs = []
    if timeout_s is not None and timeout_s > ABORT_LEAD_S and processes:
        watchdogs.append(threading.Timer(timeout_s - ABORT_LEAD_S, _abort_stuck,
                                         args=(processes, timeout_s - ABORT_LEAD_S)))
        if timeout_s - ABORT_LEAD_S > REDELIVER_AFTER_S:
            watchdogs.append(threading.Timer(REDELIVER_AFTER_S, _redeliver,
                                             args=(processes, REDELIVER_AFTER_S)))
    for watchdog in watchdogs:
        watchdog.daemon = True
        watchdog.start()
    try:
        client.shutdown(timeout=timeout_s)
    finally:
        for watchdog in watchdogs:
            watchdog.cancel()
    if processes:
        engine_log.note(f"engine processes exit codes: {[p.exitcode for p in processes]}")


def _abort_stuck(processes: list[Any], waited_s: float) -> None:
    for process in processes:
        if process.is_alive() and process.pid is not None:
            engine_log.note(f"{process.name} pid={process.pid} still running {waited_s:.0f}s "
                            "after shutdown began: SIGABRT, for its threads' stacks on stderr")
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(process.pid, signal.SIGABRT)


def signal_thread(pid: int, tid: int, signum: int) -> bool:
    """Send ``signum`` to thread ``tid`` of process ``pid`` (glibc's ``tgkill``;
    the main thread's id is ``pid``). False where it was not sent: no
    ``tgkill`` (glibc < 2.30), or the call failed."""
    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    return tgkill is not None and tgkill(pid, tid, signum) == 0


def _redeliver(processes: list[Any], waited_s: float) -> None:
    for process in processes:
        if process.is_alive() and process.pid is not None:
            engine_log.note(f"{process.name} pid={process.pid} still running {waited_s:.0f}s "
                            "after shutdown began: SIGTERM again, to its main thread")
            signal_thread(process.pid, process.pid, int(signal.SIGTERM))


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
