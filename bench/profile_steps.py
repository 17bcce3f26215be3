"""Where the connector's time goes on its median and its slowest steps (not a timed test).

    PYTHONPATH=. .venv/bin/python -m bench.profile_steps --scale issue12 --configs 1 \
        --arms "ours EA"

Runs ``bench.simulate`` with the same arguments, with the connector's
scheduler-side phases wrapped (wall time, inclusive; a phase inside another
is counted in both), and after each simulated step files what each phase
took in that step beside the step's connector time as the simulator measures
it (the scheduler thread's). A phase timed on another thread is filed as
``<phase> (beside)``: the step's pass (``connector.shell.beside``: ``step``,
its ``core``, ``commands``, ``fingerprints``, ``offer`` and ``record``, run
while the model does) and the hand-off's I/O thread (``record I/O``), both
under whichever step they ran beside. Prints, per connector arm (ours and
LMCache's own, so ``--arms "stock eager,ours EA"`` puts the same LMCache
code side by side), for the slowest 1 % of steps and for the 100 steps
around the median, the mean per step of each phase:

* ``build_connector_meta`` (LMCache's, with ``offer`` and ``step`` inside);
* ``offer``: ``offer_chunks`` (fingerprints, ``CandidateOffered``);
* ``step``: ``StepScheduled`` (window read, reserve, the core's step), and
  inside it ``window read`` (every free-queue walk, cascade re-reads too),
  ``reserve``, ``reallocations``, ``allocated ids``, ``narrator``;
* ``core``: every ``offload_fsm.drive`` call (``connector.shell.feeding``: inside ``step``,
  ``finished``, ...);
* ``commands``: executing the core's commands (pins, hash reads, stores);
* ``fingerprints``, ``record`` (the event log's part on the scheduler thread:
  ``connector.handoff.sender.Handoff.record``, numbering and packing each record
  call's events and appending each step's message to the open frame), and
  inside it ``record pack`` (each record call's events to wire form and msgpack),
  ``record service`` (replies and liveness on the scheduler thread: at the
  close, or with no I/O thread) and ``record send`` (a step's message appended
  to the open frame); ``record I/O``: the hand-off's I/O thread's turns
  (frames to ZeroMQ, replies, liveness);
* ``lookup`` (LMCache's, with ``lookup_feedback``: ``ChunksMissing``);
* ``stats`` (``collect``), ``receipts``, ``finished``, ``update_connector_output``;
* LMCache's own parts of ``build_connector_meta``: ``lmc new requests``,
  ``lmc cached requests`` and ``lmc GetStoreMetadata`` (eager only: ours takes
  the lazy store-candidate path, ``candidates new requests`` and ``candidates
  cached requests``, each with ``offer`` inside), ``lmc allocation deltas``
  and ``lmc lookup`` (both arms; inside ours' ``lookup``);
* ``gc``: the cyclic collector's pauses anywhere in the step (``gc.callbacks``;
  ``gc0`` / ``gc1`` / ``gc2`` by generation, ``gc2`` the full collections),
  which land inside whichever phase allocated when a collection came due;
  ``gc in the connector``: those that paused a wrapped connector call (on
  any thread of this process; the event log's fold and writer run in the
  recorder process, whose collections are not here).

The same reports for the slowest 1 % ranked by connector time less its
collections, and over every step the connector's p50 / p99 with and without
them; then the 100 steps around the median of each backlog bucket (buffered
ops at the step's start: 0-99, 100-999, 1000+): the per-step work that
grows with the backlog. Steps of several ``--configs`` are pooled per arm.

Then, per arm, its collections while serving (any thread) by generation:
count, total, median and longest pause; and who came due for them: the
thread (who paid), and the package (module, for ours) of the innermost
Python frame at the allocation that crossed the young generation's
threshold: where allocating happened then, not who made the collection due
(CPython counts GC-tracked allocations less frees, so what brings
collections on is objects kept). So, per arm, what each phase added to that
count (a free is not counted while it is 0, just after a collection),
after each call less before it (calls a collection fell in left out), per
1,000 steps, beside the whole step's.

And the mean over every step, which compares arms whose steps rank differently.

Two comparisons that hold the step fixed:

* ``same step``: each arm against the first connector arm given (put ``stock
  eager`` first) step by step, when both ran the same number of steps (the
  same trace scheduled alike): the median and p99 of the per-step extra, and
  per phase the mean and median of the extra. The ratio of two arms' medians
  mixes steps that rank differently; the median extra does not.
* ``in the serving loop vs a hot fold``: per event type, the mean time of
  ``offload_fsm.machine.step`` as the connector's ``drive`` called it while
  serving (and less the collections that fell in it), beside the same events,
  read back from the run's event log, folded again from a fresh state after
  the run (best of 3, nothing else running between events; arms with the log
  on). Same code, same events, same decisions: the ratio is what the serving
  loop's surroundings (vLLM's and LMCache's work between our calls, the
  model's time) do to the core's own work. Only per-type sums are kept while
  serving: keeping the events would keep tens of thousands of objects alive
  and bring on the very collections measured.
"""

