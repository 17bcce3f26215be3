"""Benchmark of the event log and the replay tool (not a timed test).

    .venv/bin/python -m bench.bench_replay [--requests 20000] [--profile]

Builds a realistic mixed log with the synthetic workload over the fake
engine (``offload_fsm.testing.synthetic``), recorded by the connector's ``EventRecorder``,
then prints one table:

* replay throughput: decode + fold through ``step`` + compare every check and
  digest (what ``verify`` does), in events per second;
* decode only: read, validate, decode every record, in records and events
  per second;
* fold only: ``step`` over the events already in memory (the core's ceiling);
* encoded bytes per event (framing included);
* ``EventRecorder.record`` on the calling thread, per event (median and p99
  over calls).

``--profile`` adds the top functions of a cProfile of the replay.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from connector.recorder.recording import EventRecorder
from logfiles.runs import run_files
from logfiles.scan import Entry, read_log
from offload_fsm.machine import step
from offload_fsm.state import new_state
from offload_fsm.testing.synthetic import default_config, run_workload
from replay.runner import replay

VERSIONS = {"package": "bench", "vllm": "", "lmcache": ""}


class TimedRecorder:
    """Calls ``EventRecorder.record`` and times each call."""

    def __init__(self, recorder: EventRecorder) -> None:
        self.recorder = recorder
        self.per_event_us: list[float] = []

    def __call__(self, applied, state) -> None:  # type: ignore[no-untyped-def]
        clock = time.perf_counter_ns
        start = clock()
        self.recorder.record(applied, state)
        elapsed = clock() - start
        self.per_event_us.append(elapsed / 1000.0 / len(applied))
        self.per_call_max_us = max(getattr(self, "per_call_max_us", 0.0), elapsed / 1000.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="bench-replay-"))
    config = default_config()
    recorder = EventRecorder(config, 2, str(directory), VERSIONS, prefix="bench",
                             register_atexit=False)
    timed = TimedRecorder(recorder)
    started = time.perf_counter()
    world = run_workload(requests=args.requests, seed=1, config=config, sink=timed)
    recorder.close(world.state)
    generate_s = time.perf_counter() - started
    events = len(world.applied)
    assert recorder.writer is None
    size = sum(p.stat().st_size for p in run_files(directory))

    # Replay (what verify does), best of three.
    replay_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        result = replay(directory)
        replay_s.append(time.perf_counter() - t0)
        assert result.ok and result.events_applied == events, result.stopped

    decode_s = []
    records = 0
    for _ in range(3):
        t0 = time.perf_counter()
        records = sum(1 for item in read_log(directory) if isinstance(item, Entry))
        decode_s.append(time.perf_counter() - t0)

    inputs = [event for event, _ in world.applied]
    fold_s = []
    for _ in range(3):
        state = new_state(config, world_size=2)
        t0 = time.perf_counter()
        for event in inputs:
            step(state, event)
        fold_s.append(time.perf_counter() - t0)

    per_event = sorted(timed.per_event_us)
    rows = [
        ("replay (decode+fold+check)", f"{events / min(replay_s):,.0f} events/s",
         ">= 1,000,000 events/s"),
        ("decode only", f"{records / min(decode_s):,.0f} records/s = "
         f"{events / min(decode_s):,.0f} events/s", "(msgpack ~3.5 M small records/s)"),
        ("fold only (step, in memory)", f"{events / min(fold_s):,.0f} events/s",
         "(ceiling of replay)"),
        ("encoded bytes per event", f"{size / events:.1f} B", "<= 40 B"),
        ("record() per event, median", f"{statistics.median(per_event):.2f} us", "<= 2 us"),
        ("record() per event, p99", f"{per_event[int(0.99 * (len(per_event) - 1))]:.2f} us",
         ""),
        ("record() slowest call (digest)", f"{timed.per_call_max_us / 1000.0:.2f} ms",
         "(state_digest every 1000 events, on the calling thread)"),
    ]
    print(f"log: {events:,} events in {records:,} records, {size:,} bytes, "
          f"{args.requests:,} requests (generated in {generate_s:.1f} s) at {directory}")
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print(f"{'metric':<{widths[0]}}  {'measured':>{widths[1]}}  target")
    for name, value, target in rows:
        print(f"{name:<{widths[0]}}  {value:>{widths[1]}}  {target}")

    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        replay(directory)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
        print(text.getvalue())


if __name__ == "__main__":
    main()
