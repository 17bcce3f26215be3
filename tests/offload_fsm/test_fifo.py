"""FIFO drain policy: the spec's (``lazy-offload.md``) count-triggered
semantics, and LMCache G3's whole-request drain with manager verification
(reference §5.1, §7.1)."""

from __future__ import annotations

from offload_fsm.invariants import ledger_terms
from offload_fsm.vocabulary.commands import (
    EndSession,
    ProtectBlocks,
    ReadHashes,
    ReleaseBlocks,
    SubmitStore,
)
from offload_fsm.vocabulary.decisions import (
    BatchOrphaned,
    DropCause,
    OpsDropped,
    OpsSelected,
    SelectReason,
    StoreSettled,
    StoreSubmitted,
)

from .helpers import Harness, fifo


def finished_requests(h: Harness, req_ids: list[str], ops: int = 1) -> None:
    for req_id in req_ids:
        h.arrive(req_id)
        h.offer_ops(req_id, ops)
        h.finish(req_id)


def selected_ids(result) -> list[str]:  # type: ignore[no-untyped-def]
    return [d.req_id for d in result.of(OpsSelected)]


def test_spec_example_threshold_20_select_10() -> None:
    h = Harness(fifo(threshold=20, select_count=10))
    first = [f"r{i:02}" for i in range(20)]
    finished_requests(h, first)
    assert list(h.state.ready) == first

    step = h.tick()
    assert selected_ids(step) == first[:10]
    assert all(d.reason is SelectReason.FIFO for d in step.of(OpsSelected))
    assert [c.req_id for c in step.of(SubmitStore)] == first[:10]
    assert list(h.state.ready) == first[10:]  # 10 left ready

    assert h.tick().decisions == []  # 10 ready < 20: nothing

    second = [f"s{i:02}" for i in range(10)]
    finished_requests(h, second[:9])
    assert h.tick().of(OpsSelected) == []  # 19 ready
    finished_requests(h, second[9:])
    step = h.tick()
    assert selected_ids(step) == first[10:]  # insertion order: the older ones first
    assert list(h.state.ready) == second


def test_selection_follows_first_buffered_op_not_arrival_or_finish_order() -> None:
    h = Harness(fifo(threshold=3, select_count=2))
    h.arrive("a", "b", "c")
    h.offer("c")  # c's first op enters the buffer first
    h.offer("a")
    h.offer("c")
    h.offer("b")
    h.finish("b", "a", "c")
    step = h.tick()
    assert selected_ids(step) == ["c", "a"]
    assert list(h.state.ready) == ["b"]


def test_request_that_empties_and_refills_goes_to_the_back() -> None:
    h = Harness(fifo(threshold=1, select_count=1))
    h.arrive("a", "b")
    h.offer("a")
    h.offer("b")
    h.finish("a")
    assert selected_ids(h.tick()) == ["a"]
    h.complete("a")
    # Id reuse of the finished "a": it buffers again, behind b.
    h.arrive("a")
    h.restart("a")
    h.offer("a")
    h.finish("b", "a")
    assert selected_ids(h.tick()) == ["b"]
    h.complete("b")
    assert selected_ids(h.tick()) == ["a"]


def test_nothing_is_flushed_on_empty_steps() -> None:
    h = Harness(fifo(threshold=2, select_count=10))
    finished_requests(h, ["a", "b"])
    for _ in range(5):
        step = h.empty_step()
        assert step.decisions == [] and step.commands == []
    assert list(h.state.ready) == ["a", "b"]
    assert h.state.counters["empty_steps"] == 5
    assert selected_ids(h.tick()) == ["a", "b"]


def test_nothing_is_flushed_when_idle_below_threshold() -> None:
    h = Harness(fifo(threshold=3, select_count=10))
    finished_requests(h, ["a", "b"])
    for _ in range(20):
        assert h.tick().decisions == []
    assert list(h.state.ready) == ["a", "b"]
    assert ledger_terms(h.state)["pending"] == 2


def test_threshold_1_still_needs_a_later_non_empty_step() -> None:
    h = Harness(fifo(threshold=1, select_count=10))
    h.arrive("a")
    h.offer("a")
    finished = h.finish("a")
    assert finished.of(OpsSelected) == [] and finished.of(SubmitStore) == []
    assert h.empty_step().commands == []
    assert selected_ids(h.tick()) == ["a"]


def test_threshold_counts_requests_not_ops() -> None:
    h = Harness(fifo(threshold=2, select_count=10))
    finished_requests(h, ["a"], ops=5)
    assert h.tick().of(OpsSelected) == []
    finished_requests(h, ["b"], ops=1)
    assert selected_ids(h.tick()) == ["a", "b"]


def test_unfinished_requests_are_never_selected() -> None:
    h = Harness(fifo(threshold=1, select_count=10))
    h.arrive("live", "done")
    h.offer_ops("live", 3)
    h.offer("done")
    h.finish("done")
    assert selected_ids(h.tick()) == ["done"]
    for _ in range(10):
        h.offer("live")
        assert h.tick().of(OpsSelected) == []
    assert list(h.state.ready) == []
    assert len(h.state.requests["live"].ops) == 13