from __future__ import annotations

import functools
import gc
import itertools
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

_PHASES: dict[str, float] = Counter()
_INSIDE = [0]  # depth of wrapped connector calls (a collection there stalls the connector)
# this step's collections: (generation, seconds, thread, allocating package)
_PAUSES: list[tuple[int, float, str, str]] = []
_PACKAGES = (("/offload_fsm/", "core"), ("/connector/handoff", "log"),
             ("/connector/supervisor", "log"), ("/connector/", "connector"),
             ("/lmcache/", "lmcache"), ("/vllm/", "vllm"), ("/bench/", "simulator"))
_BY_MODULE = frozenset(("core", "log", "connector"))  # named down to the module
# The run serving now (arm, number), and per run and event type the core's
# step while serving: (count, seconds, seconds less the collections in them);
# a run's shutdown comes after its last step. Only sums: keeping the events
# would keep tens of thousands of objects alive, and bring on the very
# collections this measures. The hot fold reads them from the run's log.
_RUNS = itertools.count()
_SERVING: list[tuple[str, int]] = [("", -1)]
_ARM_EVENTS: dict[tuple[str, int], dict[str, list[float]]] = {}
_RUN_LOGS: dict[tuple[str, int], tuple[str, str]] = {}  # run -> (its log's directory, prefix)
# each recorder launcher's settings (its log's directory and prefix), by the
# launch function a Handoff holds (``connector.handoff.supervisor.launcher``)
_SPECS: dict[Any, dict[str, Any]] = {}
_UNTIMED_STEP: list[Any] = [None]  # offload_fsm.machine.step itself
_PAUSED_S = [0.0]  # the collections' pauses so far (any thread)
# per arm and phase: the young generation's count moved by the phase's calls
# (allocations less frees of GC-tracked objects) in the calls no collection
# fell in, and those calls; WHOLE_STEP is the simulated step
_NET: dict[str, dict[str, list[int]]] = {}
WHOLE_STEP = "whole simulated step"
_SCHEDULER_THREAD = threading.main_thread().ident  # a phase elsewhere is "(beside)"


def _wrap(owner: Any, name: str, phase: str) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        _INSIDE[0] += 1
        young, paused = gc.get_count()[0], _PAUSED_S[0]
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            on = phase if threading.get_ident() == _SCHEDULER_THREAD else f"{phase} (beside)"
            _PHASES[on] += time.perf_counter() - started
            _INSIDE[0] -= 1
            if _PAUSED_S[0] == paused:
                _net(phase, gc.get_count()[0] - young)

    setattr(owner, name, timed)


def _net(phase: str, moved: int) -> None:
    net = _NET.setdefault(_SERVING[0][0], {}).setdefault(phase, [0, 0])
    net[0] += moved
    net[1] += 1


