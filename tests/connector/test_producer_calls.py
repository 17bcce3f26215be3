"""The connector tells the event log's writer when vLLM's scheduler thread is
inside one of its calls (``producer_calls``), so the writer thread stands
back from the GIL meanwhile ("The GIL" in ``connector.eventlog``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from testkit.env import require_stack

require_stack()

from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector  # noqa: E402

from connector.lmcache_connector import (  # noqa: E402
    EventSourcedLMCacheMPConnector,
    _producer_call,
)

_SCHEDULER_CALLS = ("build_connector_meta", "update_connector_output",
                    "update_state_after_alloc", "request_finished",
                    "request_finished_all_groups", "get_num_new_matched_tokens",
                    "get_kv_connector_stats")


def _owner(writer: Any) -> Any:
    return SimpleNamespace(_log_writer=writer)


def test_a_call_counts_while_it_runs_and_nests() -> None:
    writer = SimpleNamespace(producer_calls=0)
    inner = _producer_call(lambda self: self._log_writer.producer_calls)
    outer = _producer_call(lambda self: (self._log_writer.producer_calls, inner(self)))
    assert outer(_owner(writer)) == (1, 2)
    assert writer.producer_calls == 0


def test_a_call_that_raises_still_counts_down() -> None:
    writer = SimpleNamespace(producer_calls=0)

    def fails(self: Any) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _producer_call(fails)(_owner(writer))
    assert writer.producer_calls == 0


def test_without_an_event_log_a_call_is_the_method_itself() -> None:
    assert _producer_call(lambda self, x, *, y: x + y)(_owner(None), 2, y=3) == 5


@pytest.mark.parametrize("name", _SCHEDULER_CALLS)
def test_every_scheduler_call_is_counted(name: str) -> None:
    method = getattr(EventSourcedLMCacheMPConnector, name)
    wrapped = method.__wrapped__
    assert wrapped is getattr(LMCacheMPConnector, name) or (
        wrapped.__qualname__ == f"EventSourcedLMCacheMPConnector.{name}")