def test_request_with_a_batch_in_flight_is_not_selected() -> None:
    h = Harness(fifo(threshold=1, select_count=10))
    finished_requests(h, ["x"])
    assert selected_ids(h.tick()) == ["x"]  # x's batch is in flight now
    # The id is reused while the predecessor's store is in flight.
    reuse = h.arrive("x")
    assert reuse.of(BatchOrphaned) and reuse.of(EndSession) == []
    h.restart("x")
    h.offer("x")
    h.finish("x")
    assert list(h.state.ready) == []
    assert h.tick().of(OpsSelected) == []
    # The orphaned batch settles: x becomes ready and drains.
    settle = h.complete("x")
    assert settle.one(StoreSettled).orphaned
    assert list(h.state.ready) == ["x"]
    assert selected_ids(h.tick()) == ["x"]


def test_request_with_a_batch_in_flight_is_not_counted() -> None:
    h = Harness(fifo(threshold=2, select_count=10))
    finished_requests(h, ["x", "y"])
    assert selected_ids(h.tick()) == ["x", "y"]
    h.arrive("x")
    h.restart("x")
    h.offer("x")
    h.finish("x")
    finished_requests(h, ["z"])
    assert list(h.state.ready) == ["z"]
    assert h.tick().of(OpsSelected) == []  # x is blocked: 1 ready < 2
    h.complete("x")
    assert selected_ids(h.tick()) == ["x", "z"]  # x's new op entered the buffer first


def test_selected_request_is_drained_whole_into_one_store() -> None:
    h = Harness(fifo(threshold=1, select_count=10))
    finished_requests(h, ["a"], ops=3)
    blocks = h.blocks_in("a")
    step = h.tick()
    selected = step.one(OpsSelected)
    assert (selected.start_token, selected.end_token, selected.ops) == (0, 192, 3)
    assert step.one(ProtectBlocks).block_ids == blocks
    assert step.one(ReadHashes).block_ids == blocks
    submit = step.one(SubmitStore)
    assert (submit.req_id, submit.start_token, submit.end_token) == ("a", 0, 192)
    assert submit.block_ids == blocks
    submitted = step.one(StoreSubmitted)
    assert (submitted.ops, submitted.blocks) == (3, 6)
    assert h.state.requests["a"].ops == []


def test_one_store_per_request_in_one_step() -> None:
    h = Harness(fifo(threshold=3, select_count=3))
    for req_id in ("a", "b", "c"):
        h.arrive(req_id)
        h.offer_ops(req_id, 2)
    h.finish("a", "b", "c")
    step = h.tick()
    assert [c.req_id for c in step.of(SubmitStore)] == ["a", "b", "c"]
    assert len({c.batch_id for c in step.of(SubmitStore)}) == 3


def test_first_op_mismatch_drops_the_whole_request() -> None:
    h = Harness(fifo(threshold=1, select_count=10))
    finished_requests(h, ["a"], ops=3)
    blocks = h.blocks_in("a")
    bad = h.blocks_of["a"][0][1]
    h.hashes[bad] = 999_999  # reallocated before the drain
    step = h.tick()
    assert step.of(StoreSubmitted) == [] and step.of(SubmitStore) == []
    dropped = step.one(OpsDropped)
    assert dropped.cause is DropCause.STALE
    assert (dropped.start_token, dropped.end_token, dropped.ops, dropped.tokens) == (0, 192, 3, 192)
    assert dropped.block_id == bad
    assert step.one(ReleaseBlocks).block_ids == blocks  # everything protected is unpinned
    assert step.one(EndSession).req_id == "a"  # finished, empty, idle
    assert h.pins == {} and h.state.batches == {}
    assert h.state.counters["dropped_stale_ops"] == 3


def test_unhashed_block_at_verification_counts_as_mismatch() -> None:
    h = Harness(fifo(threshold=1, select_count=10))
    finished_requests(h, ["a"], ops=2)
    h.hashes[h.blocks_of["a"][0][0]] = None  # evicted, hash reset
    step = h.tick()
    assert step.of(SubmitStore) == []
    assert step.one(OpsDropped).cause is DropCause.STALE


def test_mid_request_mismatch_submits_the_valid_prefix() -> None:
    h = Harness(fifo(threshold=1, select_count=10))
    finished_requests(h, ["a"], ops=3)
    first, second, third = h.blocks_of["a"]
    h.hashes[second[0]] = 999_999
    step = h.tick()
    submit = step.one(SubmitStore)
    assert (submit.start_token, submit.end_token, submit.block_ids) == (0, 64, first)
    assert step.one(StoreSubmitted).ops == 1
    dropped = step.one(OpsDropped)
    assert (dropped.cause, dropped.start_token, dropped.end_token, dropped.ops) == (
        DropCause.STALE, 64, 192, 2)
    assert step.one(ReleaseBlocks).block_ids == second + third
    assert dict(h.pins) == dict.fromkeys(first, 1)
    assert step.of(EndSession) == []  # its store is still in flight
    settle = h.complete("a")
    assert settle.one(ReleaseBlocks).block_ids == first
    assert settle.one(EndSession).req_id == "a"
    assert h.pins == {}


def test_select_count_caps_requests_per_step_and_ready_count_drops() -> None:
    h = Harness(fifo(threshold=1, select_count=2))
    finished_requests(h, ["a", "b", "c", "d", "e"])
    assert selected_ids(h.tick()) == ["a", "b"]
    assert selected_ids(h.tick()) == ["c", "d"]
    assert selected_ids(h.tick()) == ["e"]
    assert h.tick().of(OpsSelected) == []


def test_fifo_ignores_block_pressure() -> None:
    h = Harness(fifo(threshold=5, select_count=5))
    finished_requests(h, ["a"])
    step = h.tick(allocated=500, next_blocks=500, free=0)
    assert step.decisions == []
    assert h.state.ema_blocks is None and h.state.depth_blocks == 0
