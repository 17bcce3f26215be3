"""Will LMCache-tier KV events reach vLLM's KV event publisher? A start-up check.

With vLLM's ``kv_events_config`` on, a KV-aware router (llm-d, Dynamo) learns
what LMCache holds from ``BlockStored`` / ``BlockRemoved`` events with medium
``"CPU"``. LMCache 0.5.6's workers hand vLLM those events from one of two
sources, chosen per worker at start-up
(``LMCacheMPWorkerAdapter._resolve_kv_event_source``):

* the server's event stream, when the server advertises the
  ``kv_event_stream`` capability (it does unless it was started with
  ``--kv-event-log-size 0`` or ``--disable-observability``); the worker then
  reports none of its own stores. The server stamps a store's record with its
  tokens only from the token bindings the *lmcache_driven* transfer path
  publishes; the *engine_driven* path publishes none, so every store is
  "unbound" and the stream carries nothing (no warning anywhere);
* otherwise its own completed stores (no LMCache evictions).

So events reach the publisher unless the server advertises the stream while
the workers' transfer mode resolves to engine_driven, which is the default on
CPU (``auto`` resolves to the device spec's default: engine_driven on CPU,
lmcache_driven on CUDA). :func:`router_blind_warning` decides that at
construction, from what the scheduler-side connector sees:

* vLLM's config: events on and a publisher other than ``"null"``;
* the transfer mode the workers will resolve, as ``create_transfer_context``
  does: the ``lmcache.mp.mp_transfer_mode`` key, else
  ``$LMCACHE_MP_TRANSFER_MODE`` (the workers inherit the engine's
  environment), else the device spec's default for vLLM's device type;
* one ``GET_EXPERIMENTAL`` round trip per LMCache server (the same query
  each worker makes at start-up), only when the first two leave the answer
  open.

It returns the warning text naming the fix, and logs it once through
``vllm.lazy_offload`` (vLLM's handlers format and route it). A diagnostic:
any failure of the check itself is logged at debug level and never stops
start-up; a server that does not answer in :data:`PROBE_TIMEOUT_S` gets no
warning.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from connector.shell.logs import LOGGER_NAME

TRANSFER_MODE_KEY = "lmcache.mp.mp_transfer_mode"
TRANSFER_MODE_ENV = "LMCACHE_MP_TRANSFER_MODE"
LMCACHE_DRIVEN = "lmcache_driven"
ENGINE_DRIVEN = "engine_driven"
# lmcache.v1.multiprocess.custom_types.KV_EVENT_CAPABILITY
EVENT_STREAM_CAPABILITY = "kv_event_stream"
PROBE_TIMEOUT_S = 5.0

_log = logging.getLogger(LOGGER_NAME)


def events_published(vllm_config: Any) -> bool:
    """vLLM collects KV cache events and hands them to a real publisher."""
    config = getattr(vllm_config, "kv_events_config", None)
    if config is None or not getattr(config, "enable_kv_cache_events", False):
        return False
    return str(getattr(config, "publisher", "null") or "null") != "null"


def resolve_transfer_mode(
    extra_config: Mapping[str, Any] | None, device_type: str,
    environ: Mapping[str, str] = os.environ,
) -> str:
    """The MP transfer mode LMCache's workers will use (``engine_driven`` or
    ``lmcache_driven``), resolved the way ``create_transfer_context`` does."""
    raw = (extra_config or {}).get(TRANSFER_MODE_KEY)
    if raw is None:
        raw = environ.get(TRANSFER_MODE_ENV, "auto")
    mode = str(raw).strip().lower()
    if mode != "auto":
        return mode
    from lmcache.v1.platform import get_device_spec

    spec = get_device_spec(device_type)
    if spec is None:
        return ENGINE_DRIVEN
    return str(spec.default_mp_transfer_mode().value)


def blind_servers(transfer_mode: str, streams: Mapping[str, bool | None]) -> list[str]:
    """The servers whose workers will publish no LMCache-tier events: the
    server advertises its event stream (``True``; ``None`` is unknown) and the
    workers do not use the lmcache_driven path that fills it."""
    if transfer_mode == LMCACHE_DRIVEN:
        return []
    return [url for url, advertised in streams.items() if advertised]


def warning_text(servers: list[str], transfer_mode: str, device_type: str) -> str:
    return (
        "KV events: vLLM publishes KV cache events, but no LMCache-tier (medium CPU) "
        f"BlockStored will reach the publisher: the LMCache server(s) {', '.join(servers)} "
        "advertise their own event stream, so the workers report no stores of their own, "
        f"and with transfer mode {transfer_mode} (device {device_type}) the server "
        "records no token bindings, so that stream stays empty. A KV-aware router "
        "(llm-d, Dynamo) will not learn what LMCache holds. Fix: start the LMCache server "
        "with --kv-event-log-size 0 (the workers then announce every completed store; "
        "LMCache's own evictions are not announced), or set "
        f"\"{TRANSFER_MODE_KEY}\": \"{LMCACHE_DRIVEN}\" in kv_connector_extra_config with "
        "the server's --supported-transfer-mode auto (its default) or lmcache_driven (the "
        "server then announces stores and evictions)."
    )


def probe_event_stream(client: Any, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the server behind ``client`` (an LMCache ``RequestClient``)
    advertises its event stream; None when it did not answer."""
    try:
        capabilities = client.get_experimental().result(timeout=timeout_s)
    except Exception as error:  # noqa: BLE001 - unknown, not fatal
        _log.debug("KV events: GET_EXPERIMENTAL got no answer (%r)", error)
        return None
    return EVENT_STREAM_CAPABILITY in set(capabilities)


def router_blind_warning(vllm_config: Any, scheduler_adapter: Any) -> str | None:
    """Log (once, at warning level) and return the warning when LMCache-tier
    events will not reach vLLM's publisher; None when they will, when events
    are off, or when the check could not tell."""
    try:
        if not events_published(vllm_config):
            return None
        from vllm.platforms import current_platform

        device_type = str(current_platform.device_type)
        transfer = getattr(vllm_config, "kv_transfer_config", None)
        extra = getattr(transfer, "kv_connector_extra_config", None)
        mode = resolve_transfer_mode(extra, device_type)
        if mode == LMCACHE_DRIVEN:
            return None
        clients = dict(getattr(scheduler_adapter, "req_clients", {}) or {})
        streams = {url: probe_event_stream(client) for url, client in clients.items()}
        servers = blind_servers(mode, streams)
    except Exception as error:  # noqa: BLE001 - a diagnostic never stops start-up
        _log.debug("KV events: the start-up check failed (%r)", error)
        return None
    if not servers:
        return None
    text = warning_text(servers, mode, device_type)
    _log.warning(text)
    return text
