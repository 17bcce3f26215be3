"""One reading of either lazy manager, ours or LMCache's, for the simulator.

Contract: :class:`ManagerView` answers the same questions of whichever lazy
manager an arm's connector holds: the buffered ops now (:meth:`backlog`),
whether an op of a request starting at a token is still buffered
(:meth:`is_pending`, what the loss attribution asks at an eviction), the
danger depth the manager drains to (:meth:`depth`) and, at the end, its ledger
of ops (:meth:`ledger`: offered, admitted, submitted, stored, dropped by
cause, pending). It only reads; the counters it keeps for LMCache's managers
(``offered``, ``emitted_ops``, ``submitted_ops``, ``stale_ops``,
``last_emitted``) are filled by the hooks in :mod:`bench.sim.hooks`. For an
eager arm and the no-connector arm ``mgr`` is None and every answer is empty.

Theory of operation: ours keeps everything in its core's ``State`` (pending
records, ``depth_blocks``, counters), so its answers are direct reads. LMCache's
policies keep private structures, read as they are: EVICTION_AWARE buffers ops
per request in ``_pending``, counts in ``_counters`` and sizes its horizon from
an EMA of blocks per step; FIFO buffers whole items in ``_pending_items`` and
keeps no counters, so its admitted ops are the offered ones and its preemption
drops are what was offered but neither emitted nor still pending.
"""

from __future__ import annotations

import math
from typing import Any

from bench.sim.arms import ArmSpec
from offload_fsm.state import OpStatus


class ManagerView:
    def __init__(self, connector: Any, arm: ArmSpec) -> None:
        self.mgr: Any = getattr(connector, "_lazy_offload_manager", None) if arm.lazy else None
        self.arm = arm
        self.offered = 0
        self.emitted_ops = 0
        self.submitted_ops = 0
        self.stale_ops = 0
        self.last_emitted: list[tuple[str, int, int]] = []

    @property
    def ours(self) -> bool:
        return self.arm.kind == "ours"

    def policy(self) -> Any:
        return getattr(self.mgr, "_policy", None)

    def backlog(self) -> int:
        if self.mgr is None:
            return 0
        if self.ours:  # the core's own count: no walk over its requests each step
            return self.mgr.state.live_ops[OpStatus.BUFFERED]
        pol = self.policy()
        if pol is None:
            return 0
        if hasattr(pol, "_pending"):
            return sum(len(v) for v in pol._pending.values())
        return sum(len(item.metadatas) for item in pol._pending_items.values())

    def is_pending(self, rid: str, start: int) -> bool:
        if self.ours:
            rec = self.mgr.state.pending.get(rid)
            return rec is not None and any(o.start_token == start and not o.pinned
                                           for o in rec.ops)
        pol = self.policy()
        if hasattr(pol, "_pending"):
            return any(o.store_metadata.op.start == start for o in pol._pending.get(rid, ()))
        item = pol._pending_items.get(rid)
        return item is not None and any(m.op.start == start for m, _ in item.metadatas)

    def depth(self) -> int:
        if self.ours:
            return int(self.mgr.state.depth_blocks)
        pol = self.policy()
        if not hasattr(pol, "_blocks_per_step_ema"):
            return 0
        h = max(pol._blocks_per_step_ema, float(pol._next_step_estimate)) * \
            pol._config.horizon_steps
        return 0 if h < 0.5 else int(math.ceil(h))

    def ledger(self) -> dict[str, int]:
        if self.mgr is None:
            return {}
        if self.ours:
            from offload_fsm.invariants import ledger_terms

            c = self.mgr.state.counters
            terms = ledger_terms(self.mgr.state)
            d = {"offered": self.offered, "admitted": c["admitted_ops"],
                 "submitted": c["submitted_ops"], "stored": c["stored_ops"],
                 "pending": terms["pending"] + terms["verifying"],
                 "rejected": c["rejected_unhashed_ops"] + c["rejected_prefix_broken_ops"],
                 "shielded": c["shielded_ops"], "held_pin_budget": c["held_pin_budget"],
                 "held_drain_cap": c["held_drain_cap"],
                 "selected_cascade": c["selected_cascade_ops"],
                 "selected_shielded": c["selected_shielded_ops"]}
            for k, v in c.items():
                if k.startswith("dropped_") and k.endswith("_ops"):
                    d[k[:-4]] = v
            return d
        pol = self.policy()
        d = {"offered": self.offered, "submitted": self.submitted_ops,
             "dropped_stale": self.stale_ops, "pending": self.backlog()}
        cnt = getattr(pol, "_counters", None)
        if cnt is not None:
            d["admitted"] = cnt.admitted
            d["dropped_evicted"] = cnt.dropped_evicted
            d["dropped_preempted"] = cnt.dropped_on_request_drop
            d["dropped_store_failed"] = cnt.dropped_failed_store
            d["dropped_id_reuse"] = cnt.dropped_id_reuse
            d["rejected"] = cnt.rejected_unhashed + cnt.rejected_prefix_broken
        else:  # FIFO keeps no counters: admitted = offered; the rest by difference
            d["admitted"] = self.offered
            d["dropped_preempted"] = max(
                0, self.offered - self.emitted_ops - d["pending"])
        return d
