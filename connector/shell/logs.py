"""Structured, quiet logging for the connector: structlog bound loggers that
render to one line and hand it to the standard library, so vLLM's handlers
(the ``vllm`` logger tree) format and route it like any vLLM log line.

A record renders as ``<event> key=value key=value``; the event text comes
first so the spec's greppable lines (``lazy offload enabled with FIFO policy,
offload threshold: 20``) appear verbatim. Keys are stable snake_case.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

import structlog

LOGGER_NAME = "vllm.lazy_offload"


def _render(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> str:
    event = event_dict.pop("event", "")
    event_dict.pop("level", None)
    if not event_dict:
        return str(event)
    pairs = " ".join(f"{key}={value}" for key, value in event_dict.items())
    return f"{event} {pairs}"


def get_logger(**initial: Any) -> Any:
    """A structlog logger over ``logging.getLogger('vllm.lazy_offload')``."""
    return structlog.wrap_logger(
        logging.getLogger(LOGGER_NAME),
        processors=[structlog.stdlib.filter_by_level, _render],
        wrapper_class=structlog.stdlib.BoundLogger,
    ).bind(**initial)