def _time_collections() -> None:
    """File the cyclic collector's pauses as the ``gc`` (and ``gc2``) phase."""
    started = [0.0]
    due = [""]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            try:
                due[0] = _allocator(sys._getframe(1))
            except ValueError:  # no Python frame under the collection
                due[0] = "other"
            started[0] = time.perf_counter()
            return
        paused = time.perf_counter() - started[0]
        _PAUSED_S[0] += paused
        _PHASES["gc"] += paused
        _PHASES[f"gc{info['generation']}"] += paused
        if _INSIDE[0]:
            _PHASES["gc in the connector"] += paused
        thread = "scheduler" if threading.current_thread() is threading.main_thread() \
            else "other"
        _PAUSES.append((info["generation"], paused, thread, due[0]))

    gc.callbacks.append(callback)


def _allocator(frame: Any) -> str:
    """The package of the innermost frame of ours, LMCache's, vLLM's or the
    simulator's, from ``frame`` outwards ("other" when none is)."""
    while frame is not None:
        name = frame.f_code.co_filename
        for part, package in _PACKAGES:
            if part in name:
                if package in _BY_MODULE:
                    return f"{package}.{name.rsplit('/', 1)[-1].removesuffix('.py')}"
                return package
        frame = frame.f_back
    return "other"


def phases() -> list[tuple[Any, str, str]]:
    """The methods timed as phases: ``(owner, attribute, phase)``. A test
    holds each to the code (a module or method renamed fails there, not in
    the middle of a profile)."""
    from lmcache.integration.vllm import lmcache_mp_connector as stock

    from connector.handoff import sender, supervisor
    from connector.shell import (
        blocks,
        feeding,
        manager,
        metrics,
        pool_commands,
        step_reading,
    )
    from connector.shell.lmcache_connector import EventSourcedLMCacheMPConnector as Connector

    mgr = manager.EventSourcedManager
    return [
        (Connector, "build_connector_meta", "build_connector_meta"),
        (mgr, "offer_chunks", "offer"),
        (mgr, "_step", "step"),
        (blocks, "free_queue_head", "window read"),
        (step_reading.ReserveForecast, "blocks", "reserve"),
        (step_reading, "changed_hashes", "reallocations"),
        (step_reading, "allocated_block_ids", "allocated ids"),
        (manager.Narrator, "end_of_step", "narrator"),
        (feeding, "drive", "core"),
        (pool_commands.PoolCommands, "execute", "commands"),
        (blocks, "hashes_of", "fingerprints"),
        (sender.Handoff, "record", "record"),
        (sender.Handoff, "_pack", "record pack"),
        (sender.Handoff, "_service", "record service"),
        (sender.Handoff, "io_turn", "record I/O"),
        (supervisor.RecorderLink, "send", "record send"),
        (Connector, "get_num_new_matched_tokens", "lookup"),
        (mgr, "on_lookup_result", "lookup_feedback"),
        (metrics.StatsSource, "collect", "stats"),
        (mgr, "on_store_results", "receipts"),
        (mgr, "on_request_finished", "finished"),
        (Connector, "update_connector_output", "update_connector_output"),
        (stock.LMCacheMPConnector, "_process_new_requests", "lmc new requests"),
        (Connector, "_process_new_requests", "candidates new requests"),
        (Connector, "_process_cached_requests", "candidates cached requests"),
        (stock.LMCacheMPConnector, "_process_cached_requests", "lmc cached requests"),
        (stock.LMCacheMPConnector, "_report_block_allocation_deltas", "lmc allocation deltas"),
        (stock.LMCacheMPConnector, "get_num_new_matched_tokens", "lmc lookup"),
    ]


