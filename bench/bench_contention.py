"""What a background thread costs a CPU model that takes every core, at two
priorities (not a test).

    PYTHONPATH=. .venv/bin/python -m bench.bench_contention [--seconds 8] [--rounds 2]

What it measures, and why: on vLLM-CPU the model's torch threads take every core
and meet at a barrier after each operation, spinning while they wait for each
other. A thread of another process that takes a core from one of them leaves the
others spinning, so the model can lose more than the CPU that thread used. This
runs a stand-in model in its own process (``torch`` with as many threads as this
machine has cores, a loop of small matrix products and a ``tanh``, many barriers
a second) beside a competitor in another process that burns ``burn`` of CPU
every ``period`` and sleeps between, at nice 0 and at ``connector.background``'s
:data:`~connector.background.BACKGROUND_NICE`; and alone, first and last. For
each arm: the model's iterations a second, and how long the competitor's bursts
took on the wall clock (p50, p99, max): what a thread at that priority waits for
a core.

Contract: prints one row per arm and round, in order, so that rounds show the
box's drift. It asserts nothing. This is why the event log's I/O thread and the
recorder run at the lowest priority and the step's pass does not.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from typing import Any

from connector.background import BACKGROUND_NICE

MATRIX = 256  # the stand-in's matrices are MATRIX x MATRIX
OPS_PER_ITERATION = 20


def model(seconds: float, out: Any) -> None:
    """Iterations a second of a torch loop on every core, for ``seconds``."""
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    a, b = torch.randn(MATRIX, MATRIX), torch.randn(MATRIX, MATRIX)
    start, iterations = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        for _ in range(OPS_PER_ITERATION):
            a = torch.tanh(a @ b) * 0.5
        iterations += 1
    out.put(iterations / seconds)


def competitor(period_s: float, burn_s: float, nice: int, stop: Any, out: Any) -> None:
    """Burn ``burn_s`` of this thread's CPU every ``period_s`` until ``stop``;
    put the bursts' wall times, sorted."""
    os.nice(nice)
    walls: list[float] = []
    while not stop.is_set():
        start, cpu = time.perf_counter(), time.thread_time()
        while time.thread_time() - cpu < burn_s:
            pass
        walls.append(time.perf_counter() - start)
        time.sleep(period_s)
    out.put(sorted(walls))


def arm(seconds: float, burst: tuple[float, float, int] | None) -> str:
    ctx = mp.get_context("spawn")
    rates, walls, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    rival = None
    if burst is not None:
        rival = ctx.Process(target=competitor, args=(*burst, stop, walls))
        rival.start()
    runner = ctx.Process(target=model, args=(seconds, rates))
    runner.start()
    rate = rates.get()
    runner.join()
    stop.set()
    row = f"iterations/s {rate:7.1f}"
    if rival is not None:
        done = walls.get()
        rival.join()
        row += (f"   burst wall ms p50 {done[len(done) // 2] * 1e3:.2f} "
                f"p99 {done[int(len(done) * 0.99)] * 1e3:.2f} max {done[-1] * 1e3:.2f}")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_contention",
                                     description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="each arm's run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--period-ms", type=float, default=5.0)
    parser.add_argument("--burn-ms", type=float, default=0.3)
    args = parser.parse_args(argv)
    burst = (args.period_ms / 1e3, args.burn_ms / 1e3)
    arms: list[tuple[str, tuple[float, float, int] | None]] = [
        ("alone", None),
        (f"beside a burst of {args.burn_ms:g} ms every {args.period_ms:g} ms, nice 0",
         (*burst, 0)),
        (f"beside the same, nice {BACKGROUND_NICE}", (*burst, BACKGROUND_NICE)),
    ]
    for round_index in range(1, args.rounds + 1):
        for name, spec in arms:
            print(f"round {round_index}  {name:55s} {arm(args.seconds, spec)}", flush=True)
    print(f"round {args.rounds}  {'alone':55s} {arm(args.seconds, None)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
