"""Data parallelism end to end: the OpenAI server with ``--data-parallel-size
2`` (what users run), our connector in each engine, one shared log
directory. Each engine's files, headers and metric series carry its own
index (vLLM resets ``data_parallel_rank`` to 0 in every engine of a dense
model; the index is ``data_parallel_index``), ``/metrics`` shows both
engines' series, and ``replay verify`` and ``replay summary`` over the
shared directory report each engine and the total."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from logfiles.runs import run_files, run_prefixes
from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.framing import Record, scan
from offload_fsm.log.records import END, VANISHED
from offload_fsm.log.wire import unpackb
from testkit.api_server import get, post_json, running_api_server
from testkit.lmcache_server import LMCacheServer
from tests.e2e.test_connector import our_kv_transfer_config
from tests.replay.test_verify import _cli

pytestmark = pytest.mark.e2e

P = "vllm:lazy_offload_"


def _closed_runs(log_dir: Path, runs: int, timeout_s: float = 60.0) -> list[str | None]:
    """The runs of ``log_dir`` once ``runs`` of them end with END or VANISHED.
    vLLM's abort-mode shutdown kills the engines, not their recorders (they
    left its process tree): each one writes out what it holds and closes its
    log after its engine is gone, so the files are complete only then."""
    deadline = time.monotonic() + timeout_s
    while True:
        prefixes = run_prefixes(log_dir) if log_dir.is_dir() else []
        closed = [p for p in prefixes
                  if p is not None and _last_kind(log_dir, p) in (END, VANISHED)]
        if len(closed) >= runs or time.monotonic() > deadline:
            return prefixes
        time.sleep(0.2)


def _last_kind(log_dir: Path, prefix: str) -> int | None:
    records = [item for item in scan(run_files(log_dir, prefix)[-1].read_bytes())
               if isinstance(item, Record)]
    return int(unpackb(records[-1].payload)[0]) if records else None


def _per_engine(port: int, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    _, text = get(f"http://127.0.0.1:{port}/metrics")
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                engine = sample.labels.get("engine", "?")
                out[engine] = out.get(engine, 0.0) + sample.value
    return out


def test_two_engines_log_and_report_under_their_own_index(
    tiny_model_dir: Path, lmcache_server: LMCacheServer, tmp_path: Path,
) -> None:
    log_dir = tmp_path / "events"
    kv_transfer_config = our_kv_transfer_config(lmcache_server, log_dir, module_path=None, **{
        "lmcache.mp.lazy_offload_policy": "FIFO",
        "lmcache.mp.lazy_offload_threshold": 1,
    })
    log_path = tmp_path / "api_server.log"
    rng = random.Random(5)
    with running_api_server(tiny_model_dir, kv_transfer_config, log_path,
                            extra_args=("--data-parallel-size", "2"),
                            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as port:

        def complete() -> None:
            prompt = [rng.randrange(3, 2048) for _ in range(300)]
            reply = post_json(f"http://127.0.0.1:{port}/v1/completions", {
                "model": str(tiny_model_dir), "prompt": prompt, "max_tokens": 4,
                "temperature": 0.0, "ignore_eos": True})
            assert reply["usage"]["completion_tokens"] == 4

        for _ in range(8):  # vLLM balances requests over the two engines
            complete()
        # Each engine's recorder process must be up before vLLM's shutdown
        # kills its process tree (abort mode): on a loaded box its interpreter
        # may still be starting after 8 short requests. Its gauge moves when
        # the engine records, so requests go on until both report it up.
        deadline = time.monotonic() + 60
        while True:
            admitted = _per_engine(port, f"{P}admitted_ops_total")
            up = _per_engine(port, f"{P}log_recorder_up")
            if (len([v for v in admitted.values() if v > 0]) == 2
                    and sorted(up.values()) == [1.0, 1.0]) or time.monotonic() > deadline:
                break
            complete()
            time.sleep(0.5)
        assert sorted(up.values()) == [1.0, 1.0], up
        assert set(admitted) == {"0", "1"}, admitted
        assert all(value > 0 for value in admitted.values()), admitted
    prefixes = _closed_runs(log_dir, 2)
    assert len(prefixes) == 2, prefixes
    engines = set()
    for prefix in prefixes:
        first = next(iter(scan(run_files(log_dir, prefix)[0].read_bytes())))
        engines.add(LogDecoder().decode(first.payload).engine_index)  # type: ignore[union-attr]
    assert engines == {0, 1}
    assert any(str(p).endswith("-engine1") for p in prefixes)
    code, out, err = _cli("verify", str(log_dir))
    assert code == 0, (out, err)
    assert "== total: 2 runs (engines 0, 1)" in out and "2 of 2 OK" in out
    code, out, _ = _cli("summary", str(log_dir), "--json")
    assert code == 0 and json.loads(out)["total"]["ledger_closes"]
