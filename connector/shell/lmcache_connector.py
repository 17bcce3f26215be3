"""``EventSourcedLMCacheMPConnector``: LMCache's ``LMCacheMPConnector`` with
the lazy-offload decision path replaced by ``offload_fsm``.

Drop-in: same ``lmcache.mp.*`` keys, same LMCache server, no server flags.
Everything but the lazy-offload decisions (lookup, retrieve, store transfers,
sessions, the worker side and its receipts) is LMCache's own code, unchanged:
LMCache 0.5.6 routes every lazy-offload call through one manager object, and
this class swaps in :class:`connector.shell.manager.EventSourcedManager`.

* ``lmcache.mp.lazy_offload`` false (the default): exactly the stock
  connector (eager stores).
* true: the lazy keys are validated at construction in both roles (a bad
  value fails start-up naming the key), prefix caching is required, and the
  event log is on by default (``lmcache.mp.lazy_offload_log_dir``).

Fail fast: the same validation (:func:`check_extra_config`, the same
messages) runs at the earliest points vLLM hands the class its config, before
any worker loads weights: the class methods vLLM calls while it resolves the
engine's config (``requires_piecewise_for_cudagraph``,
``get_required_kvcache_layout``, ``build_prom_metrics``) and, through the
plugin (``connector.shell.plugin``), every resolution of the connector class,
which the front end does in ``VllmConfig.__post_init__``.

The event log costs the engine one number and one pack per event: a
recorder process of its own writes it (``connector.handoff``,
``connector.recorder``).

Metrics: :meth:`get_kv_connector_stats` returns LMCache's lookup stats plus the
lazy-offload counter deltas and gauges (``connector.shell.metrics``); the class
methods ``build_kv_connector_stats`` and ``build_prom_metrics`` turn them into
the "KV Transfer metrics" log line and ``vllm:lazy_offload_*`` on ``/metrics``.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestState
from lmcache.v1.multiprocess.group_view import slice_block_ids_per_group
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from connector.handoff.sender import Handoff
from connector.handoff.supervisor import launcher
from connector.recorder.recording import installed_versions
from connector.recorder.writer import default_prefix
from connector.shell import kv_events, metrics, shutdown_signal
from connector.shell.candidates import chunk_due, source_of, storable_end
from connector.shell.logs import LOGGER_NAME
from connector.shell.manager import EventSourcedManager
from offload_fsm import parse_config
from offload_fsm.log.names import FILE_SUFFIX
from offload_fsm.vocabulary.config import (
    PREFIX,
    ConfigError,
    Policy,
    Settings,
    engine_endpoint,
)
from offload_fsm.vocabulary.decisions import SelectReason

DEFAULT_LOG_DIR_ENV = "LAZY_OFFLOAD_LOG_DIR"
DEFAULT_LOG_DIR = os.path.join(os.path.expanduser("~"), ".cache", "lazy-offload", "logs")
_MIB = 1024 * 1024
_log = logging.getLogger(LOGGER_NAME)  # in the vllm logger tree: vLLM formats and routes it


def _prefix_caching_on(vllm_config: Any) -> bool:
    return bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False))


def check_extra_config(extra_config: Any) -> Settings:
    """Parse the lazy-offload keys of ``kv_connector_extra_config``; raises
    :class:`ConfigError` (key, value, what is allowed) on the first bad one."""
    return parse_config(dict(extra_config or {}))


def check_vllm_config(vllm_config: Any) -> Settings:
    """:func:`check_extra_config`, then the settings lazy offload needs from
    vLLM itself (prefix caching)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    settings = check_extra_config(getattr(transfer, "kv_connector_extra_config", None))
    cache = getattr(vllm_config, "cache_config", None)
    if settings.shell.enabled and cache is not None and not _prefix_caching_on(vllm_config):
        raise ValueError(
            "lmcache.mp.lazy_offload requires vLLM prefix caching: start vLLM with "
            "--enable-prefix-caching (LLM(..., enable_prefix_caching=True)), or set "
            "lmcache.mp.lazy_offload to false"
        )
    return settings