def _install() -> tuple[dict[str, list[tuple[float, dict[str, float], int]]],
                        dict[str, list[tuple[int, float, str, str]]]]:
    from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestMetadata

    from bench.sim import loop
    from connector.shell import lmcache_connector

    for owner, name, phase in phases():
        _wrap(owner, name, phase)
    _wrap_static(LMCacheMPRequestMetadata, "GetStoreMetadata", "lmc GetStoreMetadata")
    launcher = lmcache_connector.launcher

    def keeping(spec: Any) -> Any:  # the run's log: where the recorder writes it
        launch = launcher(spec)
        _SPECS[launch] = dict(spec)
        return launch

    lmcache_connector.launcher = keeping  # what _make_handoff calls
    _time_events()
    _time_collections()
    steps: dict[str, list[tuple[float, dict[str, float], int]]] = {}
    pauses: dict[str, list[tuple[int, float, str, str]]] = {}
    one_step = loop.Sim._one_step

    def filed(self: Any, step: int) -> None:
        if "_profile_run" not in self.__dict__:
            self._profile_run = next(_RUNS)
            spec = _SPECS.get(getattr(getattr(self.view.mgr, "event_log", None), "_launch",
                                      None))
            if spec is not None:  # the log on: its recorder writes it there
                _RUN_LOGS[(self.arm.name, self._profile_run)] = (
                    str(spec["directory"]), str(spec["prefix"]))
        _SERVING[0] = (self.arm.name, self._profile_run)  # the core's events until the next
        _PHASES.clear()
        _PAUSES.clear()
        young, paused = gc.get_count()[0], _PAUSED_S[0]
        one_step(self, step)
        if _PAUSED_S[0] == paused:
            _net(WHOLE_STEP, gc.get_count()[0] - young)
        pauses.setdefault(self.arm.name, []).extend(_PAUSES)
        if self.arm.kind != "none":  # the arms with a connector
            steps.setdefault(self.arm.name, []).append(
                (self.res.conn_ms[-1], dict(_PHASES), self.res.backlog[-1]))

    loop.Sim._one_step = filed  # type: ignore[method-assign]
    return steps, pauses


def _time_events() -> None:
    """Time each event ``offload_fsm.machine.step`` applies for ``drive`` (the
    connector's only caller while serving), summed per run and event type
    for :func:`_report_fold`."""
    from offload_fsm import machine

    original = _UNTIMED_STEP[0] = machine.step

    def timed(state: Any, event: Any) -> Any:
        paused, started = _PAUSED_S[0], time.perf_counter()
        try:
            return original(state, event)
        finally:
            spent = time.perf_counter() - started
            sums = _ARM_EVENTS.setdefault(_SERVING[0], {}).setdefault(
                type(event).__name__, [0, 0.0, 0.0])
            sums[0] += 1
            sums[1] += spent
            sums[2] += spent - (_PAUSED_S[0] - paused)

    machine.step = timed


def _wrap_static(owner: Any, name: str, phase: str) -> None:
    """:func:`_wrap` for a static method (called through the class)."""
    _wrap(owner, name, phase)
    setattr(owner, name, staticmethod(getattr(owner, name)))


def _report(title: str, steps: list[tuple[float, dict[str, float], int]]) -> None:
    if not steps:
        return
    mean: dict[str, float] = Counter()
    for _, phases, _ in steps:
        for phase, seconds in phases.items():
            mean[phase] += seconds * 1e3 / len(steps)
    conn = sum(ms for ms, _, _ in steps) / len(steps)
    print(f"{title}: {len(steps)} steps, connector {conn:.3f} ms a step (mean); by phase:")
    if len(steps) > 1000:  # the whole run: what its collections add to the percentiles
        from bench.sim.results import percentile  # the tables' percentile

        with_gc = [ms for ms, _, _ in steps]
        without = [ms - phases.get("gc in the connector", 0.0) * 1e3 for ms, phases, _ in steps]
        print(f"  connector p50 / p99 ms: {percentile(with_gc, 0.5):.3f} / "
              f"{percentile(with_gc, 0.99):.3f}; less the collections inside it: "
              f"{percentile(without, 0.5):.3f} / {percentile(without, 0.99):.3f}")
    for phase, ms in sorted(mean.items(), key=lambda kv: -kv[1]):
        print(f"  {phase:<24} {ms:8.3f} ms")


