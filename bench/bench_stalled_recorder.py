"""Engine-process memory while the event log's recorder process is stalled.

    PYTHONPATH=. .venv/bin/python -m bench.bench_stalled_recorder --scale issue12 \
        --configs 0 --stretch 3 --log-budget-mib 16

What it measures, and why: the engine hands each scheduler step's events to a
recorder process (``connector.handoff``) and promises that what it holds for
a recorder that does not read (stalled, swapped out, stopped) stays within the
hand-off budget (``lmcache.mp.lazy_offload_log_budget_mib``): past it, events
are dropped and counted, and serving goes on. The issue's target: the engine
process's RSS grows by at most the budget + 10 % while the recorder is stalled.

It runs the simulator's ``ours EA`` arm (vLLM's real scheduler, our connector,
``bench.sim``) on one config three times, each in a fresh interpreter so that
the three start from the same heap:

1. ``off``: the log off. The simulator's own growth over the same steps (its
   requests, the core's buffered ops, the ground truth: hundreds of MiB), and
   the run's length, which sets the resume step;
2. ``running``: the log on, budget ``--log-budget-mib``, the recorder left alone;
3. ``stalled``: the same, and at ``--stop-at-step`` (the recorder is up: the
   simulator waits for it before serving) the recorder process gets SIGSTOP;
   serving goes on; at ``--resume-at`` of the run's steps SIGCONT, and the run
   ends normally (the recorder drains, the engine resumes the log with a
   snapshot, END).

In each, this process's RSS (``VmRSS`` of ``/proc/self/status``) is read at the
stop step and every ``--sample-every`` steps up to the resume step. A budget
fills only after budget ÷ (hand-off bytes per step) stalled steps (about 1.4 KB
a step on the agentic traces: 16 MiB is about 12,000 steps), so ``--stretch K``
runs the config's load K times as long (sessions and arrival window times K).

Contract: prints, per run, the RSS at the stop step, the peak up to the resume
step, the delta, the delta less the log-off run's, the most the run's growth
exceeded the log-off run's at the same step, ``Handoff.stats.bytes_in_flight_max``,
the events, ``Handoff.events_lost``, the outages and the step the first began,
and glibc's ``mallinfo2()`` growth from the stop to the resume step (bytes in
use, mmapped blocks included; bytes free inside the heaps: fragmentation);
then the target: the stalled run's delta less the log-off run's against the
budget + 10 % (the simulator's own growth is no part of the engine's cost of a
stalled recorder, so the raw delta is not what the target bounds); then
``python -m replay verify`` on the stalled run's log (its exit code and lines: a
GAP for the stalled steps' events is expected, so exit code 3, "a lost event",
when the budget filled). The recorder gets SIGCONT whatever happens. Same arm,
workload and parameters: the same decisions every run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
from typing import Any

from bench.sim.arms import LAZY, ArmSpec, SimParams
from bench.sim.loop import Sim
from bench.sim.workload import generate, make_params
from bench.simulate import SCALES

_MIB = 1024 * 1024
RUNS = ("off", "running", "stalled")


def rss_bytes() -> int:
    """This process's resident set (``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def malloc_bytes() -> tuple[int, int]:
    """glibc's ``mallinfo2()``, all arenas: ``(in use, free inside the heaps)``;
    in use counts mmapped blocks (pymalloc's arenas among them)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


class StalledSim(Sim):
    """:class:`bench.sim.loop.Sim` that stops its recorder process (if any) at
    ``stop_at`` and lets it go on at ``resume_at``, reading RSS meanwhile."""

    def __init__(self, *args: Any, stop_at: int, resume_at: int, every: int, stall: bool,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stop_at, self.resume_at, self.every = stop_at, resume_at, every
        self.stall = stall
        self.rss_at_stop = 0
        self.malloc_at_stop = self.malloc_at_resume = (0, 0)
        self.samples: list[tuple[int, int]] = []  # (step, RSS) from the stop to the resume
        self.first_outage_step: int | None = None
        self.stopped_pid: int | None = None

    def _one_step(self, step: int) -> None:
        if step == self.stop_at:
            self.malloc_at_stop = malloc_bytes()
            self.rss_at_stop = rss_bytes()
            self.samples.append((step, self.rss_at_stop))
            if self.recorder is not None and self.stall:
                self.stopped_pid = self.recorder.pid
                os.kill(self.stopped_pid, signal.SIGSTOP)
        super()._one_step(step)
        handoff = self.recorder.handoff if self.recorder is not None else None
        if handoff is not None and self.first_outage_step is None and handoff.stats.outages:
            self.first_outage_step = step
        if self.stop_at <= step <= self.resume_at and (step - self.stop_at) % self.every == 0:
            self.samples.append((step, rss_bytes()))
        if step == self.resume_at:
            self.malloc_at_resume = malloc_bytes()
            if (step - self.stop_at) % self.every:
                self.samples.append((step, rss_bytes()))
            self._resume()

    def _resume(self) -> None:
        if self.stopped_pid is not None:
            os.kill(self.stopped_pid, signal.SIGCONT)
            self.stopped_pid = None

    def run(self) -> Any:
        try:
            return super().run()
        finally:
            self._resume()  # never leave a stopped recorder behind


def _one_run(a: argparse.Namespace) -> dict[str, Any]:
    """One run (``--run off|on``) in this process; its figures as a dict."""
    preset, scale, window, _, blocks, seqs = SCALES[a.scale][a.configs][:6]
    cfg = SCALES[a.scale][a.configs]
    sessions = generate(make_params(preset, scale * a.stretch, a.seed, window * a.stretch))
    sp = SimParams(num_gpu_blocks=blocks, max_num_seqs=seqs,
                   max_num_batched_tokens=cfg[6] if len(cfg) > 6 else 2048,
                   seed=a.seed, lookups=a.lookups)
    ea = ("lmcache.mp.lazy_offload_policy", "EVICTION_AWARE")
    if a.run == "off":
        arm = ArmSpec("ours EA (log off)", "ours",
                      (LAZY, ea, ("lmcache.mp.lazy_offload_log_dir", "")))
    else:
        stalled = "recorder stalled" if a.run == "stalled" else "recorder running"
        log_dir = os.path.join(a.log_dir, a.run)
        os.makedirs(log_dir, exist_ok=True)
        arm = ArmSpec(f"ours EA, log on ({a.log_budget_mib:g} MiB), {stalled}", "ours",
                      (LAZY, ea, ("lmcache.mp.lazy_offload_log_dir", log_dir),
                       ("lmcache.mp.lazy_offload_log_budget_mib", a.log_budget_mib)))
    sim = StalledSim(arm, sessions, sp, log_dir=a.log_dir, stop_at=a.stop_at_step,
                     resume_at=a.resume_step, every=a.sample_every,
                     stall=a.run == "stalled")
    res = sim.run()
    handoff = sim.recorder.handoff if sim.recorder is not None else None
    return {"arm": arm.name, "steps": res.steps, "rss_at_stop": sim.rss_at_stop,
            "samples": sim.samples, "first_outage_step": sim.first_outage_step,
            "malloc_at_stop": sim.malloc_at_stop, "malloc_at_resume": sim.malloc_at_resume,
            "bytes_in_flight_max": handoff.stats.bytes_in_flight_max if handoff else None,
            "events": handoff._seq if handoff else None,
            "events_lost": handoff.events_lost if handoff else None,
            "outages": handoff.stats.outages if handoff else None}


def _child(argv: list[str], run: str, resume_step: int) -> dict[str, Any]:
    """``_one_run`` in a fresh interpreter, so both runs start from the same heap."""
    out = subprocess.run([sys.executable, "-m", "bench.bench_stalled_recorder", *argv,
                          "--run", run, "--resume-step", str(resume_step)],
                         stdout=subprocess.PIPE, text=True, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(SCALES), default="issue12")
    ap.add_argument("--configs", type=int, default=0, help="one config index of --scale")
    ap.add_argument("--seed", type=int, default=20261129)
    ap.add_argument("--lookups", choices=("keep", "missing"), default="keep")
    ap.add_argument("--stretch", type=int, default=1,
                    help="the config's sessions and arrival window times this: the same load, "
                    "this many times as long (a budget fills only after budget / bytes per "
                    "step stalled steps)")
    ap.add_argument("--log-budget-mib", type=float, default=16.0)
    ap.add_argument("--stop-at-step", type=int, default=100)
    ap.add_argument("--resume-at", type=float, default=0.9,
                    help="the share of the run's steps (the log-off run's) at which the "
                    "recorder gets SIGCONT")
    ap.add_argument("--sample-every", type=int, default=50)
    ap.add_argument("--log-dir", default="", help=argparse.SUPPRESS)
    ap.add_argument("--run", choices=RUNS, default="", help=argparse.SUPPRESS)
    ap.add_argument("--resume-step", type=int, default=10**9, help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(argv)
    if a.run:  # a child: one run, its figures as JSON on the last line
        print(json.dumps(_one_run(a)))
        return 0
    preset, _, _, pool_label, blocks = SCALES[a.scale][a.configs][:5]
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="bench-stalled-")
    argv += ["--log-dir", log_dir]
    budget = a.log_budget_mib * _MIB
    print(f"# bench.bench_stalled_recorder scale={a.scale} config={a.configs} ({preset} / "
          f"{pool_label}, {blocks} blocks) stretch={a.stretch} lookups={a.lookups} "
          f"seed={a.seed} budget="
          f"{a.log_budget_mib:g} MiB stop at step {a.stop_at_step} resume at "
          f"{a.resume_at:g} of the run's steps; RSS every {a.sample_every} steps; each run "
          f"in a fresh process; log dir {log_dir}")
    sys.stdout.flush()
    off = _child(argv, "off", 10**9)  # its length sets the resume step
    resume_at = max(a.stop_at_step + 1, int(off["steps"] * a.resume_at))
    runs = [off] + [_child(argv, run, resume_at) for run in RUNS[1:]]
    base = {s: r for s, r in off["samples"]}
    rows: list[list[str]] = []
    deltas: list[int] = []
    for run in runs:
        samples = [(s, r) for s, r in run["samples"] if s <= resume_at]
        peak = max(r for _, r in samples)
        deltas.append(peak - run["rss_at_stop"])
        # step for step over the log-off run, from the stop on
        over = max((r - run["rss_at_stop"]) - (base[s] - off["rss_at_stop"])
                   for s, r in samples if s in base)
        logged = run["events"] is not None
        series = " ".join(f"{r / _MIB:.0f}" for _, r in samples[:: max(1, len(samples) // 10)])
        print(f"# {run['arm']}: RSS MiB from step {a.stop_at_step} to {resume_at}, "
              f"sampled: {series}")
        rows.append([
            run["arm"], str(run["steps"]), f"{run['rss_at_stop'] / _MIB:.1f}",
            f"{peak / _MIB:.1f}", f"{deltas[-1] / _MIB:.1f}",
            f"{(deltas[-1] - deltas[0]) / _MIB:.1f}", f"{over / _MIB:.1f}",
            f"{run['bytes_in_flight_max'] / _MIB:.2f}" if logged else "-",
            str(run["events"]) if logged else "-", str(run["events_lost"]) if logged else "-",
            f"{run['outages']} (first at step {run['first_outage_step']})"
            if logged and run["outages"] else "0" if logged else "-",
            "{:+.1f} / {:+.1f}".format(*((r - b) / _MIB for r, b in zip(
                run["malloc_at_resume"], run["malloc_at_stop"], strict=True))),
        ])
    head = ["run", "steps", "RSS at the stop MiB", f"peak to step {resume_at} MiB",
            "delta MiB", "delta less log off's MiB", "most over log off, step for step MiB",
            "bytes in flight max MiB", "events", "events lost", "outages",
            "malloc in use / free in heaps, stop to resume MiB"]
    print(f"\nRSS from step {a.stop_at_step} (the recorder stopped in the stalled run) to "
          f"step {resume_at} (SIGCONT):\n")
    print("| " + " | ".join(head) + " |\n|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    stalled = deltas[2] - deltas[0]
    print(f"\nthe stalled run's delta less the log-off run's: {stalled / _MIB:.1f} MiB; less "
          f"the running recorder's: {(deltas[2] - deltas[1]) / _MIB:.1f} MiB; target (the "
          f"budget + 10 %) {budget * 1.1 / _MIB:.1f} MiB: "
          f"{'met' if stalled <= budget * 1.1 else 'NOT met'}")
    log_dir = os.path.join(log_dir, "stalled")
    verify = subprocess.run([sys.executable, "-m", "replay", "verify", log_dir],
                            capture_output=True, text=True)
    print(f"\n$ python -m replay verify {log_dir}   (exit code {verify.returncode})")
    for line in (verify.stdout + verify.stderr).strip().splitlines():
        print(f"    {line}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
