"""``replay verify`` on one core, this tree beside another revision (not a timed test).

    PYTHONPATH=. .venv/bin/python -m bench.bench_verify LOG --against REV [--pairs 40]
    PYTHONPATH=. .venv/bin/python -m bench.bench_verify LOG --against REV --against-log OLD

``--against-log``: the other revision verifies that log instead, its own
recording of the same trace (a revision older than the log's schema cannot
read this tree's); the per-pair ratio is then of time per step.

Starts one warm process per tree (this checkout, and ``git archive REV``),
each holding its own imports, and asks them for one in-process
``replay.cli.main(["verify", LOG, "--workers", "1"])`` at a time, the two
alternating (which goes first swaps every pair), timed on each process's CPU
clock. A busy, shared box slows both sides of a pair alike, so the pairs
give the ratio; the best of each side is its speed on a quiet moment.
Prints, per tree, the best, the quartiles and the median in ms and steps/s,
and for this tree the pairs it won and the median of its per-pair ratio.

A log to use: the ``ours EA`` arm of ``bench.simulate --scale issue12
--configs 0`` (its ``event_log_dir`` is printed first);
the same command run in ``git archive REV`` gives that revision's log.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.bench_fold import read_events
from bench.trees import REPO, extracted
from offload_fsm.vocabulary.events import StepScheduled

# One verify per line read; its CPU time in ms per line written.
_WORKER = """
import io, sys, time
from replay.cli import main
def verify():
    code = main(["verify", sys.argv[1], "--workers", "1"], out=io.StringIO(), err=io.StringIO())
    if code != 0:
        raise SystemExit(f"verify exited {code}")
verify()
for _ in sys.stdin:
    start = time.process_time()
    verify()
    print((time.process_time() - start) * 1000.0, flush=True)
"""


def _steps(log: str) -> int:
    _header, events = read_events(log, None)
    return sum(type(event) is StepScheduled for event in events)


def _worker(tree: Path, log: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, log], cwd=tree, text=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _one(worker: subprocess.Popen[str]) -> float:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write("go\n")
    worker.stdin.flush()
    line = worker.stdout.readline()
    if not line:
        raise SystemExit(f"a verify worker stopped (exit {worker.wait()})")
    return float(line)


def _row(name: str, times_ms: list[float], steps: int) -> str:
    ordered = sorted(times_ms)
    q1, median, q3 = statistics.quantiles(ordered, n=4)
    return (f"| {name} | {ordered[0]:.0f} ({steps / ordered[0] * 1000:,.0f}) "
            f"| {q1:.0f} / {median:.0f} / {q3:.0f} | {steps / median * 1000:,.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="an event log file or directory")
    parser.add_argument("--against", required=True, help="a git revision to verify beside")
    parser.add_argument("--against-log", default=None,
                        help="the log the other revision verifies (default: LOG)")
    parser.add_argument("--pairs", type=int, default=40, help="verifies per tree (>= 4)")
    args = parser.parse_args(argv)
    if args.pairs < 4:
        parser.error(f"--pairs {args.pairs}: expected at least 4")
    log = str(Path(args.log).resolve())
    their_log = str(Path(args.against_log).resolve()) if args.against_log else log
    steps = {"this tree": _steps(log), args.against: _steps(their_log)}
    with extracted(args.against, "bench-verify-tree-") as other:
        workers = {args.against: _worker(other, their_log), "this tree": _worker(REPO, log)}
        times: dict[str, list[float]] = {name: [] for name in workers}
        try:
            for pair in range(args.pairs):
                names = list(workers) if pair % 2 == 0 else list(workers)[::-1]
                for name in names:
                    times[name].append(_one(workers[name]))
        finally:
            for worker in workers.values():
                worker.kill()
                worker.wait()
    for name, path in (("this tree", log), (args.against, their_log)):
        print(f"{name}: {path}: {steps[name]:,} steps")
    print(f"{args.pairs} verifies per tree, alternating "
          "(CPU time of one in-process `replay verify --workers 1`)\n")
    print("| tree | best ms (steps/s) | quartiles ms | median steps/s |")
    print("|---|---|---|---|")
    for name, measured in times.items():
        print(_row(name, measured, steps[name]))
    per_step = {name: [ms / steps[name] for ms in measured] for name, measured in times.items()}
    ratios = [ours / theirs for ours, theirs in zip(per_step["this tree"],
                                                      per_step[args.against], strict=True)]
    won = sum(ratio < 1.0 for ratio in ratios)
    print(f"\nthis tree faster in {won} of {args.pairs} pairs; median ratio of time per step "
          f"(this / {args.against}) {statistics.median(ratios):.3f} "
          f"= {1 / statistics.median(ratios):.2f}x the steps/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
