"""``connector.shell.metrics`` without a server: the stats class keeps LMCache's lookup
field and merges ours; the stats source sends deltas and changed gauges only;
the Prometheus class exports every core counter, keeps LMCache's histogram, and
the ledger closes from its samples alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from testkit.env import require_stack

require_stack()

from lmcache.integration.vllm.lmcache_mp_metrics import LMCacheMPConnectorStats  # noqa: E402
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from connector.shell import metrics  # noqa: E402
from connector.shell.lmcache_connector import EventSourcedLMCacheMPConnector  # noqa: E402
from offload_fsm import Policy  # noqa: E402
from offload_fsm.invariants import ledger_terms  # noqa: E402
from offload_fsm.machine import step  # noqa: E402
from offload_fsm.state import new_state  # noqa: E402
from offload_fsm.vocabulary.counters import Counter as CoreCounter  # noqa: E402
from offload_fsm.vocabulary.decisions import SelectReason  # noqa: E402
from tests.connector.test_manager_faults import Shell  # noqa: E402
from tests.offload_fsm.helpers import random_world_run  # noqa: E402


def test_every_core_counter_is_exported() -> None:
    exported = {c for family in metrics.COUNTER_FAMILIES for c in family.members.values()}
    assert exported == set(CoreCounter)
    names = [family.name for family in metrics.COUNTER_FAMILIES]
    assert len(names) == len(set(names))
    assert all(n.startswith("vllm:lazy_offload_") and not n.endswith("_total") for n in names)


def test_stats_class_keeps_lookup_and_merges_ours() -> None:
    a = metrics.LazyOffloadConnectorStats()
    assert a.is_empty()
    a.record_lookup(0.5)
    assert not a.is_empty()
    a.counters["stored_ops"] = 2
    a.gauges["buffered_ops"] = 7
    b = metrics.LazyOffloadConnectorStats(data={
        "lookup_duration_seconds": [0.25],
        metrics.COUNTERS_KEY: {"stored_ops": 3, "admitted_ops": 1},
        metrics.GAUGES_KEY: {"buffered_ops": 4},
    })
    a.aggregate(b)
    assert a.data["lookup_duration_seconds"] == [0.5, 0.25]
    assert a.counters == {"stored_ops": 5, "admitted_ops": 1}
    assert a.gauges == {"buffered_ops": 4}  # the later value wins
    a.aggregate(LMCacheMPConnectorStats(data={"lookup_duration_seconds": [1.0]}))
    assert len(a.data["lookup_duration_seconds"]) == 3
    reduced = a.reduce()
    assert reduced["LMCache MP lookup count"] == 3
    assert reduced["stored ops"] == 5 and reduced["buffered ops"] == 4
    clone = a.clone_and_reset()
    assert a.is_empty() and clone.counters["stored_ops"] == 5
    with pytest.raises(TypeError):
        a.aggregate(object())  # type: ignore[arg-type]
    only_gauge = metrics.LazyOffloadConnectorStats(data={metrics.GAUGES_KEY: {"draining": 0}})
    assert not only_gauge.is_empty()
    built = EventSourcedLMCacheMPConnector.build_kv_connector_stats(clone.data)
    assert isinstance(built, metrics.LazyOffloadConnectorStats)
    assert built.counters == clone.counters


def test_source_sends_deltas_then_nothing() -> None:
    s = Shell()
    source = metrics.StatsSource(s.mgr)
    first = metrics.get_stats(source, None)
    assert first is not None and first.counters == {}  # gauges at their first values
    assert metrics.get_stats(source, None) is None  # nothing moved
    s.offer("a")
    s.offer("b")
    s.step()  # a step's offers apply where the step is read
    stats = metrics.get_stats(source, None)
    assert stats is not None
    assert stats.counters["admitted_ops"] == 2
    assert stats.gauges["buffered_ops"] == 2
    s.finish("a")
    s.step()  # FIFO threshold 1: "a" is selected and submitted
    stats = metrics.get_stats(source, None)
    assert stats is not None
    assert stats.counters["submitted_ops"] == 1 and "admitted_ops" not in stats.counters
    assert stats.gauges["in_flight_batches"] == 1 and stats.gauges["buffered_ops"] == 1
    assert stats.gauges["pinned_blocks"] == 2
    s.receipts({"a": 1})
    stats = metrics.get_stats(source, None)
    assert stats is not None and stats.counters["stored_ops"] == 1
    assert stats.gauges["in_flight_batches"] == 0 and stats.gauges["pinned_blocks"] == 0


def test_a_call_after_no_event_reads_nothing_and_the_next_event_brings_all() -> None:
    """vLLM asks every step; a passed step applies no event, so the source
    answers at once. What moved meanwhile is sent with the next event's call."""
    s = Shell(policy=Policy.EVICTION_AWARE, horizon_steps=2.0)
    source = metrics.StatsSource(s.mgr)
    s.offer("a")
    s.step()  # applies the offer; nothing near the eviction head: the step passes
    source.collect()
    before = s.mgr.events_applied
    s.step()  # passes too
    assert s.mgr.events_applied == before and len(s.mgr._reader.passed) == 2
    s.mgr.state.counters[CoreCounter.EMPTY_STEPS] += 5  # not read: no event applied
    assert source.collect() == ({}, {})
    s.offer("b")
    s.step()  # reports the passed step, then the offer; this step passes too
    counters, gauges = source.collect()
    assert counters["admitted_ops"] == 1 and counters["token_steps"] == 2
    assert counters["empty_steps"] == 5 and gauges["buffered_ops"] == 2


