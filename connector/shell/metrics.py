"""Lazy-offload metrics through vLLM's own connector-stats path.

The path (vLLM 0.32): every scheduler step, ``Scheduler.update_from_output``
asks the connector for :meth:`get_kv_connector_stats` and merges it with the
workers' stats (``aggregate``); the plain ``data`` dict crosses to the front
end, where ``KVConnectorProm`` feeds it to the object returned by the
connector class's ``build_prom_metrics`` (``observe``) and ``KVConnectorLogging``
folds the payloads of one logging interval (``build_kv_connector_stats``,
``aggregate``, ``reduce``) into the "KV Transfer metrics" log line.

Primitives:

* :class:`LazyOffloadConnectorStats`: LMCache's ``LMCacheMPConnectorStats``
  (its lookup latencies kept as they are) plus two dicts: counter deltas by
  :class:`offload_fsm.vocabulary.counters.Counter` name, and gauges (latest value wins).
* :class:`StatsSource`: scheduler side, one per connector: what changed since
  the last call, read from the manager (the core's state, read only); ``None``
  when nothing did, so an idle engine sends nothing.
* :class:`LazyOffloadPromMetrics`: the Prometheus families (``vllm:lazy_offload_*``)
  next to LMCache's ``vllm:lmcache_mp_lookup_duration_seconds``.
* :data:`COUNTER_FAMILIES`, :data:`GAUGES`: the metric table (every counter of
  the core is exported; a test checks the table covers them all).

Cheap to import in the front-end process: no torch here (the LMCache module
below imports vLLM's config and ``prometheus_client`` only).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import compress
from operator import ne
from typing import Any, Final

from lmcache.integration.vllm.lmcache_mp_metrics import (
    LMCacheMPConnectorStats,
    LMCacheMPPromMetrics,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from offload_fsm.state import BatchStatus, OpStatus
from offload_fsm.vocabulary.counters import (
    DROPPED_OPS,
    DROPPED_TOKENS,
    HELD,
    REJECTED,
    SELECTED_BY,
    Counter,
)
from offload_fsm.vocabulary.decisions import SelectReason

COUNTERS_KEY: Final = "lazy_offload_counters"
GAUGES_KEY: Final = "lazy_offload_gauges"
_LOOKUP: Final = "lookup_duration_seconds"  # LMCache's own key
METRIC_PREFIX: Final = "vllm:lazy_offload_"


@dataclass(frozen=True)
class CounterFamily:
    """One Prometheus counter (exposed as ``<name>_total``), optionally with
    one label whose values each come from one core counter."""

    name: str
    documentation: str
    label: str | None
    members: dict[str, Counter]  # label value ("" when no label) -> core counter


def _one(name: str, counter: Counter, documentation: str) -> CounterFamily:
    return CounterFamily(METRIC_PREFIX + name, documentation, None, {"": counter})


def _by(name: str, label: str, members: dict[Any, Counter], documentation: str
        ) -> CounterFamily:
    return CounterFamily(METRIC_PREFIX + name, documentation, label,
                         {key.value: counter for key, counter in members.items()})


C = Counter
COUNTER_FAMILIES: tuple[CounterFamily, ...] = (
    _one("admitted_ops", C.ADMITTED_OPS, "Store ops admitted to the lazy buffer (the ledger's "
         "left side)."),
    _one("admitted_tokens", C.ADMITTED_TOKENS, "Tokens of the admitted store ops."),
    _by("rejected_ops", "reason", REJECTED, "Offered store ops never admitted, by reason "
        "(unhashed, prefix_broken, already_stored)."),
    _by("dropped_ops", "cause", DROPPED_OPS, "Admitted store ops that left the buffer "
        "without being stored, by cause (duplicate is not a loss)."),
    _by("dropped_tokens", "cause", DROPPED_TOKENS, "Tokens of the dropped store ops, by cause."),
    # Selections: every selected op once, by why (see LazyOffloadPromMetrics.observe).
    CounterFamily(METRIC_PREFIX + "selected_ops", "Store ops selected for a store, by reason "
                  "(window or fifo: the policy's own rule; overdue, cascade, shielded; "
                  "idle_flush, shutdown_flush: the tail flush).",
                  "reason", {"": C.SELECTED_OPS,
                             **{r.value: c for r, c in SELECTED_BY.items()}}),
    _by("holds", "reason", HELD, "Times a due request was held back for a step, by reason "
        "(drain_cap, pin_budget, in_flight)."),
    _one("shielded_at_finish_ops", C.SHIELDED_OPS, "Store ops protected at finish to close "
         "the blind window (EVICTION_AWARE)."),
    _one("shielded_at_lookup_ops", C.LOOKUP_SHIELDED_OPS, "Store ops protected at another "
         "request's lookup, before the allocation that follows it could reach their blocks "
         "(EVICTION_AWARE)."),
    _one("split_ops", C.SPLIT_OPS, "Buffered store ops cut at a chunk boundary because only "
         "their front fit the pin headroom or the shield's (EVICTION_AWARE); each rest is "
         "admitted as a new op."),
    _one("split_tokens", C.SPLIT_TOKENS, "Tokens left behind a cut, buffered as the rest."),
    _one("submitted_ops", C.SUBMITTED_OPS, "Store ops submitted to LMCache after verification."),
    _one("submitted_tokens", C.SUBMITTED_TOKENS, "Tokens of the submitted store ops."),
    _one("stored_ops", C.STORED_OPS, "Store ops every worker reported stored."),
    _one("stored_tokens", C.STORED_TOKENS, "Tokens of the stored store ops."),
    _one("failed_ops", C.FAILED_OPS, "Store ops a worker reported failed."),
    _one("failed_tokens", C.FAILED_TOKENS, "Tokens of the failed store ops."),
    _one("abandoned_ops", C.ABANDONED_OPS, "Store ops abandoned in flight (receipt lease "
         "expired, or in flight at shutdown)."),
    _one("abandoned_tokens", C.ABANDONED_TOKENS, "Tokens of the abandoned store ops."),
    _one("abandoned_batches", C.ABANDONED_BATCHES, "Store batches abandoned because their "
         "receipts did not arrive within lmcache.mp.lazy_offload_receipt_lease_s."),
    _one("receipts_ignored", C.RECEIPTS_IGNORED, "Worker receipts ignored (unknown request, "
         "excess count, late after a lease)."),
    _one("protected_blocks", C.PROTECTED_BLOCKS, "GPU block protections taken (BlockPool.touch)."),
    _one("released_blocks", C.RELEASED_BLOCKS, "GPU block protections released."),
    _one("token_steps", C.TOKEN_STEPS, "Scheduler steps that scheduled tokens."),
    _one("empty_steps", C.EMPTY_STEPS, "Scheduler steps that scheduled no token."),
    _one("window_blocks_read", C.WINDOW_BLOCKS_READ, "Free-queue blocks read for the danger "
         "window (EVICTION_AWARE)."),
    _one("blocks_checked", C.BLOCKS_CHECKED, "Block hashes re-read at verification."),
    _one("idle_flushes", C.IDLE_FLUSHES, "Empty steps on which the idle tail flush selected "
         "(lmcache.mp.lazy_offload_idle_flush_steps)."),
    _one("idle_flush_tokens", C.IDLE_FLUSH_TOKENS, "Tokens of the store ops the idle tail "
         "flush selected (its extra writes)."),
    _one("shutdown_flush_tokens", C.SHUTDOWN_FLUSH_TOKENS, "Tokens of the store ops selected "
         "after vLLM began shutting down (lmcache.mp.lazy_offload_shutdown_flush_s)."),
    _one("shutdown_left_ops", C.SHUTDOWN_LEFT_OPS, "Store ops buffered or in flight when the "
         "connector shut down, with a tail flush on (never reached LMCache)."),
    _one("shutdown_left_tokens", C.SHUTDOWN_LEFT_TOKENS, "Tokens of the store ops left at "
         "shutdown."),
    _one("shutdown_left_requests", C.SHUTDOWN_LEFT_REQUESTS, "Requests with store ops left at "
         "shutdown."),
)
# A counter the core grows later is exported under its own name until it earns an entry
# above (HELD[...] ones join the holds family automatically through the table).
COUNTER_FAMILIES += tuple(
    _one(counter.value, counter, f"Core counter {counter.value} (offload_fsm.vocabulary.counters).")
    for counter in Counter
    if all(counter not in family.members.values() for family in COUNTER_FAMILIES)
)

GAUGES: Final[dict[str, str]] = {
    "buffered_ops": "Store ops buffered now (the ledger's pending term).",
    "buffered_tokens": "Tokens of the buffered store ops.",
    "verifying_ops": "Store ops selected whose hashes are being re-read now.",
    "verifying_tokens": "Tokens of the verifying store ops.",
    "in_flight_ops": "Store ops submitted to LMCache and awaiting receipts now.",
    "in_flight_tokens": "Tokens of the in-flight store ops.",
    "in_flight_batches": "Store batches submitted and awaiting receipts now.",
    "pinned_blocks": "GPU blocks lazy offload holds a protection on now.",
    "shielded_ops": "Buffered store ops protected now (shielded at finish).",
    "oldest_buffered_op_age_steps": "Token steps since the longest-buffered request's buffer "
                                    "became non-empty (bounds the oldest buffered op's age).",
    "log_items_lost": "Event-log items the recorder's writer dropped (queue overflow, "
                      "encode or I/O failure); each loss is a GAP record in the log.",
    "log_handoff_events_lost": "Events the engine numbered that never reached the recorder "
                               "process (it was dead, stalled or behind its byte budget); "
                               "the log records them as a GAP when recording resumes.",
    "log_handoff_bytes_in_flight": "Bytes handed to the recorder process and not yet "
                                   "taken in, with their bookkeeping (bounded by "
                                   "lazy_offload_log_budget_mib).",
    "log_recorder_restarts": "Times the recorder process was started again after it died.",
    "log_recorder_up": "1 once the recorder process took its start in (it writes this run's "
                       "log) while the log is in step with the engine, else 0.",
    "log_pub_bind_failed": "1 when the live stream's endpoint could not be bound.",
    "draining": "1 when lazy offload stopped after a failure and only drains what LMCache "
                "holds (drain-only mode), else 0.",
}


class LazyOffloadConnectorStats(LMCacheMPConnectorStats):  # type: ignore[misc]
    """LMCache's lookup stats plus lazy-offload counter deltas and gauges.

    ``data``: LMCache's ``lookup_duration_seconds`` list; ``lazy_offload_counters``
    (counter name -> increase over the interval; summed by :meth:`aggregate`);
    ``lazy_offload_gauges`` (gauge name -> value; the later payload wins).
    Plain dicts of str and int, so the payload crosses processes as is.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        self.data.setdefault(COUNTERS_KEY, {})
        self.data.setdefault(GAUGES_KEY, {})

    @property
    def counters(self) -> dict[str, int]:
        return self.data[COUNTERS_KEY]  # type: ignore[no-any-return]

    @property
    def gauges(self) -> dict[str, int]:
        return self.data[GAUGES_KEY]  # type: ignore[no-any-return]

    def reset(self) -> None:
        super().reset()
        self.data[COUNTERS_KEY] = {}
        self.data[GAUGES_KEY] = {}

    def clone_and_reset(self) -> LazyOffloadConnectorStats:
        snapshot = LazyOffloadConnectorStats(data={
            _LOOKUP: self.data[_LOOKUP], COUNTERS_KEY: self.counters, GAUGES_KEY: self.gauges,
        })
        self.reset()
        return snapshot

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Merge ``other`` (LMCache's own stats class is accepted too: a worker
        built by a stock connector carries only lookups)."""
        if not isinstance(other, LMCacheMPConnectorStats):
            raise TypeError(f"Cannot aggregate {type(other)}")
        self.data[_LOOKUP].extend(other.data.get(_LOOKUP, ()))
        counters = self.counters
        for name, delta in other.data.get(COUNTERS_KEY, {}).items():
            counters[name] = counters.get(name, 0) + delta
        self.gauges.update(other.data.get(GAUGES_KEY, {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(super().reduce())
        counters, gauges = self.counters, self.gauges
        if counters or gauges:
            dropped = sum(counters.get(c.value, 0) for c in DROPPED_OPS.values())
            out.update({
                "Lazy offload admitted ops": counters.get(Counter.ADMITTED_OPS.value, 0),
                "stored ops": counters.get(Counter.STORED_OPS.value, 0),
                "dropped ops": dropped,
                "failed ops": counters.get(Counter.FAILED_OPS.value, 0),
            })
            for name in ("buffered_ops", "pinned_blocks", "draining"):
                if name in gauges:
                    out[name.replace("_", " ")] = gauges[name]
        return out

    def is_empty(self) -> bool:
        return super().is_empty() and not self.counters and not self.gauges


MOVES: Final = tuple(c for c in Counter if c.value.endswith("_ops")) + (
    Counter.PROTECTED_BLOCKS, Counter.RELEASED_BLOCKS)
"""Counters of which one moves whenever an op changes state or a pin is taken or released."""
_MOVES_SET: Final = frozenset(MOVES)


class StatsSource:
    """Scheduler side: counter deltas and changed gauges since the last call.

    Reads only: the core's ``state`` (counters, buffers, batches, pins) and
    the manager's ``draining``; in drain-only mode the shell's own pin ledger
    and in-flight stores. vLLM asks every scheduler step; a call after no
    event was applied (the manager's ``events_applied``, as on a passed
    step) returns at once with nothing. Otherwise, per call: the
    counters compared with the last call's in C (a few microseconds for the
    few dozen) and a delta for each that moved; the gauges of the ops
    (buffered, verifying, in flight, in ops and tokens) are the core's live
    tallies (``State.live_ops``/``live_tokens``, O(1)); the in-flight batches
    and the shielded requests' pinned ops (bounded by the pins) are counted
    only when a counter that moves with an op or a pin (:data:`MOVES`: every
    ``*_ops`` counter, protected and released blocks) changed since the last
    count, or the state object changed, or in drain-only mode; the oldest-op
    age is O(1) amortized (:meth:`_oldest_age`).
    """

    def __init__(self, manager: Any, handoff: Any = None) -> None:
        """``handoff``: the event log's ``connector.handoff.sender.Handoff`` (its
        gauges), or None with the log off."""
        self._manager = manager
        self._handoff = handoff
        self._counters: dict[Counter, int] | None = None  # the dict the keys below are of
        self._keys: tuple[str, ...] = ()  # its counters' names, in its order
        self._indexes: range = range(0)
        self._last_values: list[int] = []  # their values at the last collect
        self._moves_mask: list[bool] = []  # which of them are MOVES
        self._last_gauges: dict[str, int] = {}
        # (state.next_order after the call, step_index): a pending run with
        # order < next_order started at or before that step.
        self._orders: deque[tuple[int, int]] = deque()
        self._walked: dict[str, int] = {}  # the last pass over the ops
        self._walked_at: tuple[int, int] | None = None  # (id(state), sum of MOVES) then
        self._applied_at: tuple[int, int] | None = None  # (id(state), events applied) then

    def collect(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(counter deltas, gauges that changed)``; both empty when nothing moved.

        The counters are compared in C (``map(ne, ...)`` over their values in
        their fixed order, against the values of the last call), so a call
        costs a few microseconds plus one entry per counter that moved."""
        manager = self._manager
        state = manager.state
        draining = bool(getattr(manager, "draining", False))
        # Nothing applied since the last call: nothing can have moved (the
        # hand-off's figures move only when it records). Drain-only mode
        # moves the shell's own ledger without events: always read.
        applied = getattr(manager, "events_applied", None)
        if not draining and applied is not None:
            key = (id(state), applied)
            if key == self._applied_at:
                return {}, {}
            self._applied_at = key
        counters = state.counters
        if len(counters) != len(self._keys) or counters is not self._counters:
            self._rebind(counters)
        values = list(counters.values())
        last, keys = self._last_values, self._keys
        deltas = {keys[i]: values[i] - last[i]
                  for i in compress(self._indexes, map(ne, values, last))}
        self._last_values = values
        changed: dict[str, int] = {}
        seen = self._last_gauges
        if self._recounted(state, draining, sum(compress(values, self._moves_mask))):
            for name, value in self._walked.items():
                if seen.get(name) != value:
                    changed[name] = seen[name] = value
        for name, value in self._scalars(state, draining):
            if seen.get(name) != value:
                changed[name] = seen[name] = value
        return deltas, changed

    def _rebind(self, counters: dict[Counter, int]) -> None:
        """A new counters dict (the first call, or a new state): re-read its
        key order, keeping the last values reported by name."""
        previous = dict(zip(self._keys, self._last_values, strict=True))
        self._counters = counters
        self._keys = tuple(counter.value for counter in counters)
        self._indexes = range(len(self._keys))
        self._last_values = [previous.get(key, 0) for key in self._keys]
        self._moves_mask = [counter in _MOVES_SET for counter in counters]

    def gauges(self, state: Any) -> dict[str, int]:
        """Every gauge's value now (the pass over the ops only when a
        :data:`MOVES` counter moved since the last pass)."""
        draining = bool(getattr(self._manager, "draining", False))
        counters = state.counters
        self._recounted(state, draining, sum(counters[counter] for counter in MOVES))
        return {**self._walked, **dict(self._scalars(state, draining))}

    def _recounted(self, state: Any, draining: bool, moves: int) -> bool:
        """Re-take :meth:`walk` unless ``moves`` (the sum of the :data:`MOVES`
        counters) and the state are as at the last one; whether it did."""
        at = (id(state), moves)
        if not draining and at == self._walked_at:
            return False
        self._walked = self.walk(state, draining)
        self._walked_at = None if draining else at
        return True

    def _scalars(self, state: Any, draining: bool) -> tuple[tuple[str, int], ...]:
        """The gauges read in O(1) every call."""
        handoff = self._handoff
        if handoff is None:
            log: tuple[tuple[str, int], ...] = ()
        else:
            recorded = handoff.recorder_stats
            log = (
                ("log_items_lost", int(recorded.get("items_lost", 0))),
                ("log_handoff_events_lost", handoff.events_lost),
                ("log_handoff_bytes_in_flight", handoff.stats.bytes_in_flight),
                ("log_recorder_restarts", handoff.stats.recorder_restarts),
                ("log_recorder_up", int(handoff.recorder_up)),
                ("log_pub_bind_failed", int(recorded.get("pub_bind_failed", 0))),
            )
        return (
            ("oldest_buffered_op_age_steps", self._oldest_age(state)),
            *log,
            ("draining", int(draining)),
        )

    def walk(self, state: Any, draining: bool) -> dict[str, int]:
        """The gauges of the ops and pins: the core's live tallies (O(1)), a
        count of the in-flight batches and of the pinned ops of the shielded
        requests (both bounded by the pins)."""
        ops, tokens = state.live_ops, state.live_tokens
        in_flight_batches = sum(1 for batch in state.batches.values()
                                if batch.status is BatchStatus.IN_FLIGHT)
        shielded = 0
        for req_id in state.shielded:
            rec = state.requests.get(req_id)
            if rec is not None:
                shielded += sum(1 for op in rec.ops if op.pinned)
        pinned = len(state.pins)
        if draining:
            manager = self._manager
            held = getattr(manager, "_held", None)
            pinned = len(held) if held is not None else pinned
            drain = getattr(manager, "_drain", None)
            if drain is not None:
                in_flight_batches = len(drain.in_flight)
        return {
            "buffered_ops": ops[OpStatus.BUFFERED],
            "buffered_tokens": tokens[OpStatus.BUFFERED],
            "verifying_ops": ops[OpStatus.VERIFYING],
            "verifying_tokens": tokens[OpStatus.VERIFYING],
            "in_flight_ops": ops[OpStatus.IN_FLIGHT],
            "in_flight_tokens": tokens[OpStatus.IN_FLIGHT],
            "in_flight_batches": in_flight_batches,
            "pinned_blocks": pinned,
            "shielded_ops": shielded,
        }

    def _oldest_age(self, state: Any) -> int:
        """Steps since the first request in ``state.pending`` (insertion order:
        the longest-buffered one) got its buffer's current run. ``rec.order``
        numbers runs as they start, so a deque of (``next_order``, step) per
        call maps an order to its step; entries older than the first pending
        run are dropped, so each is handled once."""
        orders = self._orders
        if not orders or orders[-1][0] != state.next_order:
            orders.append((state.next_order, state.step_index))
        first = next(iter(state.pending.values()), None)
        if first is None:
            return 0
        while len(orders) > 1 and orders[0][0] <= first.order:
            orders.popleft()
        return max(0, int(state.step_index) - orders[0][1])