def engine_index_of(parallel_config: Any) -> int:
    """The engine's data-parallel index. vLLM resets ``data_parallel_rank``
    to 0 in every engine of a dense model
    (``ParallelConfig.reconfigure_for_independent_dp_rank``) and keeps the
    real index in ``data_parallel_index``."""
    index = getattr(parallel_config, "data_parallel_index", None)
    if index is None:
        index = getattr(parallel_config, "data_parallel_rank", 0)
    return int(index or 0)


def _pool_hash(block_hash: Any) -> Any:
    """A request's block hash as the pool's block holding it carries it (with
    its KV group)."""
    return make_block_hash_with_group_id(block_hash, 0)


class EventSourcedLMCacheMPConnector(LMCacheMPConnector):  # type: ignore[misc]
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        self._stats_source: metrics.StatsSource | None = None
        self._lazy_candidates = False  # our store-candidate path (connector.shell.candidates)
        self._handoff: Handoff | None = None
        settings = check_vllm_config(vllm_config)
        config = settings.offload
        super().__init__(vllm_config, role, kv_cache_config)
        if not settings.shell.enabled or not hasattr(self, "_lazy_offload_manager"):
            return  # eager, or the worker role: LMCache's own code throughout
        strategy = self.scheduler_adapter.parallel_strategy
        world_size = int(strategy.vllm_world_size)
        engine_index = engine_index_of(vllm_config.parallel_config)
        run = _run_prefix(engine_index)
        handoff = self._handoff = _make_handoff(settings, world_size, engine_index,
                                                prefix=run)
        self._lazy_offload_manager = EventSourcedManager(
            config,
            world_size=world_size,
            group_tokens_per_block=list(self._group_tokens_per_block),
            step_budget_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
            chunk_tokens=int(self.scheduler_adapter.lmcache_tokens_per_chunk),
            event_log=handoff,
            run=run if handoff is not None else "",
            beside_model=True,  # the step's pass runs while the model does
        )
        self._stats_source = metrics.StatsSource(self._lazy_offload_manager, handoff)
        self._chunk_tokens = int(self.scheduler_adapter.lmcache_tokens_per_chunk)
        self._lazy_candidates = True
        # Always hooked: the signal also seals the log before vLLM stops its
        # workers (``EventSourcedManager.has_inflight_store_work``).
        hooked = shutdown_signal.install(self._lazy_offload_manager.shutdown_began)
        if config.shutdown_flush_s > 0 and not hooked:
            _log.warning("lazy offload: %s_shutdown_flush_s is set, but this is not vLLM's "
                         "engine-core process (no SIGTERM handler on the main thread); "
                         "the shutdown flush is off for this engine", PREFIX)
        # LMCache-tier KV events for a router: one warning when none will arrive.
        kv_events.router_blind_warning(vllm_config, self.scheduler_adapter)

    # -- the lazy store-candidate path (connector.shell.candidates) ----------------

    def _process_new_requests(self, scheduler_output: Any, metadata: Any) -> None:
        """Lazy: LMCache's bookkeeping of newly scheduled requests, and their
        whole new chunks offered to the manager; no store metadata is built
        (``connector.shell.candidates``). Eager: LMCache's own."""
        manager = self._candidate_manager()
        if manager is None:
            super()._process_new_requests(scheduler_output, metadata)
            return
        scheduled = scheduler_output.num_scheduled_tokens
        trackers = self.request_trackers
        chunk, save_decode = (self._chunk_tokens if self._can_store else None,
                              self._save_decode_cache)
        for new_request in scheduler_output.scheduled_new_reqs:
            tracker = trackers[new_request.req_id]
            tracker.increase_num_scheduled_tokens(scheduled[new_request.req_id])
            if chunk is not None and chunk_due(tracker, chunk, save_decode):
                self._offer_new_chunks(manager, tracker)

    def _process_cached_requests(self, scheduler_output: Any, metadata: Any) -> None:
        """Lazy: LMCache's bookkeeping of running requests (block ids appended
        as LMCache appends them, scheduled tokens), and their whole new chunks
        offered; no store metadata is built. Eager: LMCache's own."""
        manager = self._candidate_manager()
        if manager is None:
            super()._process_cached_requests(scheduler_output, metadata)
            return
        cached = scheduler_output.scheduled_cached_reqs
        scheduled = scheduler_output.num_scheduled_tokens
        resumed = cached.resumed_req_ids
        relocation = self._mamba_relocation_window
        trackers = self.request_trackers
        chunk, save_decode = (self._chunk_tokens if self._can_store else None,
                              self._save_decode_cache)
        for request_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
            tracker = trackers[request_id]
            if new_block_ids and request_id not in resumed:
                tracker.append_block_ids(new_block_ids, relocation)
            tracker.increase_num_scheduled_tokens(scheduled[request_id])
            if chunk is not None and chunk_due(tracker, chunk, save_decode):
                self._offer_new_chunks(manager, tracker)

    def _candidate_manager(self) -> EventSourcedManager | None:
        """Ours when the lazy store-candidate path is on; None: LMCache's own path."""
        manager = self._lazy_offload_manager if self._lazy_candidates else None
        return manager if isinstance(manager, EventSourcedManager) else None

    def _offer_new_chunks(self, manager: EventSourcedManager, tracker: Any) -> None:
        """Offer the request's whole chunks computed since its last offer
        (``LMCacheMPRequestTracker.num_stored_tokens`` moves as LMCache moves
        it when it builds a store). Called only for a producer's request with
        a chunk due (``chunk_due``)."""
        start = tracker.num_stored_tokens
        end = storable_end(tracker, self._chunk_tokens, self._group_tokens_per_block,
                           self._save_decode_cache)
        if not end:
            return
        group_block_ids = slice_block_ids_per_group(
            tracker.allocated_block_ids, self._group_tokens_per_block, start, end)
        tracker.increase_num_stored_tokens(end - start)
        manager.offer_chunks(tracker.request_id, start, end, group_block_ids,
                             source_of(tracker))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """LMCache's; then, with lazy offload, the step's pass starts
        (``connector.shell.beside``), after LMCache's own per-step I/O: a pass
        that took the GIL at that I/O would hold the step up."""
        metadata = super().build_connector_meta(scheduler_output)
        if self._lazy_candidates:
            self._lazy_offload_manager.start_pass()
        return metadata

    # -- fail fast: vLLM calls these with the config before weights load ---

    @classmethod
    def check_lazy_offload_config(cls, extra_config: Any) -> None:
        """Called by ``connector.shell.plugin`` whenever vLLM resolves this class."""
        check_extra_config(extra_config)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        check_extra_config(extra_config)
        return bool(super().requires_piecewise_for_cudagraph(extra_config))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        check_vllm_config(vllm_config)
        layout: str | None = super().get_required_kvcache_layout(vllm_config)
        return layout

    # -- metrics (connector.shell.metrics) ---------------------------------------

    def get_kv_connector_stats(self) -> metrics.LazyOffloadConnectorStats | None:
        """LMCache's lookup latencies since the last call plus lazy offload's
        counter deltas and changed gauges; None when nothing changed."""
        if self._lazy_candidates:
            self._lazy_offload_manager.settle()  # the step's pass may still write the state
        return metrics.get_stats(self._stats_source, super().get_kv_connector_stats())

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> metrics.LazyOffloadConnectorStats:
        return metrics.LazyOffloadConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        settings = check_vllm_config(vllm_config)
        if not settings.shell.enabled:
            return super().build_prom_metrics(vllm_config, metric_types, labelnames,
                                              per_engine_labelvalues)
        primary = SelectReason.FIFO if settings.offload.policy is Policy.FIFO else \
            SelectReason.WINDOW
        return metrics.LazyOffloadPromMetrics(vllm_config, metric_types, labelnames,
                                              per_engine_labelvalues, primary_reason=primary)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """LMCache's lookup, then what it showed about the chunks our core
        remembers stored (``EventSourcedManager.on_lookup_result``), and the
        reach of the allocation vLLM makes for the request next
        (``EventSourcedManager.on_lookup_answered``)."""
        result: tuple[int | None, bool] = super().get_num_new_matched_tokens(
            request, num_computed_tokens)
        manager = getattr(self, "_lazy_offload_manager", None)
        if result[0] is not None and isinstance(manager, EventSourcedManager):
            tracker = self.request_trackers.get(request.request_id)
            if (tracker is not None and tracker.lookup_started_at is None
                    and tracker.state is not LMCacheMPRequestState.BYPASS_LMCACHE):
                manager.on_lookup_result(request.request_id,
                                         int(tracker.num_lmcache_hit_tokens),
                                         request.block_hashes, _pool_hash)
            manager.on_lookup_answered(request.request_id, prompt_tokens=int(request.num_tokens),
                                       local_tokens=num_computed_tokens,
                                       hit_tokens=int(result[0]), loads_async=bool(result[1]))
        return result

    def shutdown(self) -> Any:
        """LMCache's shutdown (the manager hands END to the recorder), then at
        most ``end_wait_s`` for the recorder to write it (``Handoff.finish``):
        vLLM's engine core calls this on its way out and then leaves through
        ``os._exit``, where no exit handler runs."""
        try:
            return super().shutdown()
        finally:
            handoff = getattr(self, "_handoff", None)
            if handoff is not None:
                handoff.finish()


