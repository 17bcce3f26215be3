"""vLLM general plugin: registers the connector with vLLM's connector factory
so ``"kv_connector": "EventSourcedLMCacheMPConnector"`` works without
``kv_connector_module_path``, and checks the lazy-offload config as soon as
vLLM resolves the connector class. Declared in ``pyproject.toml`` under
``vllm.general_plugins``; vLLM calls :func:`register` in every process, maybe
more than once, so both steps are idempotent.

Why the check lives here: vLLM 0.32 builds connectors only after the workers
have loaded the weights and sized the KV cache, so a bad key caught in the
connector's ``__init__`` costs a model load (minutes on a large model). The
front end resolves the connector class much earlier, in
``VllmConfig.__post_init__`` (the hybrid-allocator check), before any engine
process starts. :func:`register` wraps ``KVConnectorFactory.get_connector_class``
so that a resolution which yields a class with ``check_lazy_offload_config``
(ours) validates the config's ``kv_connector_extra_config`` there, raising
the same :class:`offload_fsm.vocabulary.config.ConfigError` as the constructor. Any
other connector class is returned untouched.
"""

from __future__ import annotations

from typing import Any

CONNECTOR_NAME = "EventSourcedLMCacheMPConnector"
_MARK = "_lazy_offload_checks_config"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "connector.lmcache_connector", CONNECTOR_NAME
        )
    check_on_resolution(KVConnectorFactory)


def check_on_resolution(factory: Any) -> None:
    """Wrap ``factory.get_connector_class`` (once) with the config check."""
    resolve = factory.__dict__["get_connector_class"].__func__
    if getattr(resolve, _MARK, False):
        return

    def get_connector_class(cls: Any, kv_transfer_config: Any) -> Any:
        connector_cls = resolve(cls, kv_transfer_config)
        check = getattr(connector_cls, "check_lazy_offload_config", None)
        if check is not None:
            check(getattr(kv_transfer_config, "kv_connector_extra_config", None))
        return connector_cls

    get_connector_class.__doc__ = resolve.__doc__
    setattr(get_connector_class, _MARK, True)
    factory.get_connector_class = classmethod(get_connector_class)