def get_stats(source: StatsSource | None, base: KVConnectorStats | None
              ) -> LazyOffloadConnectorStats | None:
    """The connector's ``get_kv_connector_stats``: LMCache's lookups (``base``)
    plus this interval's lazy-offload deltas; None when there is nothing."""
    stats = LazyOffloadConnectorStats(data=dict(base.data) if base is not None else {})
    if source is not None:
        counters, gauges = source.collect()
        stats.counters.update(counters)
        stats.gauges.update(gauges)
    return None if stats.is_empty() else stats


class LazyOffloadPromMetrics(LMCacheMPPromMetrics):  # type: ignore[misc]
    """``vllm:lazy_offload_*`` counters and gauges, per engine, beside LMCache's
    lookup histogram (the parent's ``observe`` keeps feeding it).

    Every labelled child is created up front, so each series is scraped (at
    0) from the start and the ledger can be summed from one scrape.
    ``selected_ops_total{reason=window|fifo}`` is the policy's own rule: all
    selections minus the ones counted by a more specific reason.
    """

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                 *, primary_reason: SelectReason = SelectReason.WINDOW) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._primary = primary_reason.value
        # engine -> core counter name -> [children to increment]
        self._counters: dict[int, dict[str, list[Any]]] = {e: {} for e in per_engine_labelvalues}
        self._selected: dict[int, Any] = {}
        for family in COUNTER_FAMILIES:
            names = list(labelnames) + ([family.label] if family.label else [])
            metric = self._counter_cls(name=family.name, documentation=family.documentation,
                                       labelnames=names)
            for engine, values in per_engine_labelvalues.items():
                for label, counter in family.members.items():
                    if family.label is not None and label == "":  # selected_ops: see above
                        self._selected[engine] = metric.labels(*values, self._primary)
                        continue
                    child = metric.labels(*values, label) if family.label else \
                        metric.labels(*values)
                    self._counters[engine].setdefault(counter.value, []).append(child)
        self._gauges: dict[int, dict[str, Any]] = {e: {} for e in per_engine_labelvalues}
        for name, documentation in GAUGES.items():
            gauge = self._gauge_cls(name=METRIC_PREFIX + name, documentation=documentation,
                                    labelnames=list(labelnames), multiprocess_mode="mostrecent")
            for engine, values in per_engine_labelvalues.items():
                self._gauges[engine][name] = gauge.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        super().observe(transfer_stats_data, engine_idx)
        counters = transfer_stats_data.get(COUNTERS_KEY) or {}
        children = self._counters[engine_idx]
        for name, delta in counters.items():
            if delta > 0:
                for child in children.get(name, ()):
                    child.inc(delta)
        selected = counters.get(Counter.SELECTED_OPS.value, 0) - sum(
            counters.get(c.value, 0) for c in SELECTED_BY.values())
        if selected > 0:
            self._selected[engine_idx].inc(selected)
        gauges = self._gauges[engine_idx]
        for name, value in (transfer_stats_data.get(GAUGES_KEY) or {}).items():
            if name in gauges:
                gauges[name].set(value)