def _report_collections(pauses: dict[str, list[tuple[int, float, str, str]]]) -> None:
    """Each arm's collections while it served (on any thread), by generation,
    then by the thread and the package that came due for them."""
    print("\n## the cyclic GC's collections while serving, any thread (ms)")
    print("| arm | generation | collections | total | p50 | max |\n|---|---|---|---|---|---|")
    for arm, taken in pauses.items():
        for generation in (0, 1, 2):
            ms = sorted(seconds * 1e3 for g, seconds, _, _ in taken if g == generation)
            if ms:
                print(f"| {arm} | {generation} | {len(ms)} | {sum(ms):.1f} | "
                      f"{ms[len(ms) // 2]:.2f} | {ms[-1]:.2f} |")
    print("\ncollections (all generations) by who came due: thread / allocating package")
    print("| arm | thread / package: collections, total ms |\n|---|---|")
    for arm, taken in pauses.items():
        by: dict[tuple[str, str], list[float]] = {}
        for _, seconds, thread, package in taken:
            by.setdefault((thread, package), []).append(seconds * 1e3)
        cells = sorted(by.items(), key=lambda kv: -len(kv[1]))
        print(f"| {arm} | " + "; ".join(f"{t} / {p}: {len(ms)}, {sum(ms):.0f}"
                                         for (t, p), ms in cells) + " |")


def _report_net() -> None:
    """Per arm, what each phase left in the young generation (module docstring)."""
    print("\n## what each phase added to the young generation's count (GC-tracked "
          "allocations less frees), per 1,000 steps; calls no collection fell in; phases "
          "inclusive; a free counts where it happens")
    for arm, phases in _NET.items():
        steps = phases.get(WHOLE_STEP, [0, 0])[1]
        if not steps:
            continue
        print(f"### {arm}: {steps} steps")
        for phase, (moved, calls) in sorted(phases.items(), key=lambda kv: -abs(kv[1][0])):
            print(f"  {phase:28s} {moved * 1000 / steps:8.0f}   ({calls} calls)")


def _report_same_step(by_arm: dict[str, list[tuple[float, dict[str, float], int]]]) -> None:
    """Each arm against the first, step by step (module docstring)."""
    from bench.sim.results import percentile

    names = list(by_arm)
    if len(names) < 2:
        return
    base = by_arm[names[0]]
    print(f"\n## the same step: each arm against {names[0]} (ms)")
    for name in names[1:]:
        steps = by_arm[name]
        if len(steps) != len(base):
            print(f"{name}: {len(steps)} steps against {len(base)}, not step for step")
            continue
        extra = [ms - base_ms for (ms, _, _), (base_ms, _, _) in zip(steps, base, strict=True)]
        print(f"### {name}: extra per step p50 {percentile(extra, 0.5):.3f}, p99 "
              f"{percentile(extra, 0.99):.3f}; medians "
              f"{percentile([s[0] for s in base], 0.5):.3f} -> "
              f"{percentile([s[0] for s in steps], 0.5):.3f}")
        phases = sorted({phase for _, ph, _ in steps + base for phase in ph})
        rows = []
        for phase in phases:
            diff = [ph.get(phase, 0.0) * 1e3 - base_ph.get(phase, 0.0) * 1e3
                    for (_, ph, _), (_, base_ph, _) in zip(steps, base, strict=True)]
            rows.append((sum(diff) / len(diff), percentile(diff, 0.5), phase))
        print("  phase                    mean extra  median extra")
        for mean, median, phase in sorted(rows, reverse=True):
            if abs(mean) >= 0.001 or abs(median) >= 0.001:
                print(f"  {phase:<24} {mean:10.3f} {median:13.3f}")


