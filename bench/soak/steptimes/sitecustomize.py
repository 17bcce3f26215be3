"""Per-call wall time of the engine's step parts, in every process of a real vLLM
server (not a timed test; a diagnostic for ``bench.soak``).

    STEPTIME_DIR=/tmp/st PYTHONPATH=bench/soak/steptimes:. \
        PY -m bench.soak --arms ours,stock_eager --minutes 2 --baseline-minutes 2 \
        --no-faults --blocks 2048 --out /tmp/soak
    PY -m bench.soak.steptimes.report /tmp/st

Python imports ``sitecustomize`` at start-up in each process the soak starts (the
API server, vLLM's engine core and worker), so with ``STEPTIME_DIR`` set each
process wraps, as soon as their modules are imported, the scheduler's
``schedule`` and ``update_from_output``, the engine core's ``step``, the
executor's RPCs, the shared-memory queue's ``enqueue``/``dequeue``, the model
runner's ``execute_model``/``sample_tokens`` and LMCache's connector hooks (a
method wrapped in a base class counts its subclasses' ``super()`` calls too),
and every 5 s writes ``STEPTIME_DIR/<pid>.json``: per part, the calls and their
total seconds. Each figure includes its wrapper's own two clock reads.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections import defaultdict
from typing import Any

_OUT = os.environ.get("STEPTIME_DIR", "")
_TIMES: defaultdict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # part -> [calls, s]

# module -> (class, method, part) to wrap once the module is imported
_TARGETS: dict[str, list[tuple[str, str, str]]] = {
    "vllm.v1.core.sched.scheduler": [("Scheduler", "schedule", "schedule"),
                                     ("Scheduler", "update_from_output", "update")],
    "vllm.v1.engine.core": [("EngineCore", "step", "core.step")],
    "vllm.v1.executor.multiproc_executor": [
        ("MultiprocExecutor", "execute_model", "executor.execute_model"),
        ("MultiprocExecutor", "sample_tokens", "executor.sample_tokens"),
        ("WorkerProc", "enqueue_output", "worker.enqueue_output")],
    "vllm.distributed.device_communicators.shm_broadcast": [
        ("MessageQueue", "enqueue", "queue.enqueue"), ("MessageQueue", "dequeue", "queue.dequeue")],
    "vllm.v1.worker.gpu_model_runner": [
        ("GPUModelRunner", "execute_model", "runner.execute_model"),
        ("GPUModelRunner", "sample_tokens", "runner.sample_tokens")],
    "lmcache.integration.vllm.lmcache_mp_connector": [
        ("LMCacheMPConnector", name, "connector." + name) for name in (
            "build_connector_meta", "update_connector_output", "request_finished",
            "get_num_new_matched_tokens", "update_state_after_alloc", "get_kv_connector_stats",
            "start_load_kv", "wait_for_save", "get_finished", "build_connector_worker_meta")],
}


def _wrap(cls: Any, name: str, part: str) -> None:
    original = cls.__dict__[name]
    clock = time.perf_counter

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return original(self, *args, **kwargs)
        finally:
            entry = _TIMES[part]
            entry[0] += 1
            entry[1] += clock() - start

    setattr(cls, name, timed)


def _watch() -> None:
    """Wrap each target once its module has finished importing."""
    left = dict(_TARGETS)
    while left:
        for module_name in list(left):
            module = sys.modules.get(module_name)
            if module is None:
                continue
            with contextlib.suppress(AttributeError, KeyError):  # still importing
                classes = [getattr(module, cls) for cls, _, _ in left[module_name]]
                for cls, (_, method, part) in zip(classes, left[module_name], strict=True):
                    _wrap(cls, method, part)
                del left[module_name]
        time.sleep(0.01)


def _dump() -> None:
    while True:
        time.sleep(5)
        if _TIMES:
            path = os.path.join(_OUT, f"{os.getpid()}.json")
            with open(path + ".tmp", "w") as out:
                json.dump({"argv": sys.argv[:2], "parts": dict(_TIMES)}, out)
            os.replace(path + ".tmp", path)


if _OUT:
    threading.Thread(target=_watch, daemon=True).start()
    threading.Thread(target=_dump, daemon=True).start()