def _run_prefix(engine_index: int) -> str:
    """This run's log file prefix (``<prefix>-NNNNNN.lolog``): its start and
    process, and the engine's index where there are several."""
    return default_prefix() + (f"-engine{engine_index}" if engine_index else "")


def _make_handoff(
    settings: Settings, world_size: int, engine_index: int = 0, *, prefix: str | None = None
) -> Handoff | None:
    """The event log's hand-off to a recorder process, or None when the log
    is turned off (``log_dir`` = ""). ``prefix``: the run's file prefix
    (default :func:`_run_prefix`). The start-up line names the directory and
    the prefix, and how to explain a request from them.

    A log directory that cannot be created or written: when it was configured
    (``lmcache.mp.lazy_offload_log_dir``) start-up fails with a
    :class:`ConfigError` naming the key, the path and the OS error; the default
    one (no key) costs one warning, and vLLM serves without an event log."""
    shell = settings.shell
    directory = shell.log_dir
    origin = f"{PREFIX}_log_dir"
    if directory is None:
        directory = os.environ.get(DEFAULT_LOG_DIR_ENV)
        origin = f"${DEFAULT_LOG_DIR_ENV}" if directory is not None else "the default"
        if directory is None:
            directory = DEFAULT_LOG_DIR
    if not directory:
        return None
    try:
        _check_writable(directory)
    except OSError as error:
        if shell.log_dir is not None:
            raise ConfigError(f"{PREFIX}_log_dir", directory,
                              f"a directory the event log can be written to ({error})"
                              ) from error
        _log.warning("lazy offload: the event log directory %s (%s) cannot be written (%s); "
                     "serving continues without an event log; set %s_log_dir to a writable "
                     "directory, or to \"\" to turn the log off", directory, origin, error,
                     PREFIX)
        return None
    prefix = prefix or _run_prefix(engine_index)
    budget = max(1, round(shell.log_budget_mib * _MIB))
    spec = {
        "directory": directory, "prefix": prefix, "engine_index": engine_index,
        "world_size": world_size, "header_config": settings.to_wire(),
        "versions": installed_versions(),
        "pub_endpoint": engine_endpoint(shell.log_pub_endpoint, engine_index),
        "max_file_bytes": max(1, round(shell.log_max_file_mib * _MIB)),
        "max_total_bytes": max(1, round(shell.log_max_total_mib * _MIB)),
        "budget_bytes": budget,
    }
    launch = launcher(spec)
    handoff = Handoff(launch, budget_bytes=budget, warn=_log.warning,
                      release=getattr(launch, "remove", None))  # a test's stand-in has none
    _log.info("lazy offload: event log in %s, this run's files %s-*%s; explain a request "
              "from its id (the req_id= of a warning): python -m replay explain %s --prefix "
              "%s --request ID", directory, prefix, FILE_SUFFIX, directory, prefix)
    return handoff


def _check_writable(directory: str) -> None:
    """Raise :class:`OSError` unless ``directory`` can be created and written.
    The probe file has a name of its own (pid and random bits, created
    exclusively, never through a link), so a stale probe left by a process
    killed before it removed it (the same pid again in a new container) is
    no obstacle."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, probe = tempfile.mkstemp(prefix=f".probe-{os.getpid()}-", dir=directory)
    os.close(fd)
    os.unlink(probe)
