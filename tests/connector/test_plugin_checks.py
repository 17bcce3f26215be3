"""The plugin checks a finished vLLM config that names the connector: lazy
offload without prefix caching is refused in ``VllmConfig`` itself (the
front end, before any engine process or weight), with the constructor's
fix-it message; the same config with prefix caching passes."""

from __future__ import annotations

from typing import Any

import pytest

from testkit.env import require_stack

require_stack()

from vllm.config import CacheConfig, KVTransferConfig, VllmConfig  # noqa: E402

from connector.shell.plugin import CONNECTOR_NAME, register  # noqa: E402


def _config(prefix_caching: bool) -> Any:
    return VllmConfig(
        cache_config=CacheConfig(enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(
            kv_connector=CONNECTOR_NAME, kv_role="kv_both",
            kv_connector_extra_config={"lmcache.mp.lazy_offload": True}))


def test_lazy_offload_without_prefix_caching_is_refused_by_the_config() -> None:
    register()
    register()  # idempotent: one wrapper
    with pytest.raises(ValueError, match="lmcache.mp.lazy_offload requires vLLM prefix "
                                         "caching: start vLLM with --enable-prefix-caching"):
        _config(prefix_caching=False)
    assert _config(prefix_caching=True).cache_config.enable_prefix_caching
