"""``python -m bench.soak``: the arms, one arm's run, and the command line.

Contract. :func:`main` parses the flags (``--help``), builds the tiny model under
``--out``, runs each arm of ``--arms`` for its minutes (one after another, or all at
once with ``--side-by-side``), writes ``soak.json`` after each arm and at the end,
then ``soak.md`` with the tables it prints. An arm that fails is reported with its
error and the other arms still run. :func:`run_arm` starts the arm's LMCache server
(not for ``none``) and API server, its traffic and sampler, the faults (``ours`` only,
unless ``--no-faults``), waits for the traffic and the in-flight stores to settle,
stops both servers, and for ``ours`` asks ``python -m replay`` for ``summary --json``
and ``verify`` of the log.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import bench.soak
from bench.soak import cpu
from bench.soak.engine import (
    Sampler,
    api_server,
    dir_bytes,
    end_state,
    processes,
    scrape,
    settle,
    warning_kinds,
)
from bench.soak.faults import (
    lmcache_objects,
    lost_receipt_env,
    lost_receipt_fault,
    restart_fault,
)
from bench.soak.report import figures, percentile, report
from bench.soak.traffic import Traffic
from bench.soak.turns import Turns
from bench.trees import REPO
from testkit.env import apply_e2e_env
from testkit.lmcache_server import LMCacheServer
from testkit.lose_one_receipt import FIRED

apply_e2e_env()

UNRELIABLE_SERVER_SETTINGS = {"lmcache.mp.heartbeat_interval": 1.0,
                              "lmcache.mp.mq_timeout": 5.0}
ARM_NAMES = {"ours": "ours EA", "ours_log_off": "ours EA, log off", "none": "no connector",
             "stock_eager": "stock eager", "stock_lazy": "LMCache's own lazy EA"}


def transfer_config(arm: str, server: LMCacheServer | None, log_dir: Path,
                    args: argparse.Namespace) -> dict[str, Any] | None:
    if arm == "none" or server is None:
        return None
    if arm in ("stock_eager", "stock_lazy"):
        lazy = {"lmcache.mp.lazy_offload": True} if arm == "stock_lazy" else {}
        return {"kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": server.connector_config(
                    **UNRELIABLE_SERVER_SETTINGS, **lazy)}
    return {"kv_connector": "EventSourcedLMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": server.connector_config(**{
                **UNRELIABLE_SERVER_SETTINGS,
                "lmcache.mp.lazy_offload": True,
                "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE",
                "lmcache.mp.lazy_offload_log_dir": str(log_dir) if arm == "ours" else "",
                "lmcache.mp.lazy_offload_log_max_total_mib": args.log_max_total_mib,
                "lmcache.mp.lazy_offload_log_max_file_mib": args.log_max_file_mib,
                "lmcache.mp.lazy_offload_receipt_lease_s": args.lease_s,
            })}


def run_arm(arm: str, minutes: float, model_dir: Path, out: Path,
            args: argparse.Namespace, turns: Turns | None = None) -> dict[str, Any]:
    """One arm's run; with ``turns``, its traffic only in its turns, for ``minutes``
    of its own turns (``turns.wall_s`` end to end)."""
    work = out / arm
    work.mkdir(parents=True, exist_ok=True)
    log_dir = work / "events"
    log_path = work / "api_server.log"
    duration_s = minutes * 60
    faults = arm == "ours" and not args.no_faults
    server = None
    if arm != "none":
        server = LMCacheServer(log_dir=work / "lmcache").start()
    extra_env: dict[str, str] = {}
    t0_file = work / "traffic_t0"
    note_path = work / "lost_receipt.jsonl"
    if faults:
        extra_env = lost_receipt_env(args.lose_receipt_at * duration_s, t0_file, note_path)
    files_seen: set[str] = set()
    result: dict[str, Any] = {"arm": arm, "name": ARM_NAMES[arm], "minutes": minutes,
                              "dir": str(work), "faults": {}}
    print(f"== {ARM_NAMES[arm]}: {minutes:g} min, logs in {work}", flush=True)
    try:
        config = transfer_config(arm, server, log_dir, args)
        result["kv_transfer_config"] = config
        with api_server(model_dir, config, log_path, args.blocks, extra_env,
                        args.shutdown_timeout) as (port, api_pid):
            if turns is not None:
                turns.arrive()
                duration_s = result["turns_wall_s"] = turns.wall_s
            t0 = time.monotonic()
            t0_file.write_text(repr(time.time()))
            sampler = Sampler(port, api_pid, log_dir if arm == "ours" else None, t0)
            sampler.start()
            lmcache_pid = server.pid if server is not None else None
            cpu_before = cpu.reading(processes(api_pid), lmcache_pid)
            traffic = Traffic(port, str(model_dir), args.seed, args.concurrency,
                              t0 + duration_s, t0,
                              turns.gate(arm) if turns is not None else None)
            traffic.start()
            progress = threading.Thread(target=_progress, args=(sampler, traffic, t0,
                                                                duration_s), daemon=True)
            progress.start()
            if faults:
                assert server is not None
                result["faults"]["server_restart"] = restart_fault(
                    server, port, log_path, t0, t0 + args.restart_at * duration_s,
                    args.outage_s)
                result["faults"]["lost_receipt"] = lost_receipt_fault(
                    port, log_path, note_path, t0 + args.lose_receipt_at * duration_s,
                    args.lease_s)
            traffic.join()
            result["traffic_s"] = round(time.monotonic() - t0, 1)
            result["cpu_s"] = cpu.spent(cpu_before, cpu.reading(processes(api_pid),
                                                                lmcache_pid))
            result["settle"] = settle(port, arm.startswith("ours"))
            sampler.stop()
            final = scrape(port)
            result["end"] = end_state(final, arm.startswith("ours"))
            result["samples"] = sampler.samples
            result["pids"] = {k: sorted(v) for k, v in sampler.pids_seen.items()}
            files_seen = set(sampler.files_seen)
            result["log_files_seen"] = len(files_seen)
            result["requests"] = traffic.requests
            result["errors"] = dict(traffic.errors)
            result["sessions"] = traffic.sessions
            if server is not None:
                result["lmcache_objects_end"] = lmcache_objects(server)
            stopping = time.monotonic()
        result["shutdown_s"] = round(time.monotonic() - stopping, 1)
    except BaseException:
        if turns is not None:
            turns.abort()
        raise
    finally:
        if server is not None:
            server.stop()
    text = log_path.read_text(errors="replace")
    result["warnings"] = {level: dict(kinds.most_common())
                          for level, kinds in warning_kinds(text).items()}
    result["hook_lines"] = [line for line in text.splitlines() if FIRED.split(":")[0] in line]
    if arm == "ours":
        _recorders_gone(result["pids"].get("recorder", []))
        remaining = dir_bytes(log_dir)[1]
        result["log_files_end"] = len(remaining)
        result["log_files_deleted"] = len(files_seen - set(remaining))
        result["replay_summary"] = replay_cli("summary", log_dir, "--json")
        result["replay_verify"] = replay_cli("verify", log_dir)
    result["figures"] = figures(result, args)
    return result


def _progress(sampler: Sampler, traffic: Traffic, t0: float, duration_s: float) -> None:
    every = 60.0 if duration_s >= 600 else 30.0
    next_at = every
    while time.monotonic() - t0 < duration_s:
        time.sleep(1.0)
        if time.monotonic() - t0 < next_at:
            continue
        next_at += every
        last = sampler.samples[-1] if sampler.samples else {}
        done = list(traffic.requests)
        lat = [r["latency_s"] for r in done[-200:]]
        print(f"  t={time.monotonic() - t0:6.0f}s requests={len(done)} "
              f"errors={sum(traffic.errors.values())} p50(last 200)="
              f"{percentile(lat, 0.5) or 0:.2f}s engine_rss={last.get('engine_rss_mib')} MiB "
              f"recorder_rss={last.get('recorder_rss_mib')} log_dir={last.get('log_dir_mib')} "
              f"MiB pinned={last.get('pinned_blocks')}", flush=True)


def _recorders_gone(pids: list[int], timeout_s: float = 30.0) -> None:
    """Wait for the recorders to exit: vLLM's abort-mode shutdown kills the
    engine, not its recorder (it left the engine's process tree), which then
    writes what it holds and closes the log on its own."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:  # gone, or a zombie nobody reaped yet
                if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            except OSError:
                break
            time.sleep(0.1)


def replay_cli(command: str, log_dir: Path, *extra: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "replay", command, str(log_dir), *extra],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    out: dict[str, Any] = {"rc": proc.returncode, "wall_s": round(time.monotonic() - start, 1),
                           "stderr": proc.stderr[-2000:]}
    if "--json" in extra:
        try:
            out["json"] = json.loads(proc.stdout)
        except ValueError:
            out["stdout"] = proc.stdout[-2000:]
    else:
        out["stdout"] = proc.stdout[-2000:]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak",
                                     description=(bench.soak.__doc__ or "").split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="our connector's run")
    parser.add_argument("--baseline-minutes", type=float, default=5.0,
                        help="each baseline's run (0: none)")
    parser.add_argument("--arms", default="ours,none,stock_eager,ours_log_off",
                        help=f"some of {', '.join(ARM_NAMES)}")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=256, help="GPU blocks of 32 tokens")
    parser.add_argument("--seed", type=int, default=20261204)
    parser.add_argument("--log-max-total-mib", type=float, default=1.0)
    parser.add_argument("--log-max-file-mib", type=float, default=0.125)
    parser.add_argument("--shutdown-timeout", type=int, default=0,
                        help="vLLM's --shutdown-timeout (its default 0: abort at once)")
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--restart-at", type=float, default=0.3)
    parser.add_argument("--outage-s", type=float, default=10.0)
    parser.add_argument("--lose-receipt-at", type=float, default=0.6)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run the arms at once, each on its own server and pool: a "
                             "long soak's RSS slope beside a baseline's over the same hours "
                             "and the same machine load")
    parser.add_argument("--interleave", type=float, default=0.0, metavar="S",
                        help="start every arm at once and let the traffic through to one "
                             "arm at a time, S seconds each, round after round "
                             "(bench.soak.turns); every arm gets --minutes of turns")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path(f"/tmp/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": commit,
            "argv": sys.argv[1:], "args": {k: str(v) for k, v in vars(args).items()},
            "out": str(out)}
    print(f"soak: {json.dumps(meta)}", flush=True)
    from testkit.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(out / "model")
    arms = [(arm, args.minutes if arm == "ours" else args.baseline_minutes)
            for arm in (a.strip() for a in args.arms.split(",")) if arm]
    arms = [(arm, minutes) for arm, minutes in arms if minutes > 0]
    results: list[dict[str, Any]] = []

    def one(arm: str, minutes: float, turns: Turns | None = None) -> dict[str, Any]:
        try:
            return run_arm(arm, minutes, model_dir, out, args, turns)
        except Exception as error:  # noqa: BLE001 - report the other arms anyway
            print(f"arm {arm} failed: {error!r}", flush=True)
            return {"arm": arm, "name": ARM_NAMES[arm], "error": repr(error)}

    if args.interleave:
        if not args.no_faults:
            parser.error("--interleave needs --no-faults (the faults are timed for a run "
                         "of its own)")
        turns = Turns([arm for arm, _ in arms], args.interleave, args.minutes * 60)
        with ThreadPoolExecutor(max_workers=len(arms)) as pool:
            results = list(pool.map(lambda a: one(a[0], args.minutes, turns), arms))
    elif args.side_by_side:
        with ThreadPoolExecutor(max_workers=len(arms)) as pool:
            results = list(pool.map(lambda a: one(*a), arms))
    else:
        for arm, minutes in arms:
            results.append(one(arm, minutes))
            (out / "soak.json").write_text(json.dumps({"meta": meta, "results": results},
                                                      indent=1, default=str))
    (out / "soak.json").write_text(json.dumps({"meta": meta, "results": results},
                                              indent=1, default=str))
    text = report(results)
    (out / "soak.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {out / 'soak.json'}, {out / 'soak.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
