"""vLLM general plugin: registers the connector with vLLM's connector factory
so ``"kv_connector": "EventSourcedLMCacheMPConnector"`` works without
``kv_connector_module_path``. Declared in ``pyproject.toml`` under
``vllm.general_plugins``; vLLM calls :func:`register` in every process."""

from __future__ import annotations

CONNECTOR_NAME = "EventSourcedLMCacheMPConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        CONNECTOR_NAME, "connector.lmcache_connector", CONNECTOR_NAME
    )