def test_oldest_buffered_age_counts_steps() -> None:
    s = Shell(threshold=100)
    source = metrics.StatsSource(s.mgr)
    s.offer("a")
    s.step()  # applies the offer: its age counts from the stats call after it
    source.collect()
    for _ in range(3):
        s.step()
        source.collect()
    assert source.gauges(s.mgr.state)["oldest_buffered_op_age_steps"] == 3
    s.offer("b")  # younger: the oldest stays "a"
    assert source.gauges(s.mgr.state)["oldest_buffered_op_age_steps"] == 3
    s.step()
    assert source.gauges(s.mgr.state)["oldest_buffered_op_age_steps"] == 4


def test_draining_gauge() -> None:
    s = Shell()
    source = metrics.StatsSource(s.mgr)
    s.offer("a")
    s.finish("a")
    s.step()
    s.mgr.on_request_finished("a")  # finished twice: rejected, drain-only mode
    assert s.mgr.draining
    gauges = source.gauges(s.mgr.state)
    assert gauges["draining"] == 1
    assert gauges["in_flight_batches"] == 1 and gauges["pinned_blocks"] == 2


class _Config:
    kv_transfer_config = None


def _prom(primary: SelectReason = SelectReason.FIFO) -> tuple[Any, CollectorRegistry]:
    registry = CollectorRegistry()

    def bound(kind: Any) -> Any:
        class Bound(kind):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, multiprocess_mode: str = "", **kw: Any) -> None:
                super().__init__(*args, registry=registry, **kw)
        return Bound

    types = {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}
    prom = metrics.LazyOffloadPromMetrics(_Config(), types, ["model_name", "engine"],
                                          {0: ["m", "0"]}, primary_reason=primary)
    return prom, registry


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})
    assert value is not None, (name, labels)
    return value


