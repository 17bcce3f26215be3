"""What the core's ``step`` costs per event on a recorded log (not a timed test).

    .venv/bin/python -m bench.bench_fold LOG [--prefix RUN] [--repeat 5]

Decodes the run once (``replay.reader``), then folds every event through
``offload_fsm.machine.step`` from a fresh state ``--repeat`` times and keeps
the fastest pass, timed with the process CPU clock (a shared, loaded box
stretches wall time, not this much). Decoding, outcome checks and digests
are left out: this is the fold alone, the part ``replay verify`` and the
connector's scheduler thread both pay. Prints scheduler steps per second
and, from one more pass that times each event, per event type the count,
the total and the mean microseconds; then the fold's cost per scheduler step
(p50 / p99 / p99.9 / max) and, for the slowest 1 % of steps, the mean per
event type (where the connector's p99 work in the core goes), and the cyclic
GC's collections during that pass.
Compare two trees on one log side by side (run each from its checkout).
A log to use: the ``ours EA`` arm of ``python -m bench.simulate`` (its
``event_log_dir`` is printed first) or ``bench.bench_longrun --keep DIR``.
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import Counter, defaultdict

from logfiles.scan import Entry, read_log
from offload_fsm.log.records import Header, Inputs
from offload_fsm.machine import step
from offload_fsm.state import State, new_state
from offload_fsm.vocabulary.events import Event, StepScheduled
from replay.runner import config_of


def read_events(log: str, prefix: str | None) -> tuple[Header | None, list[Event]]:
    """A run's first header and every input event, in order (decoded once)."""
    header: Header | None = None
    events: list[Event] = []
    for entry in read_log(log, prefix):
        if not isinstance(entry, Entry):
            continue
        if isinstance(entry.record, Header) and header is None:
            header = entry.record
        elif isinstance(entry.record, Inputs):
            events.extend(entry.record.events)
    return header, events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="a log file or directory")
    parser.add_argument("--prefix", default=None, help="the run's file prefix in a directory")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    header, events = read_events(args.log, args.prefix)
    if header is None:
        parser.error(f"{args.log}: no header record")

    def fresh() -> State:
        assert header is not None
        return new_state(config_of(header), world_size=header.world_size)

    best_s = float("inf")
    for _ in range(args.repeat):
        state = fresh()
        started = time.process_time()
        for event in events:
            step(state, event)
        best_s = min(best_s, time.process_time() - started)
    by_type: defaultdict[str, float] = defaultdict(float)  # one more pass, each event timed
    state, clock = fresh(), time.perf_counter
    each_s: list[float] = []
    collections = [0, 0, 0]

    def counted(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections[info["generation"]] += 1

    gc.collect()
    gc.callbacks.append(counted)
    for event in events:
        started = clock()
        step(state, event)
        each_s.append(clock() - started)
        by_type[type(event).__name__] += each_s[-1]
    gc.callbacks.remove(counted)
    counts = Counter(type(event).__name__ for event in events)
    steps = counts[StepScheduled.__name__]
    print(f"{args.log}: {len(events):,} events, {steps:,} steps; fold {best_s * 1e3:.0f} ms "
          f"(best of {args.repeat}) = {steps / best_s:,.0f} steps/s, "
          f"{best_s / max(steps, 1) * 1e6:.1f} us per step")
    for name, spent_s in sorted(by_type.items(), key=lambda item: -item[1]):
        print(f"  {name:18s} {counts[name]:8,d} events {spent_s * 1e3:8.1f} ms "
              f"{spent_s / counts[name] * 1e6:8.1f} us each")
    _per_step(events, each_s)
    print(f"the cyclic GC's collections during that pass, by generation: {collections}")


def _per_step(events: list[Event], each_s: list[float]) -> None:
    """The fold's cost per scheduler step (a ``StepScheduled`` and the events
    up to the next one): p50 / p99 / p99.9 / max, and what the slowest 1 % of
    steps spend per event type."""
    steps: list[list[tuple[str, float]]] = []
    for event, spent_s in zip(events, each_s, strict=True):
        if isinstance(event, StepScheduled) or not steps:
            steps.append([])
        steps[-1].append((type(event).__name__, spent_s))
    ranked = sorted(steps, key=lambda s: -sum(t for _, t in s))
    totals = sorted(sum(t for _, t in s) * 1e6 for s in steps)
    n = len(totals)
    p99, p999 = totals[min(n - 1, n * 99 // 100)], totals[min(n - 1, n * 999 // 1000)]
    print(f"per step (us, one timed pass): p50 {totals[n // 2]:.1f}, p99 {p99:.1f}, "
          f"p99.9 {p999:.1f}, max {totals[-1]:.1f}")
    slow = ranked[: max(1, n // 100)]
    spent: defaultdict[str, float] = defaultdict(float)
    seen: Counter[str] = Counter()
    for one in slow:
        for name, spent_s in one:
            spent[name] += spent_s * 1e6 / len(slow)
            seen[name] += 1
    print(f"slowest 1 % ({len(slow)} steps), mean us per step by event type (events in them):")
    for name, us in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"  {name:18s} {us:9.1f} us  ({seen[name]:,})")


if __name__ == "__main__":
    main()
