"""The simulated workers: what vLLM's workers and LMCache would report back.

Contract: :meth:`Workers.output` is the workers' side of one step, given the
step's ``SchedulerOutput``: every STORE in the connector's metadata is
submitted (its chunk writes counted), every RETRIEVE finishes at once
(``finished_recving``), the receipts due by this step are handed over, and an
eager arm's delayed frees finish (``finished_sending``) once the request has no
store outstanding. It returns the ``KVConnectorOutput`` vLLM's output
aggregator would give ``update_from_output`` (None for the no-connector arm);
a lazy arm's receipts go in ``LMCacheMPWorkerMetadata``.

Theory of operation: every rank reports every store, ``receipt_delay_steps``
after submission plus its skew and its own extra delay (``SimParams``); a
rank's part fails with its own probability, and the whole store with
``store_failure_rate``: a failed rank still reports, with the request in its
failed set, as LMCache's worker adapter does. Receipts due at the same step
are summed over ranks as vLLM's aggregator sums them (counts added, failed sets
united). A store completes when its last rank has reported: its chunk keys
reach LMCache then (:meth:`bench.sim.truth.GroundTruth.store_completed`), and
only if no rank failed. Staleness is ground truth too: a store whose blocks no
longer held its request's content, at submission or when its last rank
reported, is recorded (the pins must prevent both). One ``random.Random`` per
arm, seeded from ``SimParams.seed``, draws the failures in submission order.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from bench.sim.arms import BLOCK_TOKENS, SimParams
from bench.sim.results import ArmResult
from bench.sim.standin import SimLMCache
from bench.sim.truth import GroundTruth


class Workers:
    def __init__(self, params: SimParams, *, connected: bool, lazy: bool, lm: SimLMCache,
                 truth: GroundTruth, pool: Any, requests: dict[str, Any],
                 res: ArmResult) -> None:
        self.p = params
        self.connected = connected
        self.lazy = lazy
        self.lm = lm
        self.truth = truth
        self.pool = pool
        self.requests = requests
        self.res = res
        self.rng = random.Random(params.seed * 7919 + 17)
        self.due_receipts: dict[int, dict[str, list[Any]]] = defaultdict(dict)
        self.outstanding: dict[str, int] = defaultdict(int)
        self.eager_wait_free: set[str] = set()
        self.rank_reports: dict[str, int] = {}
        self.rank_failed: dict[str, bool] = {}
        # stores whose blocks no longer held the request's content at submission,
        # or before their last rank reported
        self.stale_submits: list[tuple[str, int, int]] = []
        self.stale_completions: list[tuple[str, int, int]] = []
        self.in_flight: dict[str, tuple[int, int, list[int]]] = {}

    @property
    def busy(self) -> bool:
        """Receipts still due, or an eager free still waiting for its stores."""
        return bool(self.due_receipts or self.eager_wait_free)

    def output(self, so: Any, step: int) -> Any:
        """The workers' side of one step: submit this step's STOREs, finish its
        RETRIEVEs now, collect the receipts due, and the eager delayed frees whose
        stores are all done. None without a connector."""
        from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        finished_recving: set[str] = set()
        meta = so.kv_connector_metadata
        if meta is not None and getattr(meta, "requests", None):
            for m in meta.requests:
                if m.direction == "STORE":
                    self._submit_store(m, step)
                else:
                    finished_recving.add(m.request_id)
        completed: dict[str, int] = {}
        failed: set[str] = set()
        for rid, (n, bad, _keys) in self._take_receipts(step).items():
            completed[rid] = n
            if bad:
                failed.add(rid)
        finished_sending = {r for r in self.eager_wait_free if self.outstanding.get(r, 0) == 0}
        self.eager_wait_free -= finished_sending
        if not self.connected:
            return None
        wm = None
        if self.lazy and (completed or failed):
            wm = LMCacheMPWorkerMetadata(completed_store_requests=completed,
                                         failed_store_requests=failed)
        return KVConnectorOutput(finished_sending=finished_sending or None,
                                 finished_recving=finished_recving or None,
                                 kv_connector_worker_meta=wm)

    def _rank_delay(self, w: int) -> int:
        extra = self.p.rank_delay_steps[w] if w < len(self.p.rank_delay_steps) else 0
        return self.p.receipt_delay_steps + (w % (self.p.receipt_skew_steps + 1)) + extra

    def _rank_fails(self, w: int) -> bool:
        rate = self.p.rank_failure_rate[w] if w < len(self.p.rank_failure_rate) else 0.0
        return rate > 0 and self.rng.random() < rate

    def _holds_content(self, rid: str, start: int, block_ids: list[int]) -> bool:
        """Whether every block still carries the request's block hash at its position."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        hashes = self.requests[rid].block_hashes
        first = start // BLOCK_TOKENS
        for i, b in enumerate(block_ids):
            bh = self.pool.blocks[b].block_hash
            if bh is None or first + i >= len(hashes) or get_block_hash(bh) != hashes[first + i]:
                return False
        return True

    def _submit_store(self, m: Any, step: int) -> None:
        rid = m.request_id
        req = self.requests[rid]
        keys = self.lm.chunk_keys(req, m.op.start, m.op.end)
        self.res.chunk_writes += len(keys)
        self.res.store_batches += 1
        self.truth.store_submitted(keys)
        blocks = list(m.op.block_ids[0]) if m.op.block_ids else []
        if not self._holds_content(rid, m.op.start, blocks):
            self.stale_submits.append((rid, m.op.start, m.op.end))
        self.in_flight[rid] = (m.op.start, m.op.end, blocks)
        bad = self.p.store_failure_rate > 0 and self.rng.random() < self.p.store_failure_rate
        self.outstanding[rid] += 1
        for w in range(self.p.world_size):
            due = step + self._rank_delay(w)
            slot = self.due_receipts[due].setdefault(rid, [0, False, keys])
            slot[0] += 1
            slot[1] = slot[1] or bad or self._rank_fails(w)

    def _take_receipts(self, step: int) -> dict[str, tuple[int, bool, list[bytes]]]:
        """Receipts due by ``step``, summed over ranks; completes each store whose
        last rank reported."""
        out: dict[str, tuple[int, bool, list[bytes]]] = {}
        for due in [d for d in self.due_receipts if d <= step]:
            for rid, (n, bad, keys) in self.due_receipts.pop(due).items():
                prev = out.get(rid)
                out[rid] = (n + (prev[0] if prev else 0), bad or (prev[1] if prev else False), keys)
        for rid, (n, bad, keys) in out.items():
            self.rank_reports[rid] = self.rank_reports.get(rid, 0) + n
            failed = self.rank_failed[rid] = self.rank_failed.get(rid, False) or bad
            if self.rank_reports[rid] >= self.p.world_size:
                self.rank_reports.pop(rid)
                self.rank_failed.pop(rid)
                self.outstanding[rid] -= 1
                start, end, blocks = self.in_flight.pop(rid, (0, 0, []))
                # The last rank reads the blocks up to its report: they must still
                # hold the request's content (the pins keep them from reallocation).
                if not self._holds_content(rid, start, blocks):
                    self.stale_completions.append((rid, start, end))
                self.truth.store_completed(keys, failed)
        return out
