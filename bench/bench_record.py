"""What recording costs the recorder process: ``EventRecorder.record`` on its
main thread and its writer thread's CPU, side by side with another revision
(not a timed test). vLLM's engine pays neither: it only packs and hands off
(``connector.handoff``; its cost is ``bench.simulate``'s log on / off arms).

    .venv/bin/python -m bench.bench_record [--steps 20000] [--against REV]

Drives ``bench.bench_longrun``'s decode-heavy mix over the fake engine for
``--steps`` steps; every callback goes through ``EventRecorder.record``,
timed with ``perf_counter_ns`` (the timing wrapper's own ~0.1 us per call is
in the numbers, on both sides). Prints record()'s cost per event (a call's
time over its events): median, p90, p99 and mean (the mean carries the
digests and snapshots, which the caller's thread computes), the snapshots'
cost and the slowest call; the writer thread's CPU (the process's CPU
time less this thread's) per event and per step; and bytes per step. With
``--against REV`` the same runs on ``git archive REV`` (e.g. a revision
writing an older schema) in a subprocess, and both print side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import bench_longrun
from bench.trees import extracted
from connector.recorder.recording import EventRecorder
from logfiles.runs import run_files
from offload_fsm.log.records import SCHEMA_VERSION


def measure(steps: int, seed: int) -> dict[str, Any]:
    costs: list[float] = []
    calls: list[int] = []
    perf = time.perf_counter_ns
    recorders: list[EventRecorder] = []

    class TimedRecorder(EventRecorder):
        def record(self, applied: Sequence[Any], state: Any) -> None:
            started = perf()
            super().record(applied, state)
            if applied:
                took = perf() - started
                costs.append(took / len(applied))
                calls.append(took)

        def close(self, state: Any = None, **options: Any) -> None:
            recorders.append(self)
            super().close(state, **options)

    directory = Path(tempfile.mkdtemp(prefix="bench-record-"))
    bench_longrun.EventRecorder = TimedRecorder  # type: ignore[misc]
    cpu, main = time.process_time(), time.thread_time()
    events, _ = bench_longrun.generate(directory, steps, seed=seed, concurrency=48,
                                       pool_blocks=4096)
    writer_s = (time.process_time() - cpu) - (time.thread_time() - main)
    size = sum(path.stat().st_size for path in run_files(directory))
    shutil.rmtree(directory)
    ordered = sorted(costs)
    recorder = recorders[0]
    return {
        "snapshots": recorder.snapshots,
        # taken on the caller's thread
        "snapshots_here": getattr(recorder, "snapshots_here", recorder.snapshots),
        "snapshot_ms": recorder.snapshot_s * 1e3 / max(1, recorder.snapshots),
        "max_call_ms": max(calls) / 1e6,
        "calls_over_1ms": sum(took > 1_000_000 for took in calls),
        "call_p999_us": sorted(calls)[len(calls) * 999 // 1000] / 1e3,
        "schema": SCHEMA_VERSION, "steps": steps, "events": events,
        "median_ns": statistics.median(ordered),
        "p90_ns": ordered[len(ordered) * 9 // 10], "p99_ns": ordered[len(ordered) * 99 // 100],
        "mean_ns": statistics.fmean(ordered),
        "writer_ns_per_event": writer_s * 1e9 / events,
        "writer_us_per_step": writer_s * 1e6 / steps,
        "bytes_per_step": size / steps,
    }


def _against(rev: str, steps: int, seed: int) -> dict[str, Any]:
    """Run this bench on ``git archive rev`` (with this file, and what it
    imports from ``bench``, copied in)."""
    with extracted(rev, "bench-record-tree-") as tree:
        here = Path(__file__).parent
        for name in ("bench_record.py", "trees.py"):
            shutil.copy(here / name, tree / "bench" / name)
        out = subprocess.run(
            [sys.executable, "-m", "bench.bench_record", "--steps", str(steps), "--seed",
             str(seed), "--json"],
            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
            capture_output=True, text=True).stdout
        return json.loads(out.splitlines()[-1])  # type: ignore[no-any-return]


ROWS = [
    ("record() per event, median", "median_ns", 1e-3, "us"),
    ("record() per event, p90", "p90_ns", 1e-3, "us"),
    ("record() per event, p99", "p99_ns", 1e-3, "us"),
    ("record() per event, mean", "mean_ns", 1e-3, "us"),
    ("writer thread CPU per event", "writer_ns_per_event", 1e-3, "us"),
    ("writer thread CPU per step", "writer_us_per_step", 1.0, "us"),
    ("bytes per step", "bytes_per_step", 1.0, "B"),
    ("snapshots taken", "snapshots", 1.0, ""),
    ("of which on the caller's thread", "snapshots_here", 1.0, ""),
    ("caller's thread per snapshot", "snapshot_ms", 1.0, "ms"),
    ("record() call, p99.9", "call_p999_us", 1.0, "us"),
    ("record() calls over 1 ms", "calls_over_1ms", 1.0, ""),
    ("slowest record() call", "max_call_ms", 1.0, "ms"),
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--against", help="a git revision to measure side by side")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.steps, args.seed)))
        return
    sides = [measure(args.steps, args.seed)]
    if args.against:
        sides.insert(0, _against(args.against, args.steps, args.seed))
    names = [f"schema {s['schema']}" + (f" ({args.against})" if args.against and i == 0
                                        else " (this tree)") for i, s in enumerate(sides)]
    print(f"{args.steps:,} steps, {sides[-1]['events']:,} events (bench_longrun's mix)")
    print(f"| metric | {' | '.join(names)} |")
    print(f"|---|{'---|' * len(sides)}")
    for label, key, scale, unit in ROWS:
        cells = [f"{side[key] * scale:.2f} {unit}" for side in sides]
        print(f"| {label} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
