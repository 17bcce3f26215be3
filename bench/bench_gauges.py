"""What the metrics cost per scheduler step on a recorded log (not a timed test).

    .venv/bin/python -m bench.bench_gauges LOG [--prefix RUN]

vLLM's scheduler calls the connector's ``get_kv_connector_stats`` every step
(with stats on), and ``connector.shell.metrics.StatsSource.collect`` runs there
(counter deltas, changed gauges). This folds the log's events through
``offload_fsm.machine.step`` and, after each ``StepScheduled``, times
``collect`` (the gauges of the ops from the core's live tallies) and, side by
side on the same state, the pass over every buffered and in-flight op that
those gauges took before the tallies (``invariants.ledger_terms`` in ops and
in tokens: the same sums). Prints p50 / p99 / mean of both and how many
steps recounted the batches and shielded ops.
A log to use: the ``ours EA`` arm of ``python -m bench.simulate`` (its
``event_log_dir`` is printed first).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from bench.bench_fold import read_events
from connector.shell.metrics import StatsSource
from offload_fsm.invariants import ledger_terms
from offload_fsm.machine import step
from offload_fsm.state import new_state
from offload_fsm.vocabulary.events import ShutdownRequested, StepScheduled
from replay.runner import config_of


def _line(name: str, samples_s: list[float]) -> str:
    ordered = sorted(samples_s)
    n = len(ordered)
    return (f"  {name:<22} p50 {ordered[n // 2] * 1e6:8.1f} us  p99 "
            f"{ordered[int(n * 0.99)] * 1e6:8.1f} us  mean {sum(ordered) / n * 1e6:8.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="a log file or directory")
    parser.add_argument("--prefix", default=None, help="the run's file prefix in a directory")
    args = parser.parse_args()
    header, events = read_events(args.log, args.prefix)
    if header is None:
        parser.error(f"{args.log}: no header record")
    state = new_state(config_of(header), world_size=header.world_size)
    source = StatsSource(SimpleNamespace(state=state, draining=False))
    collect_s: list[float] = []
    walk_s: list[float] = []
    walks = 0
    for event in events:
        if isinstance(event, ShutdownRequested):
            break
        step(state, event)
        if not isinstance(event, StepScheduled):
            continue
        before = source._walked_at
        started = time.perf_counter()
        source.collect()
        collect_s.append(time.perf_counter() - started)
        walks += source._walked_at != before
        started = time.perf_counter()
        ledger_terms(state, "ops")
        ledger_terms(state, "tokens")
        walk_s.append(time.perf_counter() - started)
    if not collect_s:
        parser.error(f"{args.log}: no scheduler steps")
    buffered = sum(len(rec.ops) for rec in state.pending.values())
    print(f"{args.log}: {len(collect_s):,} steps, {walks:,} recounted batches and shielded "
          f"ops; {buffered:,} ops buffered at the end")
    print(_line("collect() (as shipped)", collect_s))
    print(_line("the pass over the ops", walk_s))


if __name__ == "__main__":
    main()
