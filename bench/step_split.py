"""Where the step's time goes outside the connector: vLLM's own scheduler calls,
arm against arm (not a timed test).

    PYTHONPATH=. .venv/bin/python -m bench.step_split --scale issue12 --configs 0 \
        --arms "stock eager,ours EA" --model-ms 3

Runs ``bench.simulate`` with the same arguments and vLLM's scheduler-side calls
wrapped (wall time less the simulator's instrumentation inside it, as the
step's timers take it; inclusive: a call inside another counts in both):
``Scheduler.schedule`` and ``update_from_output`` and the calls inside them
that touch requests and blocks (:data:`CALLS`). After each simulated step it
files the step's time (``schedule`` + ``update_from_output`` less the
instrumentation, as the simulator's tables take it), its connector time and
each call's. Prints per arm, for the 100 steps around its median step: the
step, the connector's share, the rest, and each call's mean; then each arm's
extra over the first arm given (put ``stock eager`` first). And, where an
arm ran the same number of steps as the first (the same trace scheduled
alike), the same step's extra, step for step, by the arm's backlog at the
step's start (buffered ops: 0-99, 100-999, 1000+): whether what the rest
costs grows with what the connector holds.

What it answers: ``bench.profile_steps`` says where the connector's own time
goes; a step also pays for what the connector changes around it (vLLM's
frees when the connector does not delay them, allocation from a pool whose
free blocks the connector pins, the caches and the heap the connector's work
leaves).
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections import Counter
from typing import Any

CALLS = {
    "Scheduler": ("schedule", "update_from_output", "_update_after_schedule",
                  "_update_request_with_output", "_free_request", "_connector_finished",
                  "_free_blocks", "_update_from_kv_xfer_finished"),
    "KVCacheManager": ("allocate_slots", "get_computed_blocks", "free", "get_block_ids"),
    "BlockPool": ("get_new_blocks", "free_blocks", "touch", "cache_full_blocks",
                  "get_num_free_blocks"),
}
"""The calls timed, by class: what a scheduler step runs that the connector can change."""

_SPENT: dict[str, float] = Counter()
_CLOCKS: list[Any] = [None]  # the serving arm's ``bench.sim.hooks.Clocks``
Step = tuple[float, float, dict[str, float], int]  # step ms, connector ms, calls, backlog


def _owners() -> dict[str, Any]:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    return {"Scheduler": Scheduler, "KVCacheManager": KVCacheManager, "BlockPool": BlockPool}


def _wrap(owner: Any, name: str) -> None:
    original = getattr(owner, name)
    label = f"{owner.__name__}.{name}"

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        clocks = _CLOCKS[0]
        instrumented = clocks.instr_s if clocks is not None else 0.0
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent = time.perf_counter() - started
            if clocks is not None:  # the loss attribution's hooks inside (pool evictions)
                spent -= clocks.instr_s - instrumented
            _SPENT[label] += spent

    setattr(owner, name, timed)


def install() -> dict[str, list[Step]]:
    """Wrap :data:`CALLS` and the simulator's step; returns, per arm, each
    step's ``(step ms, connector ms, {call: seconds}, backlog at its start)``."""
    from bench.sim import loop

    for class_name, owner in _owners().items():
        for name in CALLS[class_name]:
            _wrap(owner, name)
    steps: dict[str, list[Step]] = {}
    one_step = loop.Sim._one_step

    def filed(self: Any, step: int) -> None:
        _SPENT.clear()
        _CLOCKS[0] = self.clocks
        one_step(self, step)
        steps.setdefault(self.arm.name, []).append(
            (self.res.sched_ms[-1], self.res.conn_ms[-1], dict(_SPENT), self.res.backlog[-1]))

    loop.Sim._one_step = filed  # type: ignore[method-assign]
    return steps


def around_median(steps: list[Step]) -> dict[str, float]:
    """The mean over the 100 steps around the median step: ``step``,
    ``connector``, ``rest`` and each call, in ms."""
    ranked = sorted(steps, key=lambda s: s[0])
    middle = len(ranked) // 2
    chosen = ranked[max(0, middle - 50) : middle + 50]
    mean: dict[str, float] = Counter()
    for _, _, spent, _ in chosen:
        for label, seconds in spent.items():
            mean[label] += seconds * 1e3 / len(chosen)
    step = statistics.fmean(s[0] for s in chosen)
    connector = statistics.fmean(s[1] for s in chosen)
    return {"step": step, "connector": connector, "rest": step - connector, **mean}


def report(by_arm: dict[str, list[Step]]) -> None:
    means = {arm: around_median(steps) for arm, steps in by_arm.items() if steps}
    if not means:
        return
    arms = list(means)
    base = means[arms[0]]
    print("\n## where the step goes, 100 steps around each arm's median step (ms, mean; "
          "calls inclusive)")
    print("| part | " + " | ".join(arms) + "".join(f" | {arm} - {arms[0]}" for arm in arms[1:])
          + " |")
    print("|---" * (2 * len(arms)) + "|")
    labels = sorted({label for mean in means.values() for label in mean},
                    key=lambda label: (label not in ("step", "connector", "rest"),
                                       -base.get(label, 0.0)))
    for label in labels:
        cells = [f"{means[arm].get(label, 0.0):.3f}" for arm in arms]
        extra = [f"{means[arm].get(label, 0.0) - base.get(label, 0.0):+.3f}" for arm in arms[1:]]
        print(f"| {label} | " + " | ".join(cells + extra) + " |")
    for arm in arms[1:]:
        by_backlog(arm, by_arm[arm], arms[0], by_arm[arms[0]])


def by_backlog(arm: str, steps: list[Step], base_arm: str, base: list[Step]) -> None:
    """The same step's extra over ``base``, by ``arm``'s backlog (module docstring)."""
    from bench.sim.results import percentile

    if len(steps) != len(base):
        print(f"\n{arm}: {len(steps)} steps against {len(base)}: not step for step")
        return
    print(f"\n## {arm} against {base_arm}, the same step, by {arm}'s backlog (ms, median "
          "extra)\n| backlog | steps | step | connector | the rest |\n|---|---|---|---|---|")
    for low, high in ((0, 99), (100, 999), (1000, None)):
        pairs = [(s, b) for s, b in zip(steps, base, strict=True)
                 if s[3] >= low and (high is None or s[3] <= high)]
        if not pairs:
            continue
        step = percentile([s[0] - b[0] for s, b in pairs], 0.5)
        connector = percentile([s[1] - b[1] for s, b in pairs], 0.5)
        rest = percentile([(s[0] - s[1]) - (b[0] - b[1]) for s, b in pairs], 0.5)
        print(f"| {low}-{high or ''} | {len(pairs)} | {step:+.3f} | {connector:+.3f} | "
              f"{rest:+.3f} |")


def main() -> int:
    from bench import simulate

    by_arm = install()
    status = simulate.main(sys.argv[1:])
    report(by_arm)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
