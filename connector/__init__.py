"""connector: the vLLM KV connector around ``offload_fsm``, in three packages
by the process and thread they run in: ``connector.shell`` (vLLM's
scheduler thread: the connector class and the manager that feeds the core),
``connector.handoff`` (the engine's side of the event log) and
``connector.recorder`` (the recorder process that writes it); and one
module all three use, ``connector.background``: how the connector's own
threads and its recorder present themselves to the operating system (their
names, and the lowest priority for the work nobody waits on).

Load it in vLLM with ``"kv_connector": "EventSourcedLMCacheMPConnector",
"kv_connector_module_path": "connector"`` (or by name alone once the
``vllm.general_plugins`` entry point has registered it). The class is
imported lazily so the log writer and tests can import this package without
vLLM.
"""

from typing import Any

__all__ = ["EventSourcedLMCacheMPConnector"]


def __getattr__(name: str) -> Any:
    if name == "EventSourcedLMCacheMPConnector":
        from connector.shell.lmcache_connector import EventSourcedLMCacheMPConnector

        return EventSourcedLMCacheMPConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
