"""The hooks the simulator puts into vLLM's block pool, the connector and the lazy
managers, and the clocks they keep.

Contract: :func:`install` wraps, for one arm, in place:

* the pool's ``_maybe_evict_cached_block``: after every eviction of a hashed
  block the listener hears of it (``on_evicted``), with whether the block's
  hash has no cached block left;
* every scheduler-side connector method vLLM's ``Scheduler`` calls: its wall
  time, less the instrumentation inside it, is added to
  :attr:`Clocks.conn_s`; ``build_connector_meta``, where LMCache's lazy
  managers drain, tells their listener before (``before_drain``; ours drains
  beside the model, and the loop tells it ``before_drain`` after
  ``schedule()`` and every lazy arm's ``after_drain`` after the model), and
  ``request_finished(_all_groups)`` tells every listener after (``on_finished``);
* a lazy manager's offers (ours: ``offer_chunks``; LMCache's: ``add_store_candidate``;
  the listener's ``on_offered``, after the view counted the offer) and, for LMCache's managers, its
  ``on_scheduler_step`` and its policy's ``drain``: which ops the policy
  emitted and which of them the step submitted or dropped as stale, which
  LMCache's managers do not count themselves.

Everything a hook does besides the wrapped call is instrumentation, timed into
:attr:`Clocks.instr_s`; the loop subtracts what lands inside its scheduler
timers, and the connector timer what lands inside a connector call.

Theory of operation: the wrappers replace attributes on the live objects
(the pool, the connector, the manager, the policy), so vLLM's and LMCache's
code calls them unchanged. A connector call made inside another (LMCache's
``request_finished_all_groups`` calls ``request_finished``) is timed once, by
the outermost wrapper; the ``after`` callbacks run for both. The policy's
``drain`` is wrapped at the first drain, as LMCache may make its policy late.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from bench.sim.views import ManagerView


class Clocks:
    """Seconds of instrumentation so far (``instr_s``: subtracted from enclosing
    timers) and of connector calls in the current step (``conn_s``)."""

    __slots__ = ("instr_s", "conn_s", "depth")

    def __init__(self) -> None:
        self.instr_s = 0.0
        self.conn_s = 0.0
        self.depth = 0  # connector calls under way (nested ones timed by the outermost)


class Listener(Protocol):
    def on_evicted(self, block_id: int, bh_group: Any, block_hash: bytes, gone: bool) -> None:
        ...

    def on_offered(self, req_id: str, start: int, block_ids: list[int]) -> None:
        ...

    def before_drain(self) -> None:
        ...

    def after_drain(self) -> None:
        ...

    def on_finished(self, returned: Any, request: Any) -> None:
        ...


# Every other scheduler-side call vLLM's Scheduler makes (per step: stats, events,
# the pending-frees and push-work questions; per request: the lookup, the
# allocation update, the arrival): all of them are connector cost.
_OTHER_CONNECTOR_CALLS = ("get_kv_connector_stats", "take_events", "has_pending_block_frees",
                          "has_pending_push_work", "get_num_new_matched_tokens",
                          "update_state_after_alloc", "on_new_request")


def install(*, pool: Any, connector: Any, view: ManagerView, lazy: bool, clocks: Clocks,
            listener: Listener) -> None:
    """Wrap ``pool``, ``connector`` (None: the no-connector arm) and the lazy
    manager ``view`` reads (module docstring)."""
    _hook_evictions(pool, clocks, listener)
    if connector is None:
        return

    def before_drain() -> None:
        _wrap_policy_drain(view, clocks)
        listener.before_drain()

    def after_finished(returned: Any, request: Any, *_: Any) -> None:
        listener.on_finished(returned, request)

    _timed(clocks, connector, "build_connector_meta",
           pre=before_drain if lazy and not view.ours else None)
    _timed(clocks, connector, "update_connector_output")
    _timed(clocks, connector, "request_finished_all_groups", post=after_finished)
    _timed(clocks, connector, "request_finished", post=after_finished)
    for name in _OTHER_CONNECTOR_CALLS:
        if callable(getattr(connector, name, None)):
            _timed(clocks, connector, name)
    if view.mgr is not None:
        _hook_manager(view.mgr, view, clocks, listener)


def _hook_evictions(pool: Any, clocks: Clocks, listener: Listener) -> None:
    from vllm.v1.core.kv_cache_utils import get_block_hash

    orig_evict = pool._maybe_evict_cached_block
    lookup = pool.cached_block_hash_to_block

    def evict_hook(block: Any) -> Any:
        bh = block.block_hash
        r = orig_evict(block)
        if r and bh is not None:
            t0 = time.perf_counter()
            listener.on_evicted(block.block_id, bh, get_block_hash(bh),
                                lookup.get_one_block(bh) is None)
            clocks.instr_s += time.perf_counter() - t0
        return r

    pool._maybe_evict_cached_block = evict_hook


def _hook_manager(mgr: Any, view: ManagerView, clocks: Clocks, listener: Listener) -> None:
    def noted(req_id: str, start: int, block_ids: list[int]) -> None:
        t0 = time.perf_counter()
        view.offered += 1
        listener.on_offered(req_id, start, block_ids)
        clocks.instr_s += time.perf_counter() - t0

    if view.ours:  # ours is offered by the connector's lazy candidate path
        orig_offer = mgr.offer_chunks

        def offer_hook(req_id: str, start: int, end: int, groups: Any, source: Any) -> None:
            orig_offer(req_id, start, end, groups, source)
            noted(req_id, start, [b for group in groups for b in group])

        mgr.offer_chunks = offer_hook
        return
    orig_add = mgr.add_store_candidate

    def add_hook(meta: Any) -> None:
        orig_add(meta)
        noted(meta.request_id, meta.op.start, meta.op.flat_block_ids)

    mgr.add_store_candidate = add_hook
    orig_step = mgr.on_scheduler_step

    def step_hook(so: Any) -> Any:
        view.last_emitted = []
        actions = orig_step(so)
        t0 = time.perf_counter()
        sub = {m.request_id: (m.op.start, m.op.end) for m in actions.stores_to_submit}
        for rid, s, e in view.last_emitted:
            rng = sub.get(rid)
            if rng is not None and rng[0] <= s and e <= rng[1]:
                view.submitted_ops += 1
            else:
                view.stale_ops += 1
        clocks.instr_s += time.perf_counter() - t0
        return actions

    mgr.on_scheduler_step = step_hook


def _wrap_policy_drain(view: ManagerView, clocks: Clocks) -> None:
    """Note the ops LMCache's policy emits at each drain (once per policy)."""
    pol = view.policy()
    if pol is None or getattr(pol, "_bench_wrapped", False):
        return
    orig = pol.drain

    def drain_hook(signals: Any) -> Any:
        res = orig(signals)
        t0 = time.perf_counter()
        em = [(it.request_id, m.op.start, m.op.end) for it in res.items
              for m, _ in it.metadatas]
        view.last_emitted = em
        view.emitted_ops += len(em)
        clocks.instr_s += time.perf_counter() - t0
        return res

    pol.drain = drain_hook
    pol._bench_wrapped = True


def _timed(clocks: Clocks, obj: Any, name: str, pre: Any = None, post: Any = None) -> None:
    """Wrap a connector method: its wall time minus instrumentation goes to
    ``clocks.conn_s``; ``pre`` (outermost calls only) and ``post`` are
    instrumentation."""
    orig = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        outer = clocks.depth == 0
        if outer and pre is not None:
            t = time.perf_counter()
            pre()
            clocks.instr_s += time.perf_counter() - t
        clocks.depth += 1
        i0 = clocks.instr_s
        t0 = time.perf_counter()
        try:
            r = orig(*a, **k)
        finally:
            clocks.depth -= 1
        if outer:
            clocks.conn_s += time.perf_counter() - t0 - (clocks.instr_s - i0)
        if post is not None:
            t = time.perf_counter()
            post(r, *a)
            clocks.instr_s += time.perf_counter() - t
        return r

    setattr(obj, name, wrapper)
