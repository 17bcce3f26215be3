"""Counting wrappers for the side-by-side benchmark: the stock connector and ours,
each subclassed only to count the STORE operations they put into step metadata and to
dump their lazy-offload counters at shutdown (to ``$BENCH_COUNTS_FILE``). Loaded inside
vLLM's engine process through ``kv_connector_module_path = "bench.counting"``."""

from __future__ import annotations

import json
import os
from typing import Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

from connector.shell.lmcache_connector import EventSourcedLMCacheMPConnector
from connector.shell.manager import EventSourcedManager


class _Counting:
    _stores = 0
    _store_tokens = 0

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)  # type: ignore[misc]
        for request in getattr(meta, "requests", ()):
            if request.direction == "STORE":
                self._stores += 1
                self._store_tokens += request.op.end - request.op.start
        return meta

    def shutdown(self) -> Any:
        path = os.environ.get("BENCH_COUNTS_FILE")
        manager = getattr(self, "_lazy_offload_manager", None)
        counters: dict[str, Any] = {}
        if isinstance(manager, EventSourcedManager):
            counters = dict(manager.state.counters)
        elif manager is not None:
            policy = getattr(manager, "_policy", None)
            line = getattr(policy, "_ledger_line", None)
            if callable(line):
                for pair in line().split():
                    key, _, value = pair.partition("=")
                    counters[key] = int(value) if value.isdigit() else value
        result = super().shutdown()  # type: ignore[misc]
        if path and getattr(self, "_role", None) is not None and str(self._role).endswith(
            "SCHEDULER"
        ):
            with open(path, "w") as handle:
                json.dump({"stores": self._stores, "store_tokens": self._store_tokens,
                           "counters": counters}, handle)
        return result


class CountingLMCacheMPConnector(_Counting, LMCacheMPConnector):  # type: ignore[misc]
    pass


class CountingEventSourcedConnector(_Counting, EventSourcedLMCacheMPConnector):  # type: ignore[misc]
    pass
