"""The engine side of the event log over a million scheduler steps: is its heap flat?

    PYTHONPATH=. .venv/bin/python -m bench.bench_handoff_memory --steps 1000000

What it measures, and why: ``connector.handoff`` promises that what the engine
holds for the log is bounded by its budget, bookkeeping included, however long
it runs. This drives one :class:`~connector.handoff.sender.Handoff` with a real
recorder process (``connector.handoff.supervisor``) through ``--steps`` scheduler
steps of the core (``offload_fsm.drive``; a short request now and then, empty
steps between: the smallest STEP messages, the most bookkeeping per byte) at
full speed, so the recorder falls behind now and then and outages, resumes and
snapshots happen as they would. After ``--warmup`` steps it samples this
process's Python heap (``tracemalloc``, current traced bytes) and RSS every
``--sample-every`` steps.

Contract: prints one line per sample (step, heap MiB, RSS MiB, events lost,
outages) and then the heap's spread after warm-up (max - min) against the
target, 1 MiB. It asserts nothing; a bench, not a test.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc
from typing import Any

import attrs

from connector.handoff.sender import Handoff
from connector.handoff.supervisor import launcher
from offload_fsm import Settings, drive, new_state
from offload_fsm.testing.synthetic import default_config
from offload_fsm.vocabulary.events import RequestArrived, RequestFinished, StepScheduled

_MIB = 1 << 20
TARGET_SPREAD_MIB = 1.0


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--warmup", type=int, default=100_000)
    parser.add_argument("--sample-every", type=int, default=50_000)
    parser.add_argument("--budget-mib", type=float, default=8.0)
    a = parser.parse_args()
    budget = int(a.budget_mib * _MIB)
    directory = tempfile.mkdtemp(prefix="bench-handoff-")
    spec = {"directory": directory, "prefix": "run", "engine_index": 0, "world_size": 2,
            "header_config": Settings(offload=default_config()).to_wire(),
            "versions": {"package": "bench", "vllm": "", "lmcache": ""},
            "max_file_bytes": 16 * _MIB, "max_total_bytes": 64 * _MIB,
            "budget_bytes": budget}
    launch = launcher(spec)
    handoff = Handoff(launch, budget_bytes=budget, warn=lambda message: None,
                      register_atexit=False, release=launch.remove)
    state = new_state(default_config(), world_size=2)
    step: Any = StepScheduled(scheduled_tokens=0, allocated_blocks=0, next_step_blocks=0,
                              reserve_blocks=0, free_blocks=100, window_block_ids=(),
                              reallocated=(), time_s=0.0)

    def execute(command: Any) -> None:
        return None

    samples: list[float] = []
    started = time.perf_counter()
    for i in range(a.steps):
        if i % 100 == 0:  # a request comes and goes: events other than empty steps
            rid = f"r{i}"
            handoff.record(drive(state, RequestArrived(req_id=rid), execute), state)
            handoff.record(drive(state, RequestFinished(req_id=rid, free_blocks=100), execute),
                           state)
        step = attrs.evolve(step, time_s=state.time_s + 0.001)
        handoff.record(drive(state, step, execute), state)
        if i == a.warmup:
            tracemalloc.start()
        if i >= a.warmup and (i - a.warmup) % a.sample_every == 0:
            heap = tracemalloc.get_traced_memory()[0] / _MIB
            samples.append(heap)
            print(f"step {i:>9,}  heap {heap:7.3f} MiB  rss {_rss_mib():7.1f} MiB  "
                  f"events lost {handoff.events_lost:>9,}  outages {handoff.stats.outages}",
                  flush=True)
    tracemalloc.stop()
    elapsed = time.perf_counter() - started
    handoff.close(state)
    ended = handoff.finish()
    spread = max(samples) - min(samples) if samples else 0.0
    print(f"{a.steps:,} steps in {elapsed:.0f} s; heap after warm-up: min {min(samples):.3f} "
          f"max {max(samples):.3f} MiB, spread {spread:.3f} MiB (target <= "
          f"{TARGET_SPREAD_MIB:g} MiB: {'met' if spread <= TARGET_SPREAD_MIB else 'MISSED'}); "
          f"recorder ended the log: {ended}")


if __name__ == "__main__":
    main()
