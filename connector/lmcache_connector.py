"""``EventSourcedLMCacheMPConnector``: LMCache's ``LMCacheMPConnector`` with
the lazy-offload decision path replaced by ``offload_fsm``.

Drop-in: same ``lmcache.mp.*`` keys, same LMCache server, no server flags.
Everything but the lazy-offload decisions (lookup, retrieve, store transfers,
sessions, the worker side and its receipts) is LMCache's own code, unchanged:
LMCache 0.5.6 routes every lazy-offload call through one manager object, and
this class swaps in :class:`connector.manager.EventSourcedManager`.

* ``lmcache.mp.lazy_offload`` false (the default): exactly the stock
  connector (eager stores).
* true: the lazy keys are validated at construction in both roles (a bad
  value fails start-up naming the key), prefix caching is required, and the
  event log is on by default (``lmcache.mp.lazy_offload_log_dir``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

from connector.manager import EventSourcedManager
from connector.recording import EventRecorder, installed_versions
from offload_fsm import parse_config
from offload_fsm.config import PREFIX, ConfigError, OffloadConfig

DEFAULT_LOG_DIR_ENV = "LAZY_OFFLOAD_LOG_DIR"
DEFAULT_LOG_DIR = os.path.join(os.path.expanduser("~"), ".cache", "lazy-offload", "logs")
_MIB = 1024 * 1024
_log = logging.getLogger(__name__)


def _prefix_caching_on(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))


class EventSourcedLMCacheMPConnector(LMCacheMPConnector):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        config = parse_config(extra)
        if config.enabled and not _prefix_caching_on(vllm_config):
            raise ValueError(
                "lmcache.mp.lazy_offload requires vLLM prefix caching: start vLLM with "
                "--enable-prefix-caching (LLM(..., enable_prefix_caching=True)), or set "
                "lmcache.mp.lazy_offload to false"
            )
        super().__init__(vllm_config, role, kv_cache_config)
        self.offload_config = config
        if not config.enabled or not hasattr(self, "_lazy_offload_manager"):
            return  # eager, or the worker role: LMCache's own code throughout
        strategy = self.scheduler_adapter.parallel_strategy
        world_size = int(strategy.vllm_world_size)
        self._lazy_offload_manager = EventSourcedManager(
            config,
            world_size=world_size,
            group_tokens_per_block=list(self._group_tokens_per_block),
            step_budget_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
            chunk_tokens=int(self.scheduler_adapter.lmcache_tokens_per_chunk),
            recorder=_make_recorder(config, world_size),
        )

    def reset_cache(self) -> Any:
        result = super().reset_cache()
        manager = getattr(self, "_lazy_offload_manager", None)
        if isinstance(manager, EventSourcedManager):
            manager.reset_prefix_cache()
        return result


def _make_recorder(config: OffloadConfig, world_size: int) -> EventRecorder | None:
    """The event log writer, or None when turned off (``log_dir`` = "").

    A log directory that cannot be created or written: when it was configured
    (``lmcache.mp.lazy_offload_log_dir``) start-up fails with a
    :class:`ConfigError` naming the key, the path and the OS error; the default
    one (no key) costs one warning, and vLLM serves without an event log."""
    directory = config.log_dir
    origin = f"{PREFIX}_log_dir"
    if directory is None:
        directory = os.environ.get(DEFAULT_LOG_DIR_ENV)
        origin = f"${DEFAULT_LOG_DIR_ENV}" if directory is not None else "the default"
        if directory is None:
            directory = DEFAULT_LOG_DIR
    if not directory:
        return None
    try:
        return EventRecorder(
            config,
            world_size,
            directory,
            installed_versions(),
            pub_endpoint=config.log_pub_endpoint,
            max_file_bytes=max(1, round(config.log_max_file_mib * _MIB)),
            max_total_bytes=max(1, round(config.log_max_total_mib * _MIB)),
        )
    except OSError as error:
        if config.log_dir is not None:
            raise ConfigError(f"{PREFIX}_log_dir", directory,
                              f"a directory the event log can be written to ({error})"
                              ) from error
        _log.warning("lazy offload: the event log directory %s (%s) cannot be written (%s); "
                     "serving continues without an event log; set %s_log_dir to a writable "
                     "directory, or to \"\" to turn the log off", directory, origin, error,
                     PREFIX)
        return None
