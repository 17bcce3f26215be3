"""The receipt lease: a submitted batch whose receipts do not all arrive
within ``receipt_lease_s`` (logical time on ``StepScheduled``) is abandoned,
its pins released and its chain broken; late receipts of it never settle a
later batch."""

from __future__ import annotations

from offload_fsm.invariants import check_all, ledger_terms
from offload_fsm.vocabulary.commands import EndSession, ReleaseBlocks, SubmitStore
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.decisions import (
    DropCause,
    IgnoreReason,
    OpRejected,
    OpsDropped,
    ReceiptIgnored,
    RejectReason,
    StoreAbandoned,
    StoreSettled,
)

from .helpers import Harness, ea, fifo


def _submitted(lease_s: float = 10.0, world_size: int = 1) -> Harness:
    h = Harness(fifo(threshold=1, select_count=100, receipt_lease_s=lease_s),
                world_size=world_size)
    h.arrive("a")
    h.offer_ops("a", 2)
    assert h.tick().of(SubmitStore) == []  # not finished: not ready
    h.finish("a")
    assert h.tick().one(SubmitStore).req_id == "a"
    return h


def stored_early(world_size: int) -> Harness:
    """EVICTION_AWARE, a 5 s lease: request "r" running, its first op's
    blocks at the eviction head, so it is selected and submitted at once."""
    h = Harness(ea(receipt_lease_s=5.0), world_size=world_size)
    h.queue = list(range(10_000, 10_100))
    h.arrive("r")
    h.offer("r")
    for block in reversed(h.blocks_of["r"][0]):  # its blocks at the eviction head
        h.queue.insert(0, block)
    assert h.tick(allocated=4).one(SubmitStore).req_id == "r"  # running, stored early
    return h


def test_a_worker_that_never_reports_is_abandoned_at_the_lease() -> None:
    h = _submitted(lease_s=10.0)
    assert h.tick(dt_s=8.0).of(StoreAbandoned) == []  # 8 s after selection
    step = h.tick(dt_s=2.0)  # 10 s
    abandoned = step.one(StoreAbandoned)
    assert (abandoned.req_id, abandoned.ops, abandoned.receipts) == ("a", 2, 0)
    assert abandoned.waited_s == 10.0
    assert step.of(ReleaseBlocks) and h.pins == {}  # the pins are back
    assert step.one(EndSession).req_id == "a"  # finished, nothing left: the session ends
    counters = h.state.counters
    assert counters[Counter.ABANDONED_BATCHES] == 1
    assert ledger_terms(h.state)["abandoned"] == 2
    assert check_all(h.state) == []


def _reused_behind_a_silent_batch(world_size: int = 1) -> Harness:
    """"a" finished with a batch in flight, then its id came back (reuse):
    the old batch is orphaned and never reports."""
    h = Harness(fifo(threshold=1, receipt_lease_s=5.0), world_size=world_size)
    h.arrive("a")
    h.offer("a")
    h.finish("a")
    h.tick()  # submitted
    h.restart("a")
    h.arrive("a")  # id reuse: the in-flight batch is orphaned
    return h


def test_late_receipts_of_an_abandoned_batch_never_settle_the_next_one() -> None:
    h = _reused_behind_a_silent_batch()
    step = h.tick(dt_s=5.0)
    assert step.one(StoreAbandoned).req_id == "a"
    assert h.state.requests["a"].stray_receipts == 1
    h.offer("a")
    h.finish("a")
    new = h.tick().one(SubmitStore)
    late = h.receipts({"a": 1})  # the old batch's receipt, at last
    assert late.one(ReceiptIgnored).reason is IgnoreReason.LEASE_EXPIRED
    assert late.of(StoreSettled) == [] and h.state.batches  # the new batch still waits
    settled = h.complete("a").one(StoreSettled)
    assert settled.batch_id != step.one(StoreAbandoned).batch_id and not settled.failed
    assert new.req_id == "a" and h.pins == {} and check_all(h.state) == []


def test_a_failure_report_is_never_ignored_while_a_batch_could_have_failed() -> None:
    """A late failure may be the abandoned batch's or the new one's: failing
    the new one is safe (nothing is stored), ignoring it is not."""
    h = _reused_behind_a_silent_batch()
    h.tick(dt_s=5.0)  # the old batch abandoned: one receipt still due
    h.offer("a")
    h.finish("a")
    h.tick().one(SubmitStore)
    late = h.receipts({"a": 1}, failed=["a"])
    assert late.one(ReceiptIgnored).reason is IgnoreReason.LEASE_EXPIRED  # the receipt
    assert h.complete("a").one(StoreSettled).failed
    assert h.pins == {} and check_all(h.state) == []


def test_after_a_lost_receipt_a_preempted_and_resumed_request_settles_on_its_own() -> None:
    """World size 2, one receipt of a batch lost: abandoned at the lease with
    one receipt still due. The request is preempted and resumes: the stray
    credit ends with the preemption, and its next batch settles on its own
    two receipts, not swallowed, not held for a lease."""
    h = stored_early(world_size=2)
    h.receipts({"r": 1})  # one rank reports; the other's receipt is lost
    assert h.tick(dt_s=5.0).one(StoreAbandoned).receipts == 1
    assert h.state.requests["r"].stray_receipts == 1
    h.preempt("r")
    assert h.state.requests["r"].stray_receipts == 0
    h.arrive("r")
    h.offer("r")
    for block in reversed(h.blocks_of["r"][-1]):
        h.queue.insert(0, block)
    assert h.tick(allocated=4).one(SubmitStore).req_id == "r"
    settled = h.receipts({"r": 2}).one(StoreSettled)
    assert not settled.failed and h.pins == {} and check_all(h.state) == []


def test_an_abandoned_batch_of_a_live_chain_drops_the_held_back_ops() -> None:
    h = _reused_behind_a_silent_batch()
    h.offer("a")  # the new incarnation buffers behind nothing: the old batch is orphaned
    step = h.tick(dt_s=5.0)
    assert step.one(StoreAbandoned).req_id == "a"
    # An orphaned batch's loss does not touch the new chain.
    assert step.of(OpsDropped) == []
    assert not h.state.requests["a"].broken
    assert check_all(h.state) == []


def test_a_worker_that_reports_twice() -> None:
    h = _submitted(world_size=1)
    first = h.receipts({"a": 2})  # one rank, two reports in one call
    assert first.one(StoreSettled).req_id == "a"
    assert first.one(ReceiptIgnored).reason is IgnoreReason.EXCESS_COUNT
    again = h.receipts({"a": 1})  # and once more later
    assert again.one(ReceiptIgnored).reason is IgnoreReason.UNKNOWN_REQUEST
    assert h.pins == {} and check_all(h.state) == []


def test_a_lease_of_zero_never_abandons() -> None:
    h = _submitted(lease_s=0.0)
    assert h.tick(dt_s=1e6).of(StoreAbandoned) == []
    assert h.complete("a").one(StoreSettled).req_id == "a"


def test_an_abandoned_batch_breaks_a_running_requests_chain() -> None:
    h = stored_early(world_size=1)
    h.offer("r")  # buffered behind the batch in flight
    step = h.tick(dt_s=5.0)
    assert step.one(StoreAbandoned).req_id == "r"
    dropped = step.one(OpsDropped)
    assert (dropped.cause, dropped.ops) == (DropCause.STORE_FAILED, 1)
    assert h.offer("r").one(OpRejected).reason is RejectReason.PREFIX_BROKEN
    assert h.pins == {} and check_all(h.state) == []
