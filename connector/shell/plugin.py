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

What the keys alone cannot tell, whether vLLM's prefix caching is on (lazy
offload needs it), is in the config being built, which that resolution is
not handed. So :func:`register` also wraps ``VllmConfig.__post_init__``
(:func:`check_finished_config`): once a config that names this connector is
complete, the connector's :func:`~connector.shell.lmcache_connector.check_vllm_config`
checks it whole, still in the front end, before any engine starts.
"""

from __future__ import annotations

from typing import Any

CONNECTOR_NAME = "EventSourcedLMCacheMPConnector"
_MARK = "_lazy_offload_checks_config"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(
            CONNECTOR_NAME, "connector.shell.lmcache_connector", CONNECTOR_NAME
        )
    check_on_resolution(KVConnectorFactory)
    from vllm.config import VllmConfig

    check_finished_config(VllmConfig)


def check_finished_config(config_cls: Any) -> None:
    """Wrap ``config_cls.__post_init__`` (once): a finished config whose
    ``kv_connector`` is this connector is checked whole (prefix caching)."""
    post_init = config_cls.__dict__["__post_init__"]
    if getattr(post_init, _MARK, False):
        return

    def __post_init__(self: Any) -> None:
        post_init(self)
        transfer = getattr(self, "kv_transfer_config", None)
        if getattr(transfer, "kv_connector", None) == CONNECTOR_NAME:
            from connector.shell.lmcache_connector import check_vllm_config

            check_vllm_config(self)

    __post_init__.__doc__ = post_init.__doc__
    setattr(__post_init__, _MARK, True)
    config_cls.__post_init__ = __post_init__


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