def _report_fold(by_run: dict[tuple[str, int], dict[str, list[float]]]) -> None:
    """Per event type: the core's ``step`` in the serving loop vs the run's
    events (read back from its event log) folded again, hot (module
    docstring); an arm's runs (rounds, configs) are folded each from a fresh
    state and summed. Arms without a log (log off) are left out."""
    from bench.bench_fold import read_events
    from offload_fsm.state import new_state
    from replay.runner import config_of

    step = _UNTIMED_STEP[0]
    by_arm: dict[str, list[tuple[str, int]]] = {}
    for run in by_run:
        if run in _RUN_LOGS:
            by_arm.setdefault(run[0], []).append(run)
    for arm, runs in by_arm.items():
        best: dict[str, float] = Counter()
        serving: dict[str, float] = Counter()
        calm: dict[str, float] = Counter()
        counts: Counter[str] = Counter()
        for run in runs:
            header, events = read_events(*_RUN_LOGS[run])
            sums = by_run[run]
            if header is None or len(events) != sum(int(n) for n, _, _ in sums.values()):
                print(f"{arm}: its log does not hold every event it applied; not compared")
                continue
            fastest: dict[str, float] | None = None
            for _ in range(3):
                state = new_state(config_of(header), world_size=header.world_size)
                spent: dict[str, float] = Counter()
                for event in events:
                    started = time.perf_counter()
                    step(state, event)
                    spent[type(event).__name__] += time.perf_counter() - started
                if fastest is None or sum(spent.values()) < sum(fastest.values()):
                    fastest = spent
            assert fastest is not None
            for name, seconds in fastest.items():
                best[name] += seconds
            for name, (n, seconds, without) in sums.items():
                counts[name] += int(n)
                serving[name] += seconds
                calm[name] += without
        if not counts:
            continue
        print(f"\n## {arm}: the core's step in the serving loop vs a hot fold of the same "
              f"events ({len(runs)} run(s); us each; fold best of 3)")
        print("| event | count | serving | less collections | hot fold | ratio (less "
              "collections) |\n|---|---|---|---|---|---|")
        for name in sorted(serving, key=lambda n: -serving[n]):
            hot, n = best.get(name, 0.0), counts[name]
            ratio = f"{serving[name] / hot:.1f} ({calm[name] / hot:.1f})" if hot else "-"
            print(f"| {name} | {n} | {serving[name] / n * 1e6:.1f} | "
                  f"{calm[name] / n * 1e6:.1f} | {hot / n * 1e6:.1f} | {ratio} |")
        total, total_calm, total_hot = (sum(serving.values()), sum(calm.values()),
                                        sum(best.values()))
        print(f"| all (ms) | {sum(counts.values())} | {total * 1e3:.1f} | "
              f"{total_calm * 1e3:.1f} | {total_hot * 1e3:.1f} | {total / total_hot:.1f} "
              f"({total_calm / total_hot:.1f}) |")


def main() -> int:
    from bench import simulate

    by_arm, pauses = _install()
    status = simulate.main(sys.argv[1:])
    _report_collections(pauses)
    _report_net()
    print("\n## where the connector's time goes (bench.profile_steps; phases inclusive)")
    for arm, steps in by_arm.items():
        print(f"### {arm}")
        ranked = sorted(steps, key=lambda s: -s[0])
        _report("slowest 1 %", ranked[: max(1, len(ranked) // 100)])
        calm = sorted(steps, key=lambda s: -(s[0] - s[1].get("gc in the connector", 0.0) * 1e3))
        _report("slowest 1 % less the collections inside the connector",
                calm[: max(1, len(calm) // 100)])
        middle = len(ranked) // 2
        _report("100 steps around the median", ranked[max(0, middle - 50) : middle + 50])
        _report("every step", ranked)
        for low, high in ((0, 99), (100, 999), (1000, None)):
            bucket = [s for s in ranked if s[2] >= low and (high is None or s[2] <= high)]
            middle = len(bucket) // 2
            _report(f"backlog {low}-{high or ''}: 100 steps around its median",
                    bucket[max(0, middle - 50) : middle + 50])
    _report_same_step(by_arm)
    _report_fold(_ARM_EVENTS)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
