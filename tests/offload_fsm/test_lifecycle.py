"""Store-op, request and machine lifecycles shared by both policies:
verification before submit, receipts, preemption, id reuse, session end,
prefix-cache reset, shutdown, invalid events (reference §3.5-3.9, §7).

The harness checks ``check_all`` (ledger, pins, indexes, ...) after every
event; scenarios also check the ledger explicitly where it matters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from offload_fsm import InvalidEvent, MachinePoisoned, check_all, step
from offload_fsm.digest import canonical_state
from offload_fsm.invariants import ledger_terms
from offload_fsm.state import State, holders
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
    IgnoreReason,
    OpRejected,
    OpsDropped,
    OpsSelected,
    OpsShielded,
    ReceiptIgnored,
    RejectReason,
    StoreSettled,
    StoreSubmitted,
)
from offload_fsm.vocabulary.events import (
    CandidateOffered,
    Event,
    FreeQueueRead,
    HashesRead,
    ReceiptsArrived,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    StepScheduled,
)

from .helpers import Harness, ea, fifo

FILLER = tuple(range(10_000, 10_100))


def fifo_now(world_size: int = 1) -> Harness:
    """FIFO that drains every finished request on the next token step."""
    return Harness(fifo(threshold=1, select_count=100), world_size=world_size)


def ea_harness(world_size: int = 1, **config: Any) -> Harness:
    h = Harness(ea(**config), world_size=world_size)
    h.queue = list(FILLER)
    return h


def ea_due(h: Harness, req_id: str, ops: int = 1) -> None:
    """Put the front op of an (already offered) request at the eviction head."""
    for block in reversed(h.blocks_of[req_id][ops - 1]):
        if block in h.queue:
            h.queue.remove(block)
        h.queue.insert(0, block)


def submitted_fifo(h: Harness, req_id: str, ops: int = 1) -> tuple[int, ...]:
    h.arrive(req_id)
    h.offer_ops(req_id, ops)
    h.finish(req_id)
    result = h.tick()
    return result.one(SubmitStore).block_ids


def ends(h: Harness, req_id: str) -> int:
    return sum(1 for c in h.all_commands() if isinstance(c, EndSession) and c.req_id == req_id)


# -- verification before submit ------------------------------------------------


@pytest.mark.parametrize("policy", ["fifo", "ea"])
def test_blocks_are_protected_before_hashes_are_read_and_store_comes_after(policy: str) -> None:
    if policy == "fifo":
        h = fifo_now()
        h.arrive("a")
        h.offer_ops("a", 2)
        h.finish("a")
        result = h.tick()
    else:
        h = ea_harness()
        h.arrive("a")
        h.offer_ops("a", 2)
        h.finish("a", free=100)
        ea_due(h, "a", ops=2)
        result = h.tick(allocated=4)
    (first_event, first), (answer, second) = result.applied[:2]
    assert isinstance(first_event, StepScheduled) and isinstance(answer, HashesRead)
    kinds = [type(c) for c in first.commands]
    assert kinds.index(ProtectBlocks) < kinds.index(ReadHashes)
    protect = first.commands[kinds.index(ProtectBlocks)]
    read = first.commands[kinds.index(ReadHashes)]
    assert protect.block_ids == read.block_ids and protect.batch_id == read.batch_id
    assert answer.batch_id == read.batch_id
    assert [type(c) for c in second.commands] == [SubmitStore]
    assert [type(d) for d in second.decisions] == [StoreSubmitted]


@pytest.mark.parametrize("policy", ["fifo", "ea"])
def test_stale_op_is_never_submitted(policy: str) -> None:
    h = fifo_now() if policy == "fifo" else ea_harness()
    h.arrive("a")
    h.offer("a")
    h.finish("a", free=100)
    h.hashes[h.blocks_of["a"][0][0]] = 123  # reused behind our back, unreported
    if policy == "ea":
        ea_due(h, "a")
    result = h.tick(allocated=4)
    assert result.one(OpsSelected)
    assert result.of(SubmitStore) == [] and result.of(StoreSubmitted) == []
    assert result.one(OpsDropped).cause is DropCause.STALE
    assert result.one(ReleaseBlocks).block_ids == h.blocks_of["a"][0]


# -- receipts --------------------------------------------------------------------


def test_pins_are_released_only_when_every_worker_reported() -> None:
    h = fifo_now(world_size=3)
    blocks = submitted_fifo(h, "a")
    for _ in range(2):
        partial = h.receipts({"a": 1})
        assert partial.decisions == [] and partial.commands == []
        assert dict(h.pins) == dict.fromkeys(blocks, 1)
    last = h.receipts({"a": 1})
    settled = last.one(StoreSettled)
    assert (settled.req_id, settled.ops, settled.failed, settled.orphaned) == ("a", 1, False, False)
    assert last.one(ReleaseBlocks).block_ids == blocks
    assert last.one(EndSession).req_id == "a"
    assert h.pins == {}


def test_a_later_batch_of_the_same_request_counts_from_zero() -> None:
    h = ea_harness(world_size=2, max_drain_per_step=1)
    h.arrive("a")
    h.offer_ops("a", 2)
    h.finish("a", free=100)
    ea_due(h, "a", ops=2)
    h.tick(allocated=4)
    assert h.receipts({"a": 2}).one(StoreSettled).ops == 1
    h.tick(allocated=4)
    assert h.receipts({"a": 1}).of(StoreSettled) == []
    assert h.receipts({"a": 1}).one(StoreSettled).ops == 1


@pytest.mark.parametrize("req_id", ["a", "never-seen"])
def test_duplicate_or_unknown_receipt_is_ignored(req_id: str) -> None:
    h = fifo_now(world_size=2)
    submitted_fifo(h, "a")
    h.receipts({"a": 2})
    before = dict(h.state.counters)
    result = h.receipts({req_id: 2}, failed=[req_id])
    assert [(d.req_id, d.count, d.failed, d.reason) for d in result.decisions] == [
        (req_id, 0, True, IgnoreReason.UNKNOWN_REQUEST),
        (req_id, 2, False, IgnoreReason.UNKNOWN_REQUEST),
    ]
    assert result.commands == []
    assert h.state.counters["receipts_ignored"] == before["receipts_ignored"] + 2


def test_receipts_beyond_the_world_size_are_ignored_and_settle() -> None:
    h = fifo_now(world_size=2)
    blocks = submitted_fifo(h, "a")
    h.receipts({"a": 1})
    result = h.receipts({"a": 2})
    ignored = result.one(ReceiptIgnored)
    assert (ignored.count, ignored.reason) == (1, IgnoreReason.EXCESS_COUNT)
    assert result.one(StoreSettled).req_id == "a"
    assert result.one(ReleaseBlocks).block_ids == blocks


def test_failed_store_breaks_the_chain_and_drops_held_back_ops() -> None:
    h = ea_harness(world_size=2, max_drain_per_step=1)
    h.arrive("a")
    h.offer_ops("a", 3)
    ea_due(h, "a")
    h.tick(allocated=4)  # op 1 in flight; ops 2-3 held back
    result = h.receipts({"a": 2}, failed=["a"])
    dropped = result.one(OpsDropped)
    assert (dropped.cause, dropped.start_token, dropped.end_token, dropped.ops) == (
        DropCause.STORE_FAILED, 64, 192, 2)
    settled = result.one(StoreSettled)
    assert (settled.failed, settled.orphaned) == (True, False)
    assert h.state.requests["a"].broken
    assert h.offer("a").one(OpRejected).reason is RejectReason.PREFIX_BROKEN
    assert h.state.counters["failed_ops"] == 1
    assert h.state.counters["dropped_store_failed_ops"] == 2


def test_failure_first_lets_the_same_receipt_end_a_finished_session() -> None:
    h = ea_harness(world_size=1, max_drain_per_step=1)
    h.arrive("a")
    h.offer_ops("a", 2)
    h.finish("a", free=100)
    ea_due(h, "a")
    h.tick(allocated=4)
    result = h.receipts({"a": 1}, failed=["a"])
    kinds = [type(x) for x in result.decisions]
    assert kinds == [OpsDropped, StoreSettled]
    assert result.one(EndSession).req_id == "a"


def test_failure_reported_before_completions_keeps_pins_until_all_report() -> None:
    h = fifo_now(world_size=2)
    blocks = submitted_fifo(h, "a")
    early = h.receipts(failed=["a"])
    assert early.commands == [] and dict(h.pins) == dict.fromkeys(blocks, 1)
    h.receipts({"a": 1})
    last = h.receipts({"a": 1})
    assert last.one(StoreSettled).failed
    assert last.one(ReleaseBlocks).block_ids == blocks


def test_orphaned_batch_failure_is_not_charged_to_the_new_generation() -> None:
    h = ea_harness(world_size=1)
    h.arrive("a")
    h.offer("a")
    ea_due(h, "a")
    h.tick(allocated=4)  # batch in flight
    preempt = h.preempt("a")
    assert preempt.one(BatchOrphaned).req_id == "a"
    h.arrive("a")
    h.offer_ops("a", 2)  # the new generation restarts at token 0
    result = h.receipts({"a": 1}, failed=["a"])
    settled = result.one(StoreSettled)
    assert (settled.failed, settled.orphaned) == (True, True)
    assert result.of(OpsDropped) == []
    assert not h.state.requests["a"].broken
    assert len(h.state.requests["a"].ops) == 2
    assert h.offer("a").of(OpRejected) == []


# -- preemption -------------------------------------------------------------------


def test_preemption_drops_the_buffer_and_restarts_the_chain() -> None:
    h = ea_harness()
    h.arrive("a")
    h.offer_ops("a", 3)
    h.tick(allocated=4, reallocated=[(h.blocks_of["a"][2][0], None)])  # breaks the chain
    assert h.state.requests["a"].broken
    result = h.preempt("a")
    dropped = result.one(OpsDropped)
    assert (dropped.cause, dropped.start_token, dropped.end_token, dropped.ops) == (
        DropCause.PREEMPTED, 0, 128, 2)
    assert result.commands == []
    assert h.arrive("a").decisions == []  # re-arrival is not id reuse
    assert h.offer("a").of(OpRejected) == []  # from token 0, chain whole again
    assert h.state.requests["a"].ops[0].start_token == 0


def test_preemption_orphans_the_in_flight_batch_which_still_releases_pins() -> None:
    h = ea_harness(max_drain_per_step=1)
    h.arrive("a")
    h.offer_ops("a", 2)
    ea_due(h, "a")
    h.tick(allocated=4)
    batch_blocks = h.blocks_of["a"][0]
    result = h.preempt("a")
    assert result.one(BatchOrphaned).req_id == "a"
    assert result.one(OpsDropped).ops == 1
    h.arrive("a")
    h.offer("a")
    ea_due(h, "a")
    blocked = h.tick(allocated=4)
    assert blocked.of(OpsSelected) == []  # one batch per request id
    settle = h.complete("a")
    assert settle.one(StoreSettled).orphaned
    assert settle.one(ReleaseBlocks).block_ids == batch_blocks
    assert settle.of(EndSession) == []
    assert h.tick(allocated=4).one(OpsSelected).req_id == "a"


def test_preempting_an_unknown_request_does_nothing() -> None:
    h = fifo_now()
    assert h.preempt("ghost").decisions == []


# -- id reuse ---------------------------------------------------------------------


def test_id_reuse_drops_the_predecessor_buffer_and_ends_its_session_now() -> None:
    h = Harness(fifo(threshold=5), world_size=1)
    h.arrive("a")
    h.offer_ops("a", 2)
    h.finish("a")  # teardown deferred: ops buffered
    assert ends(h, "a") == 0
    h.restart("a")
    result = h.arrive("a")
    dropped = result.one(OpsDropped)
    assert (dropped.cause, dropped.ops) == (DropCause.ID_REUSE, 2)
    assert result.one(EndSession).req_id == "a"
    assert h.offer("a").of(OpRejected) == []  # successor starts at token 0
    h.finish("a")
    assert ends(h, "a") == 1  # the successor's session stays open while buffered


def test_id_reuse_with_a_batch_in_flight_orphans_it_and_ends_once_later() -> None:
    h = fifo_now()
    submitted_fifo(h, "a")
    h.restart("a")
    result = h.arrive("a")
    assert result.one(BatchOrphaned).req_id == "a"
    assert result.of(EndSession) == []
    h.finish("a")  # the successor buffered nothing; the orphan is in flight
    assert ends(h, "a") == 0
    settle = h.complete("a")
    assert settle.one(StoreSettled).orphaned
    assert settle.one(EndSession).req_id == "a"
    assert ends(h, "a") == 1


def test_orphan_settling_before_the_successor_finishes_ends_nothing() -> None:
    h = fifo_now()
    submitted_fifo(h, "a")
    h.restart("a")
    h.arrive("a")
    assert h.complete("a").of(EndSession) == []
    assert h.finish("a").one(EndSession).req_id == "a"


def test_id_reuse_drops_shielded_pins() -> None:
    h = ea_harness()
    h.tick(allocated=4)  # D = 10
    h.arrive("a")
    h.offer("a")
    assert h.finish("a", free=5).one(OpsShielded)
    blocks = h.blocks_of["a"][0]
    h.restart("a")
    result = h.arrive("a")
    assert result.one(ReleaseBlocks).block_ids == blocks
    assert result.one(OpsDropped).cause is DropCause.ID_REUSE
    assert h.pins == {} and h.state.shielded == {}


# -- sessions ----------------------------------------------------------------------


def test_request_with_nothing_buffered_ends_its_session_at_finish() -> None:
    h = fifo_now()
    h.arrive("short")
    assert h.finish("short").one(EndSession).req_id == "short"
    assert "short" not in h.state.requests


def test_finish_of_a_request_that_never_arrived_ends_its_session() -> None:
    h = fifo_now()
    result = h.finish("aborted-before-lookup")
    assert [c.req_id for c in result.of(EndSession)] == ["aborted-before-lookup"]
    assert h.state.requests == {}


def test_session_ends_once_after_buffer_and_batch_are_gone() -> None:
    h = fifo_now()
    h.arrive("a")
    h.offer_ops("a", 2)
    assert h.finish("a").of(EndSession) == []  # buffered
    assert h.tick().of(EndSession) == []  # in flight
    assert h.complete("a").one(EndSession).req_id == "a"
    for _ in range(3):
        h.tick()
        h.receipts({"a": 1})
    assert ends(h, "a") == 1


def test_running_request_never_ends_its_session() -> None:
    h = ea_harness()
    h.arrive("a")
    h.offer("a")
    ea_due(h, "a")
    h.tick(allocated=4)
    h.complete("a")
    h.tick(allocated=4)
    assert ends(h, "a") == 0


def test_finishing_twice_is_invalid() -> None:
    h = fifo_now()
    h.arrive("a")
    h.offer("a")
    h.finish("a")
    with pytest.raises(InvalidEvent, match="finished twice"):
        h.finish("a")


# -- prefix-cache reset and shutdown ------------------------------------------------


def test_prefix_cache_reset_drops_everything_buffered() -> None:
    h = ea_harness(max_drain_per_step=1)
    h.arrive("live", "done", "flying")
    h.offer_ops("live", 2)
    h.offer("done")
    h.offer_ops("flying", 2)
    h.finish("done", free=100)
    ea_due(h, "flying")
    h.tick(allocated=4)  # flying's first op in flight
    result = h.reset_cache()
    assert sorted((d.req_id, d.ops, d.cause) for d in result.of(OpsDropped)) == [
        ("done", 1, DropCause.CACHE_RESET),
        ("flying", 1, DropCause.CACHE_RESET),
        ("live", 2, DropCause.CACHE_RESET),
    ]
    assert [c.req_id for c in result.of(EndSession)] == ["done"]
    assert h.state.pending == {}
    assert ledger_terms(h.state)["in_flight"] == 1  # the submitted store is untouched
    assert h.offer("live").one(OpRejected).reason is RejectReason.PREFIX_BROKEN


def test_shutdown_drops_pending_releases_all_pins_and_poisons() -> None:
    h = ea_harness(max_drain_per_step=1)
    h.tick(allocated=4)
    h.arrive("shielded", "flying", "live")
    h.offer_ops("flying", 2)
    h.offer("live")
    h.finish("flying", free=100)
    ea_due(h, "flying")
    h.tick(allocated=4)  # flying's first op in flight
    h.offer("shielded")
    assert h.finish("shielded", free=5).one(OpsShielded)
    assert h.pins  # shielded + flying's batch
    result = h.shutdown()
    assert sorted((d.req_id, d.ops, d.cause) for d in result.of(OpsDropped)) == [
        ("flying", 1, DropCause.SHUTDOWN),
        ("live", 1, DropCause.SHUTDOWN),
        ("shielded", 1, DropCause.SHUTDOWN),
    ]
    assert h.pins == {} and h.state.pins == {}
    assert sorted(c.req_id for c in result.of(EndSession)) == ["flying", "shielded"]
    terms = ledger_terms(h.state)
    assert terms["pending"] == terms["in_flight"] == 0 and terms["abandoned"] == 1
    assert check_all(h.state) == []
    with pytest.raises(MachinePoisoned):
        h.tick(allocated=4)
    with pytest.raises(MachinePoisoned):
        h.receipts({"flying": 1})


def test_ledger_closes_after_a_full_lifecycle() -> None:
    h = ea_harness(world_size=2, max_drain_per_step=3)
    h.tick(allocated=4)
    for req_id in ("a", "b", "c", "d"):
        h.arrive(req_id)
        h.offer_ops(req_id, 2)
    h.tick(allocated=4, reallocated=[(h.blocks_of["b"][1][0], None)])  # b loses op 2
    h.finish("a", "b", "c", free=100)
    ea_due(h, "a", ops=2)
    ea_due(h, "b")
    h.tick(allocated=4)
    h.receipts({"a": 2, "b": 2}, failed=["b"])
    h.preempt("d")
    h.reset_cache()
    h.shutdown()
    counters = h.state.counters
    terms = ledger_terms(h.state)
    assert counters["admitted_ops"] == 8 == sum(terms.values())
    assert (terms["stored"], terms["failed"], terms["dropped_evicted"],
            terms["dropped_preempted"], terms["dropped_cache_reset"]) == (2, 1, 1, 2, 2)
    assert terms["pending"] == 0 and h.pins == {}


# -- invalid events ----------------------------------------------------------------


def _snapshot(state: State) -> tuple[Any, ...]:
    """Everything in the state except ``closed`` (why the machine closed)."""
    poisoned, state.closed = state.closed, None
    try:
        canonical = canonical_state(state)
    finally:
        state.closed = poisoned
    scalars = tuple(
        (field.name, getattr(state, field.name))
        for field in attrs.fields(State)
        if field.name != "closed"
        and isinstance(getattr(state, field.name), int | float | str | bool | type(None))
    )
    return (canonical, scalars, tuple(state.awaiting_hashes), tuple(state.deadlines),
            tuple(sorted((b, len(holders(e))) for b, e in state.owners.items())),
            state.context is None)


def _after_a_selection(h: Harness) -> None:
    h.arrive("a")
    h.offer("a")
    h.finish("a", free=100)
    ea_due(h, "a")
    assert h.tick(allocated=4).of(OpsSelected)  # selected_in_step > 0 now


def _scheduled(time_s: float, **fields: Any) -> StepScheduled:
    """A step of 16 tokens at ``time_s`` that allocates nothing, with 100 blocks free
    and one in reserve; ``fields`` replace any of that."""
    return StepScheduled(**{
        "scheduled_tokens": 16, "allocated_blocks": 0, "next_step_blocks": 0,
        "reserve_blocks": 1, "free_blocks": 100, "window_block_ids": (), "reallocated": (),
        "time_s": time_s, **fields})


INVALID: dict[str, tuple[Callable[[Harness], Event], str]] = {
    "candidate_for_unknown_request": (
        lambda h: CandidateOffered(req_id="ghost", start_token=0, end_token=64,
                                   block_ids=(1, 2), block_hashes=(5, 6), time_s=0.0),
        "never arrived",
    ),
    "non_contiguous_range": (
        lambda h: CandidateOffered(req_id="live", start_token=128, end_token=192,
                                   block_ids=(1, 2), block_hashes=(5, 6), time_s=h.time_s),
        r"range starts at 128, expected 64",
    ),
    "empty_range": (
        lambda h: CandidateOffered(req_id="live", start_token=64, end_token=64,
                                   block_ids=(1,), block_hashes=(5,), time_s=h.time_s),
        "is empty",
    ),
    "hash_count_mismatch": (
        lambda h: CandidateOffered(req_id="live", start_token=64, end_token=128,
                                   block_ids=(1, 2), block_hashes=(5,), time_s=h.time_s),
        "2 block ids but 1 hashes",
    ),
    "hash_past_64_bits": (
        lambda h: CandidateOffered(req_id="live", start_token=64, end_token=128,
                                   block_ids=(1, 2), block_hashes=(5, 1 << 63), time_s=h.time_s),
        r"block ids and hashes must be integers from -2\*\*63 to 2\*\*63 - 1",
    ),
    "candidate_after_finish": (
        lambda h: CandidateOffered(req_id="a", start_token=64, end_token=128,
                                   block_ids=(1, 2), block_hashes=(5, 6), time_s=h.time_s),
        "after the request finished",
    ),
    "hashes_for_unknown_batch": (
        lambda h: HashesRead(batch_id=99, block_hashes=(1, 2)),
        "HashesRead arrived in phase open: no answer was asked for",
    ),
    "unrequested_free_queue_read": (
        lambda h: FreeQueueRead(window_block_ids=(1,)),
        "FreeQueueRead arrived in phase open: no answer was asked for",
    ),
    "window_of_wrong_length": (
        lambda h: _scheduled(h.time_s + 1, allocated_blocks=4, window_block_ids=FILLER[:3]),
        "window has 3 blocks, expected 10",
    ),
    "empty_step_with_a_window": (
        lambda h: _scheduled(h.time_s + 1, scheduled_tokens=0, reserve_blocks=0,
                             window_block_ids=FILLER[:1]),
        "empty step carries a window",
    ),
    "time_going_back": (
        lambda h: _scheduled(h.time_s - 1),
        "time went back",
    ),
    "negative_count": (
        lambda h: _scheduled(h.time_s + 1, allocated_blocks=-1),
        "negative count",
    ),
    "non_positive_receipt": (
        lambda h: ReceiptsArrived(completed=(("a", 0),), failed=()),
        "receipt count 0 is not positive",
    ),
    "finished_twice": (
        lambda h: RequestFinished(req_id="a", free_blocks=3),
        "finished twice",
    ),
    "finished_request_preempted": (
        lambda h: RequestPreempted(req_id="a"),
        "finished request was preempted",
    ),
}


def _invalid_setup() -> Harness:
    h = ea_harness()
    _after_a_selection(h)  # "a": finished, its batch in flight
    h.arrive("live")
    h.offer("live")
    return h


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_event_raises_naming_the_problem_and_poisons(case: str) -> None:
    h = _invalid_setup()
    make, message = INVALID[case]
    with pytest.raises(InvalidEvent, match=message) as raised:
        step(h.state, make(h))
    assert raised.value.reason in str(raised.value)
    assert h.state.closed is not None
    with pytest.raises(MachinePoisoned):
        step(h.state, RequestArrived(req_id="b"))
    with pytest.raises(MachinePoisoned):
        step(h.state, RequestArrived(req_id="b"))


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_event_leaves_the_state_unchanged(case: str) -> None:
    h = _invalid_setup()
    if case == "window_of_wrong_length":
        h.empty_step()  # last_step_tokens 0 before an (invalid) token step
    before = _snapshot(h.state)
    make, _message = INVALID[case]
    if case == "empty_step_with_a_window":
        assert h.state.selected_in_step > 0
    with pytest.raises(InvalidEvent):
        step(h.state, make(h))
    assert _snapshot(h.state) == before


def _hashes_asked() -> tuple[Harness, ReadHashes]:
    """A FIFO machine that selected ``a`` and waits for its hashes: the question."""
    h = fifo_now()
    h.arrive("a")
    h.offer("a")
    h.finish("a")
    outcome = step(h.state, _scheduled(5.0, free_blocks=0))
    return h, next(c for c in outcome.commands if isinstance(c, ReadHashes))


def test_observation_while_answers_are_outstanding_is_invalid() -> None:
    h, read = _hashes_asked()
    before = _snapshot(h.state)
    expected = "RequestArrived arrived in phase awaiting_answers: answers are outstanding"
    with pytest.raises(InvalidEvent, match=expected) as raised:
        step(h.state, RequestArrived(req_id="b"))
    assert f"batches [{read.batch_id}]" in str(raised.value)
    assert _snapshot(h.state) == before
    with pytest.raises(MachinePoisoned):
        step(h.state, HashesRead(batch_id=read.batch_id, block_hashes=(0, 0)))


def test_wrong_number_of_hashes_in_an_answer_is_invalid() -> None:
    h, read = _hashes_asked()
    with pytest.raises(InvalidEvent, match="1 hashes read, expected 2"):
        step(h.state, HashesRead(batch_id=read.batch_id, block_hashes=(1,)))