def test_prom_metrics_and_ledger_from_samples() -> None:
    prom, registry = _prom()
    s = Shell()
    source = metrics.StatsSource(s.mgr)
    s.offer("a")
    s.offer("b")
    s.finish("a")
    s.step()
    s.receipts({"a": 1})
    s.mgr.reset_prefix_cache()  # "b" is dropped: cache_reset
    for _ in range(2):
        stats = metrics.get_stats(source, metrics.LazyOffloadConnectorStats(
            data={"lookup_duration_seconds": [0.001]}))
        if stats is not None:
            prom.observe(stats.data, 0)
    assert _sample(registry, "vllm:lmcache_mp_lookup_duration_seconds_count") == 2
    assert _sample(registry, "vllm:lazy_offload_admitted_ops_total") == 2
    assert _sample(registry, "vllm:lazy_offload_stored_ops_total") == 1
    assert _sample(registry, "vllm:lazy_offload_selected_ops_total", reason="fifo") == 1
    assert _sample(registry, "vllm:lazy_offload_selected_ops_total", reason="overdue") == 0
    assert _sample(registry, "vllm:lazy_offload_dropped_ops_total", cause="cache_reset") == 1
    assert _sample(registry, "vllm:lazy_offload_draining") == 0
    dropped = sum(_sample(registry, "vllm:lazy_offload_dropped_ops_total", cause=c)
                  for c in ("evicted", "preempted", "id_reuse", "store_failed", "stale",
                            "cache_reset", "shutdown", "duplicate"))
    right = sum(_sample(registry, f"vllm:lazy_offload_{name}") for name in
                ("buffered_ops", "verifying_ops", "in_flight_ops")) + sum(
        _sample(registry, f"vllm:lazy_offload_{name}_total") for name in
        ("stored_ops", "failed_ops", "abandoned_ops")) + dropped
    assert _sample(registry, "vllm:lazy_offload_admitted_ops_total") == right


@pytest.mark.parametrize("policy", [Policy.EVICTION_AWARE, Policy.FIFO])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_ops_pass_is_skipped_only_when_it_would_give_the_same_gauges(
    policy: Policy, seed: int
) -> None:
    """Over a seeded random run of the fake world (arrivals, steps, finishes,
    preemptions, receipts, failures, cache resets), after every event: the gauges
    (the pass over the ops taken only when a MOVES counter moved) equal a fresh pass."""
    world = random_world_run(policy, seed, 1500)
    events = [event for event, _ in world.applied]
    state = new_state(world.state.config, world_size=world.state.world_size)
    source = metrics.StatsSource(SimpleNamespace(state=state, draining=False))
    walks = 0
    for event in events:
        step(state, event)
        before = source._walked_at
        gauges = source.gauges(state)
        walks += source._walked_at != before
        assert {k: gauges[k] for k in source._walked} == source.walk(state, False), event
        for unit in ("ops", "tokens"):  # the core's tallies against a pass over the ops
            terms = ledger_terms(state, unit)
            assert (gauges[f"buffered_{unit}"], gauges[f"verifying_{unit}"],
                    gauges[f"in_flight_{unit}"]) == (
                terms["pending"], terms["verifying"], terms["in_flight"]), event
    assert walks < len(events) // 2  # most events leave the ops as they were


@pytest.mark.parametrize("seed", [4, 5])
def test_what_collect_sends_adds_up_to_the_counters_and_the_gauges(seed: int) -> None:
    """The per-step path (``collect``: counters compared in C, gauges sent
    only when changed): summing every delta and keeping every last gauge sent
    gives the core's counters and a fresh reading of every gauge, after every
    event of a seeded random run, and a call after nothing moved sends nothing."""
    world = random_world_run(Policy.EVICTION_AWARE, seed, 1500)
    state = new_state(world.state.config, world_size=world.state.world_size)
    source = metrics.StatsSource(SimpleNamespace(state=state, draining=False))
    fresh = metrics.StatsSource(SimpleNamespace(state=state, draining=False))
    summed: dict[str, int] = {}
    sent: dict[str, int] = {}
    for event, _ in world.applied:
        step(state, event)
        deltas, changed = source.collect()
        for name, delta in deltas.items():
            assert delta != 0, name
            summed[name] = summed.get(name, 0) + delta
        sent.update(changed)
        assert summed == {c.value: v for c, v in state.counters.items() if v}, event
        assert sent == fresh.gauges(state), event
        assert source.collect() == ({}, {})  # nothing moved since
