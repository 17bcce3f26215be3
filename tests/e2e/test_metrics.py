"""``/metrics`` of the real OpenAI server with our connector (loaded by name through
the plugin entry point) against a real LMCache server: completions come back, the
``vllm:lazy_offload_*`` families arrive through vLLM's connector-stats path, they move
with the traffic, LMCache's own lookup histogram is still there, and the ledger closes
from the scraped values alone (in ops and in tokens):

    admitted = buffered + verifying + in_flight + stored + failed + abandoned + sum(dropped)
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.api_server import get, post_json, running_api_server
from testkit.lmcache_server import LMCacheServer
from tests.e2e.test_connector import our_kv_transfer_config

pytestmark = pytest.mark.e2e

SETTLE_TIMEOUT_S = 60.0
P = "vllm:lazy_offload_"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``: (name, sorted labels minus model/engine) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = get(f"http://127.0.0.1:{port}/metrics")
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                  if k not in ("model_name", "engine")))
            key = (sample.name, labels)
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def by_label(samples: dict[Any, float], name: str) -> dict[str, float]:
    return {dict(labels).popitem()[1]: v for (n, labels), v in samples.items()
            if n == name and labels}


def ledger(samples: dict[Any, float], unit: str) -> tuple[float, float]:
    """(admitted, sum of the right-hand terms) from scraped values only."""
    admitted = value(samples, f"{P}admitted_{unit}_total")
    right = sum(by_label(samples, f"{P}dropped_{unit}_total").values())
    right += sum(value(samples, f"{P}{term}_{unit}_total")
                 for term in ("stored", "failed", "abandoned"))
    right += sum(value(samples, f"{P}{live}_{unit}") for live in ("buffered", "verifying",
                                                                  "in_flight"))
    return admitted, right


@pytest.fixture
def api_server(tiny_model_dir: Path, lmcache_server: LMCacheServer, tmp_path: Path
               ) -> Iterator[tuple[int, Path]]:
    kv_transfer_config = our_kv_transfer_config(
        lmcache_server, tmp_path / "events", module_path=None, **{
            "lmcache.mp.lazy_offload_policy": "FIFO",
            "lmcache.mp.lazy_offload_threshold": 1,
            "lmcache.mp.lazy_offload_select_count": 10,
        })
    log_path = tmp_path / "api_server.log"
    with running_api_server(tiny_model_dir, kv_transfer_config, log_path) as port:
        yield port, log_path


def test_metrics_move_and_the_ledger_closes_from_a_scrape(
    api_server: tuple[int, Path], tiny_model_dir: Path
) -> None:
    port, log_path = api_server
    before = scrape(port)
    assert (f"{P}admitted_ops_total", ()) in before, "lazy-offload metrics are not exported"
    assert value(before, f"{P}draining") == 0
    assert set(by_label(before, f"{P}dropped_ops_total")) >= {"stale", "evicted", "duplicate"}

    rng = random.Random(0)
    system = [rng.randrange(3, 2048) for _ in range(512)]
    for _ in range(4):  # FIFO threshold 1: each request's stores go out on a later step
        prompt = system + [rng.randrange(3, 2048) for _ in range(300)]
        reply = post_json(f"http://127.0.0.1:{port}/v1/completions", {
            "model": str(tiny_model_dir), "prompt": prompt, "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True})
        assert reply["usage"]["completion_tokens"] == 8

    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:  # receipts arrive a few steps later; scrape until a store is counted
        after = scrape(port)
        closes = all(left == right for left, right in
                     (ledger(after, "ops"), ledger(after, "tokens")))
        if value(after, f"{P}stored_ops_total") > 0 and closes:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"no settled store or the ledger does not close: ops "
                        f"{ledger(after, 'ops')} tokens {ledger(after, 'tokens')}\n"
                        f"{log_path.read_text(errors='replace')[-3000:]}")
        time.sleep(1.0)

    # Our connector, loaded by name alone through the vllm.general_plugins entry point
    # (no kv_connector_module_path), served them: it wrote its event log.
    assert list((log_path.parent / "events").glob("*.lolog")), "our connector wrote no log"
    text = log_path.read_text(errors="replace")
    if " INFO " in text:  # vLLM's own lines reached the file (in the full suite once not)
        assert "lazy offload enabled with FIFO policy, offload threshold: 1" in text
    assert value(after, f"{P}admitted_ops_total") > value(before, f"{P}admitted_ops_total")
    assert value(after, f"{P}submitted_ops_total") >= value(after, f"{P}stored_ops_total") > 0
    assert value(after, f"{P}stored_tokens_total") > 0
    assert value(after, f"{P}selected_ops_total", reason="fifo") > 0
    assert value(after, f"{P}token_steps_total") > 0
    assert value(after, f"{P}draining") == 0
    assert value(after, f"{P}log_items_lost") == 0
    # LMCache's own metric is kept beside ours.
    assert value(after, "vllm:lmcache_mp_lookup_duration_seconds_count") > 0
    lookup = "vllm:lmcache_mp_lookup_duration_seconds_c"  # _count and nothing else
    excerpt = [line for line in get(f"http://127.0.0.1:{port}/metrics")[1].splitlines()
               if line.startswith((P, lookup)) and "_created" not in line]
    out = Path(os.environ.get("LAZY_OFFLOAD_METRICS_EXCERPT", log_path.with_suffix(".metrics")))
    out.write_text("\n".join(excerpt) + "\n")
