"""EVICTION_AWARE drain policy: LMCache G3 semantics (reference §6.1-6.4,
§6.7) plus the core's own rules (pin cascade, pin budget, blind-window
shield, incremental validation).

Blocks of a finished request sit in the scripted free queue ``h.queue``
(eviction head first); ``FILLER`` blocks belong to nobody."""

from __future__ import annotations

import attrs
import pytest

from offload_fsm.invariants import ledger_terms
from offload_fsm.policies.ea_planner import OVERDUE_RANK, SHIELDED_RANK
from offload_fsm.queries import finish_waits, window_depth
from offload_fsm.state import holders
from offload_fsm.testing.synthetic import default_config, run_workload
from offload_fsm.vocabulary import commands, events
from offload_fsm.vocabulary.config import Policy
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.decisions import (
    DropCause,
    HoldReason,
    OpRejected,
    OpsDropped,
    OpsHeld,
    OpsSelected,
    OpsShielded,
    RejectReason,
    SelectReason,
    StoreSubmitted,
)
from offload_fsm.vocabulary.events import FreeQueueRead

from .helpers import Harness, ea

FILLER = tuple(range(10_000, 10_100))


def harness(**config: object) -> Harness:
    h = Harness(ea(**config))
    h.queue = list(FILLER)
    return h


def finished(h: Harness, req_id: str, ops: int = 1, **offer: object) -> list[int]:
    """A finished request with ``ops`` buffered ops; returns its blocks (they
    are not in the free queue until the test places them)."""
    h.arrive(req_id)
    h.offer_ops(req_id, ops, **offer)
    h.finish(req_id, free=len(h.visible()))
    return list(h.blocks_in(req_id))


def place(h: Harness, rank: int, *blocks: int) -> None:
    """Put blocks into the free queue at ``rank`` from the eviction head."""
    for offset, block in enumerate(blocks):
        h.queue.insert(rank + offset, block)


def selections(result) -> list[tuple[str, int, int, SelectReason, int]]:  # type: ignore[no-untyped-def]
    return [(d.req_id, d.start_token, d.end_token, d.reason, d.rank)
            for d in result.of(OpsSelected)]


# -- signals and the danger depth --------------------------------------------


def test_ema_alpha_03_first_step_seeds() -> None:
    h = harness()
    assert h.state.ema_blocks is None
    h.tick(allocated=4)
    assert h.state.ema_blocks == 4.0
    assert h.state.depth_blocks == 10  # ceil(4 * 2.5)
    h.tick(allocated=2)
    assert h.state.ema_blocks == pytest.approx(0.3 * 2 + 0.7 * 4)  # 3.4
    assert h.state.depth_blocks == 9  # ceil(8.5)
    h.tick(allocated=10)
    assert h.state.ema_blocks == pytest.approx(0.3 * 10 + 0.7 * 3.4)  # 5.38
    assert h.state.depth_blocks == 14  # ceil(13.45)


def test_empty_steps_do_not_touch_the_ema_or_the_depth() -> None:
    h = harness()
    h.tick(allocated=4)
    for _ in range(3):
        h.empty_step()
    assert h.state.ema_blocks == 4.0 and h.state.depth_blocks == 10
    assert h.state.counters["token_steps"] == 1


def test_depth_takes_the_larger_of_ema_and_next_step_estimate() -> None:
    h = harness()
    h.arrive("a")
    h.offer("a")  # something buffered: the window is read
    step = h.tick(allocated=2, next_blocks=6)
    assert h.state.depth_blocks == 15  # max(2, 6) * 2.5
    assert len(step.events[0].window_block_ids) == 15
    h.tick(allocated=8, next_blocks=1)
    assert h.state.depth_blocks == 10  # EMA 0.3*8 + 0.7*2 = 3.8 > 1 -> ceil(9.5)


def test_window_depth_query_matches_the_depth_after_the_step() -> None:
    h = harness()
    h.arrive("a")
    h.offer("a")
    for allocated, next_blocks in [(4, 0), (0, 3), (7, 1), (0, 0)]:
        expected = window_depth(h.state, scheduled_tokens=16, allocated_blocks=allocated,
                                next_step_blocks=next_blocks)
        step = h.tick(allocated=allocated, next_blocks=next_blocks)
        assert h.state.depth_blocks == expected
        assert len(step.events[0].window_block_ids) == expected
    assert window_depth(h.state, scheduled_tokens=0, allocated_blocks=9,
                        next_step_blocks=9) == 0


def test_nothing_buffered_means_no_window_walk_but_the_depth_still_tracks() -> None:
    h = harness()
    step = h.tick(allocated=2, next_blocks=6)
    assert step.events[0].window_block_ids == ()
    assert h.state.depth_blocks == 15


@pytest.mark.parametrize(("horizon", "depth"), [(0.4, 0), (0.49, 0), (0.5, 1), (0.8, 1), (1.2, 2)])
def test_depth_cutoff_at_half_a_block(horizon: float, depth: int) -> None:
    h = harness(horizon_steps=horizon)
    h.tick(allocated=1)
    assert h.state.depth_blocks == depth


def test_idle_never_drains() -> None:
    h = harness()
    blocks = finished(h, "a", ops=2)
    place(h, 0, *blocks)  # at the very eviction head
    for _ in range(20):
        step = h.tick(allocated=0, next_blocks=0)
        assert h.state.depth_blocks == 0
        assert step.events[0].window_block_ids == ()
        assert step.decisions == [] and step.commands == []
    assert len(h.state.requests["a"].ops) == 2


def test_depth_returns_to_zero_after_a_burst_decays() -> None:
    h = harness()
    h.tick(allocated=10)
    depths = [h.state.depth_blocks]
    for _ in range(30):
        h.tick(allocated=0)
        depths.append(h.state.depth_blocks)
    assert depths[0] == 25
    assert depths == sorted(depths, reverse=True)
    assert depths[-1] == 0
    first_zero = depths.index(0)
    # 10 * 0.7**n * 2.5 < 0.5  <=>  0.7**n < 0.02  <=>  n >= 11
    assert first_zero == 11
    assert all(d == 0 for d in depths[first_zero:])


# -- what is due, and in which order -----------------------------------------


def test_request_is_due_when_any_block_is_in_the_window_ranked_from_the_head() -> None:
    h = harness()
    a = finished(h, "a")
    b = finished(h, "b")
    far = finished(h, "far")
    place(h, 1, *b)  # ranks 1, 2
    place(h, 5, a[1])  # only a's second block is in the window, rank 5
    place(h, 40, *far)  # beyond the window
    step = h.tick(allocated=4)  # D = 10
    assert selections(step) == [("b", 0, 64, SelectReason.WINDOW, 1),
                                ("a", 0, 64, SelectReason.WINDOW, 5)]
    assert [c.req_id for c in step.of(commands.SubmitStore)] == ["b", "a"]
    assert "far" in h.state.pending


def test_due_front_segment_runs_through_the_last_due_op() -> None:
    h = harness()
    blocks = finished(h, "a", ops=4)
    place(h, 3, blocks[5])  # a block of the third op
    step = h.tick(allocated=4)
    selected = step.one(OpsSelected)
    assert (selected.start_token, selected.end_token, selected.ops) == (0, 192, 3)
    assert step.one(commands.SubmitStore).block_ids == tuple(blocks[:6])
    assert [(op.start_token, op.end_token) for op in h.state.requests["a"].ops] == [(192, 256)]


def test_earlier_safe_ops_go_with_a_due_later_op() -> None:
    h = harness()
    blocks = finished(h, "a", ops=2)
    place(h, 0, blocks[3])  # only the second op is at risk
    step = h.tick(allocated=4)
    submit = step.one(commands.SubmitStore)
    assert (submit.start_token, submit.end_token) == (0, 128)


def test_most_imminent_first_regardless_of_admission_order() -> None:
    h = harness()
    old = finished(h, "old")
    new = finished(h, "new")
    place(h, 7, *old)
    place(h, 2, *new)
    assert [d.req_id for d in h.tick(allocated=4).of(OpsSelected)] == ["new", "old"]


def test_equal_rank_ties_go_to_the_earlier_admitted_request() -> None:
    h = harness()
    shared = h.new_blocks(1)[0]
    h.arrive("first", "second")
    h.offer("first")  # admitted first: order 0
    h.offer("second", blocks=(shared, h.new_blocks(1)[0]))
    h.offer("first", blocks=(shared, h.new_blocks(1)[0]))  # indexed after second's op
    h.finish("first", "second")
    assert [op.req.req_id for op in holders(h.state.owners[shared])] == ["second", "first"]
    place(h, 0, shared)
    step = h.tick(allocated=4)
    assert [(d.req_id, d.rank, d.ops) for d in step.of(OpsSelected)] == [
        ("first", 0, 2), ("second", 0, 1)]


def test_max_drain_per_step_caps_ops_and_cuts_only_front_slices() -> None:
    h = harness(max_drain_per_step=2)
    a = finished(h, "a", ops=3)
    b = finished(h, "b")
    place(h, 0, *a)
    place(h, 8, *b)
    step = h.tick(allocated=4)
    selected = step.one(OpsSelected)
    assert (selected.req_id, selected.start_token, selected.end_token, selected.ops) == (
        "a", 0, 128, 2)
    held = step.one(OpsHeld)
    assert (held.req_id, held.ops, held.reason) == ("b", 1, HoldReason.DRAIN_CAP)
    assert h.state.counters["held_drain_cap"] == 1
    assert [(op.start_token, op.end_token) for op in h.state.requests["a"].ops] == [(128, 192)]
    # Next step: a's rest is blocked by its batch in flight; b goes.
    step = h.tick(allocated=4)
    assert [d.req_id for d in step.of(OpsSelected)] == ["b"]
    assert [(d.req_id, d.reason) for d in step.of(OpsHeld)] == [("a", HoldReason.IN_FLIGHT)]
    h.complete("a", "b")
    step = h.tick(allocated=4)
    assert [(d.req_id, d.start_token, d.end_token) for d in step.of(OpsSelected)] == [
        ("a", 128, 192)]


def test_finishing_does_not_flush_when_the_window_is_far() -> None:
    h = harness()
    h.tick(allocated=4)  # D = 10
    h.arrive("a")
    h.offer_ops("a", 2)
    finish = h.finish("a", free=len(h.visible()))  # 100 free >= D: no shield
    assert finish.decisions == [] and finish.commands == []
    h.queue.extend(b for op in h.blocks_of["a"] for b in op)  # freed to the tail
    for _ in range(5):
        assert h.tick(allocated=4).of(OpsSelected) == []
    assert len(h.state.requests["a"].ops) == 2


def test_unfinished_requests_drain_by_imminence_too() -> None:
    h = harness()
    h.arrive("live")
    h.offer_ops("live", 2)
    place(h, 0, h.blocks_of["live"][0][0])
    step = h.tick(allocated=4)
    assert selections(step) == [("live", 0, 64, SelectReason.WINDOW, 0)]


# -- losses ---------------------------------------------------------------------


def test_reallocated_block_drops_that_op_and_every_later_op() -> None:
    h = harness()
    h.arrive("a")
    h.offer_ops("a", 3)
    lost = h.blocks_of["a"][1][0]
    step = h.tick(allocated=4, reallocated=[(lost, 777_777)])
    dropped = step.one(OpsDropped)
    assert (dropped.cause, dropped.start_token, dropped.end_token, dropped.ops, dropped.tokens,
            dropped.block_id) == (DropCause.EVICTED, 64, 192, 2, 128, lost)
    rec = h.state.requests["a"]
    assert [(op.start_token, op.end_token) for op in rec.ops] == [(0, 64)]
    assert rec.broken
    later = h.offer("a")
    rejected = later.one(OpRejected)
    assert (rejected.reason, rejected.start_token, rejected.end_token) == (
        RejectReason.PREFIX_BROKEN, 192, 256)
    assert h.state.counters["rejected_prefix_broken_ops"] == 1
    assert h.state.counters["dropped_evicted_ops"] == 2
    # The surviving prefix stays storable.
    h.finish("a", free=len(h.visible()))
    place(h, 0, *h.blocks_of["a"][0])
    assert h.tick(allocated=4).one(commands.SubmitStore).end_token == 64


def test_reallocation_to_an_unwatched_block_or_same_hash_changes_nothing() -> None:
    h = harness()
    h.arrive("a")
    h.offer_ops("a", 2)
    kept = h.blocks_of["a"][0][0]
    step = h.tick(allocated=4, reallocated=[(kept, h.hashes[kept]), (55_555, None)])
    assert step.of(OpsDropped) == []
    assert len(h.state.requests["a"].ops) == 2


def test_reallocation_to_none_hash_is_a_loss() -> None:
    h = harness()
    h.arrive("a")
    h.offer_ops("a", 2)
    lost = h.blocks_of["a"][0][1]
    step = h.tick(allocated=4, reallocated=[(lost, None)])
    assert step.one(OpsDropped).ops == 2
    assert h.state.requests["a"].ops == []


def test_loss_is_seen_while_a_batch_is_in_flight() -> None:
    h = harness(max_drain_per_step=1)
    blocks = finished(h, "a", ops=3)
    place(h, 0, *blocks[:2])
    h.tick(allocated=4)  # op 1 in flight, ops 2-3 buffered
    step = h.tick(allocated=4, reallocated=[(blocks[2], None)])
    assert step.one(OpsDropped).ops == 2
    settle = h.complete("a")
    assert settle.one(commands.EndSession).req_id == "a"


def test_unhashed_candidate_is_rejected_and_breaks_the_chain() -> None:
    h = harness()
    h.arrive("a")
    h.offer("a")
    unhashed = h.offer("a", hashes=(4242, None))
    assert unhashed.one(OpRejected).reason is RejectReason.UNHASHED
    assert unhashed.commands == []
    after = h.offer("a")
    assert after.one(OpRejected).reason is RejectReason.PREFIX_BROKEN
    assert h.state.counters["rejected_unhashed_ops"] == 1
    assert h.state.counters["admitted_ops"] == 1  # rejections are outside the ledger
    # Ops buffered before the rejection stay storable.
    h.finish("a", free=len(h.visible()))
    place(h, 0, *h.blocks_of["a"][0])
    step = h.tick(allocated=4)
    assert (step.one(StoreSubmitted).start_token, step.one(StoreSubmitted).end_token) == (0, 64)


# -- the deferral deadline ------------------------------------------------------


def test_deadline_is_off_by_default() -> None:
    h = harness()
    assert h.state.config.max_deferral_seconds == 0.0
    finished(h, "a", ops=2, time_s=0.0)
    for _ in range(5):
        assert h.tick(allocated=0, dt_s=10_000.0).of(OpsSelected) == []


def test_overdue_request_emits_its_whole_buffer_even_at_depth_zero() -> None:
    h = harness(max_deferral_seconds=5.0)
    blocks = finished(h, "a", ops=3, time_s=0.0)
    assert h.tick(allocated=0, dt_s=4.0).of(OpsSelected) == []  # t=4: not yet
    step = h.tick(allocated=0, dt_s=1.0)  # t=5: 0 + 5 <= 5
    assert h.state.depth_blocks == 0
    assert selections(step) == [("a", 0, 192, SelectReason.OVERDUE, OVERDUE_RANK)]
    assert step.one(commands.SubmitStore).block_ids == tuple(blocks)
    assert step.of(commands.ReadFreeQueue) == []  # nothing to cascade at depth 0
    assert h.state.counters["selected_overdue_ops"] == 3


def test_overdue_respects_the_drain_cap() -> None:
    h = harness(max_deferral_seconds=1.0, max_drain_per_step=2)
    finished(h, "a", ops=3, time_s=0.0)
    step = h.tick(allocated=0, dt_s=2.0)
    assert step.one(OpsSelected).ops == 2


def test_at_risk_outranks_overdue() -> None:
    h = harness(max_deferral_seconds=1.0, max_drain_per_step=1)
    finished(h, "old", time_s=0.0)
    risky = finished(h, "risky", time_s=0.0)
    h.time_s = 10.0
    place(h, 4, *risky)
    step = h.tick(allocated=4)
    assert selections(step) == [("risky", 0, 64, SelectReason.WINDOW, 4)]
    held = step.one(OpsHeld)
    assert (held.req_id, held.reason) == ("old", HoldReason.DRAIN_CAP)


def test_overdue_and_at_risk_request_emits_only_its_due_segment() -> None:
    h = harness(max_deferral_seconds=1.0)
    blocks = finished(h, "a", ops=3, time_s=0.0)
    place(h, 0, blocks[0])
    step = h.tick(allocated=4, dt_s=10.0)
    assert selections(step) == [("a", 0, 64, SelectReason.WINDOW, 0)]
    assert len(h.state.requests["a"].ops) == 2


def test_deadline_is_measured_from_the_front_op() -> None:
    h = harness(max_deferral_seconds=5.0)
    h.arrive("a")
    h.offer("a", time_s=0.0)
    h.time_s = 3.0
    h.offer("a", time_s=3.0)
    step = h.tick(allocated=0, dt_s=2.0)  # t=5: the front (t=0) is overdue
    assert step.one(OpsSelected).ops == 2  # the whole buffer, the young op too
    h.complete("a")
    h.offer("a", time_s=h.time_s)  # t=5: a fresh front restarts the clock
    assert h.tick(allocated=0, dt_s=4.0).of(OpsSelected) == []  # t=9
    assert h.tick(allocated=0, dt_s=1.0).one(OpsSelected).reason is SelectReason.OVERDUE


def test_overdue_request_with_a_batch_in_flight_waits() -> None:
    h = harness(max_deferral_seconds=1.0, max_drain_per_step=1)
    finished(h, "a", ops=2, time_s=0.0)
    assert h.tick(allocated=0, dt_s=2.0).one(OpsSelected).ops == 1
    assert h.tick(allocated=0, dt_s=2.0).of(OpsSelected) == []  # blocked
    h.complete("a")
    assert h.tick(allocated=0, dt_s=2.0).one(OpsSelected).reason is SelectReason.OVERDUE


# -- the pin cascade ------------------------------------------------------------


@pytest.mark.parametrize(("lookahead", "depths"), [
    (0, [4, 4]),  # a read after a's pins, and one after b's
    # One read, after b's pins it still shows a whole window. It goes past D=4 by the
    # 98 blocks of pin headroom a's pins left (the step's budget: at most that many
    # more queued blocks can be protected), not by the 1024 allowed.
    (1024, [4 + 98]),
    (20, [4 + 20]),
])
def test_pin_cascade_rereads_the_window_and_selects_newly_visible_blocks(
    lookahead: int, depths: list[int]
) -> None:
    h = harness(horizon_steps=2.0, cascade_lookahead_blocks=lookahead)
    a = finished(h, "a")
    b = finished(h, "b")
    place(h, 0, *a)  # window (D=4): a0 a1 f0 f1
    place(h, 4, *b)  # just behind the window
    step = h.tick(allocated=2)
    assert h.state.depth_blocks == 4
    assert selections(step) == [("a", 0, 64, SelectReason.WINDOW, 0),
                                ("b", 0, 64, SelectReason.CASCADE, 2)]
    reads = step.of(commands.ReadFreeQueue)
    assert [r.depth_blocks for r in reads] == depths
    answers = step.of(FreeQueueRead)
    assert answers[0].window_block_ids[:4] == (FILLER[0], FILLER[1], *b)
    assert [c.req_id for c in step.of(commands.SubmitStore)] == ["a", "b"]
    assert h.state.counters["selected_cascade_ops"] == 1
    # The read comes after the protections it accounts for.
    issued = step.commands
    assert issued.index(reads[0]) > issued.index(step.of(commands.ProtectBlocks)[0])


def test_cascade_rounds_go_on_from_one_read_and_read_again_when_it_runs_short() -> None:
    # a's pins pull b into the window, b's pull c in, c's pull d in: three cascade
    # rounds. A read 5 blocks past D=4 shows 9 blocks: it has room for b's and c's
    # pins (the window after them is still in it), not for d's round.
    h = harness(horizon_steps=2.0, cascade_lookahead_blocks=5)
    a, b, c, d = (finished(h, name) for name in "abcd")
    place(h, 0, *a)  # a0 a1 f0 f1 | b0 b1 c0 c1 d0 d1 f2 ...
    place(h, 4, *b, *c, *d)
    step = h.tick(allocated=2)
    assert [(req, reason) for req, _, _, reason, _ in selections(step)] == [
        ("a", SelectReason.WINDOW), ("b", SelectReason.CASCADE),
        ("c", SelectReason.CASCADE), ("d", SelectReason.CASCADE)]
    assert [r.depth_blocks for r in step.of(commands.ReadFreeQueue)] == [9, 9]
    first, second = step.of(FreeQueueRead)
    assert first.window_block_ids == (FILLER[0], FILLER[1], *b, *c, *d, FILLER[2])
    assert second.window_block_ids[:4] == (*FILLER[:2], *FILLER[2:4])
    assert h.state.counters["selected_cascade_ops"] == 3


@pytest.mark.parametrize("lookahead", [0, 1024])
def test_a_planned_block_dedup_leaves_unprotected_stays_in_the_window(lookahead: int) -> None:
    # b's pick plans blocks 2 and 3; 2's content is stored, so dedup trims it and only
    # 3 is protected. 2 stays in the free queue: the next window is F0 F1 2 F2, and c
    # (behind F2) is not in it, read again or not.
    h = harness(horizon_steps=2.0, cascade_lookahead_blocks=lookahead)
    h.arrive("a", "b", "c", "x")

    def offer(req_id: str, blocks: tuple[int, int], hashes: tuple[int, int]) -> None:
        h.hashes.update(zip(blocks, hashes, strict=True))
        h.offer(req_id, blocks=blocks, hashes=hashes, tokens=64, blocks_per_chunk=1)

    offer("a", (0, 1), (101, 102))
    h.queue = [0, 1]
    h.tick(allocated=1, next_blocks=1, requests=0)
    h.complete("a")  # content 101 is stored
    offer("x", (6, 7), (106, 107))
    offer("b", (2, 3), (101, 103))
    offer("c", (4, 5), (104, 105))
    h.finish("x", "b", "c")
    h.queue = [6, 7, FILLER[0], FILLER[1], 2, 3, FILLER[2], 4, 5, *FILLER[3:]]
    step = h.tick(allocated=1, next_blocks=2, requests=0)
    assert h.state.depth_blocks == 4
    assert [(d.req_id, d.reason, d.rank) for d in step.of(OpsSelected)] == [
        ("x", SelectReason.WINDOW, 0), ("b", SelectReason.CASCADE, 2)]
    assert [(d.req_id, d.cause) for d in step.of(OpsDropped)] == [("b", DropCause.DUPLICATE)]


@pytest.mark.parametrize("seed", range(6))
def test_the_cascade_decides_the_same_with_any_lookahead(seed: int) -> None:
    """A read past D changes how often the free queue is read, not what is
    decided: the same selections in the same order, and the same decisions
    overall (a batch's hash check now answers after the rounds of its read,
    not between them)."""
    def decisions(lookahead: int) -> tuple[list[object], int, dict[object, int]]:
        config = attrs.evolve(default_config(), max_drain_per_step=64,
                              cascade_lookahead_blocks=lookahead)
        world = run_workload(requests=60, seed=seed, config=config, pool_blocks=200,
                             concurrency=6, max_chunks=8)
        made = [d for _, outcome in world.applied for d in outcome.decisions]
        made = [d for d in made if isinstance(d, OpsSelected)] + sorted(map(repr, made))
        reads = sum(isinstance(event, FreeQueueRead) for event, _ in world.applied)
        counters = {k: v for k, v in world.state.counters.items()
                    if k is not Counter.WINDOW_BLOCKS_READ}
        return made, reads, counters
    once, reads_once, counters_once = decisions(0)
    assert reads_once > 0, "the workload has no cascade to compare"
    fewer = []
    for lookahead in (2, 64):
        made, reads, counters = decisions(lookahead)
        assert made == once
        assert counters == counters_once
        assert reads <= reads_once
        fewer.append(reads < reads_once)
    assert fewer[-1], "a read 64 blocks deep never saved one"


def test_no_cascade_when_no_window_block_was_pinned() -> None:
    h = harness(max_deferral_seconds=1.0)
    finished(h, "a", time_s=0.0)  # overdue, blocks not in the free-queue window
    step = h.tick(allocated=4, dt_s=5.0)
    assert step.one(OpsSelected).reason is SelectReason.OVERDUE
    assert step.of(commands.ReadFreeQueue) == []


def test_cascade_stops_when_the_cap_is_spent() -> None:
    h = harness(horizon_steps=2.0, max_drain_per_step=1)
    a = finished(h, "a")
    b = finished(h, "b")
    place(h, 0, *a)
    place(h, 4, *b)
    step = h.tick(allocated=2)
    assert [d.req_id for d in step.of(OpsSelected)] == ["a"]
    assert step.of(commands.ReadFreeQueue) == []


# -- the pin budget -------------------------------------------------------------


def test_pin_budget_holds_when_free_blocks_cannot_cover_the_queued_blocks() -> None:
    h = harness()
    h.queue = []
    a = finished(h, "a")
    place(h, 0, *a, FILLER[0])  # 3 free blocks, all in the window
    step = h.tick(allocated=4, requests=1)  # headroom 3 - 2 * 1 * (1 + 1) < 2 blocks
    held = step.one(OpsHeld)
    assert (held.req_id, held.ops, held.reason) == ("a", 1, HoldReason.PIN_BUDGET)
    assert step.of(OpsSelected) == [] and step.of(commands.ProtectBlocks) == []
    assert h.state.counters["held_pin_budget"] == 1
    step = h.tick(allocated=4, requests=0)  # headroom 3
    assert step.one(OpsSelected).req_id == "a"


def test_pin_budget_takes_a_front_slice_that_fits() -> None:
    h = harness()
    h.queue = []
    a = finished(h, "a", ops=2)
    place(h, 0, *a, *FILLER[:2])  # 6 free
    step = h.tick(allocated=4, requests=1)  # headroom 6 - 4 = 2: one op (2 blocks) fits
    selected = step.one(OpsSelected)
    assert (selected.start_token, selected.end_token) == (0, 64)


def test_pin_budget_charges_live_requests_only_for_window_blocks() -> None:
    h = harness()
    h.queue = list(FILLER[:4])
    h.arrive("live")
    h.offer("live")
    place(h, 0, h.blocks_of["live"][0][0])  # one of its blocks is in the queue
    step = h.tick(allocated=4, requests=1)  # 5 free - 2 * 1 * 2 = 1: enough for one block
    assert step.one(OpsSelected).req_id == "live"


def test_pin_budget_charges_a_block_two_selections_share_once() -> None:
    h = harness()
    h.queue = [1, 2, 3]
    h.hashes.update({1: 501, 2: 502, 3: 503})
    h.arrive("a", "b")
    h.offer("a", blocks=(1, 2))
    h.offer("b", blocks=(1, 3))  # a prefix-cache hit on block 1
    h.finish("a", "b", free=3)
    step = h.tick(allocated=2, requests=0)  # headroom 3: pinning both takes 3 blocks
    assert [d.req_id for d in step.of(OpsSelected)] == ["a", "b"]
    assert step.of(OpsHeld) == []
    assert [c.req_id for c in step.of(commands.SubmitStore)] == ["a", "b"]


def test_pin_budget_does_not_charge_a_block_already_protected() -> None:
    h = harness()
    h.queue = [1, 2, 3, 4]
    h.hashes.update({1: 501, 2: 502, 3: 503, 4: 504})
    h.arrive("a")
    h.offer("a", blocks=(1, 2))
    h.finish("a", free=4)
    h.tick(allocated=2, requests=0)  # a in flight: blocks 1 and 2 protected
    h.arrive("b")
    h.offer("b", blocks=(1, 3))
    h.finish("b", free=10)  # no shield: the freed blocks land beyond the reach
    step = h.tick(allocated=2, requests=0, free=1, window=(3,))  # headroom 1: block 3
    assert step.one(OpsSelected).req_id == "b"


# -- the blind-window shield ----------------------------------------------------


def shield_setup(h: Harness) -> tuple[int, ...]:
    h.tick(allocated=4, requests=2)  # D = 10, reserve 2
    h.arrive("a")
    h.offer_ops("a", 2)
    return h.blocks_in("a")


def test_shield_at_finish_when_freed_blocks_land_inside_the_window() -> None:
    h = harness()
    blocks = shield_setup(h)
    result = h.finish("a", free=5)  # reserve 2 <= 5 < D 10
    shielded = result.one(OpsShielded)
    assert (shielded.req_id, shielded.ops, shielded.blocks, shielded.free_blocks,
            shielded.reach_blocks) == ("a", 2, 4, 5, 10)
    protect = result.one(commands.ProtectBlocks)
    assert protect.block_ids == blocks
    assert h.state.counters["shielded_ops"] == 2
    assert list(h.state.shielded) == ["a"]


@pytest.mark.parametrize("free", [10, 50])
def test_no_shield_when_window_is_far(free: int) -> None:
    h = harness()
    shield_setup(h)
    result = h.finish("a", free=free)  # >= D
    assert result.of(OpsShielded) == [] and result.commands == []


@pytest.mark.parametrize("free", [1, 5, 9, 10, 29, 50])
@pytest.mark.parametrize("passed_allocated", [None, 0, 30])
def test_a_finish_waits_exactly_when_applying_it_would_shield_nothing(
        free: int, passed_allocated: int | None) -> None:
    """``queries.finish_waits``, asked with the passed steps the shell holds
    (none; one that lets the depth and peak decay; one whose allocation
    raises the peak), against the finish applied after them."""
    h = harness()
    shield_setup(h)
    passed: tuple[events.PassedStep, ...] = ()
    if passed_allocated is not None:
        depth = window_depth(h.state, scheduled_tokens=16, allocated_blocks=passed_allocated,
                             next_step_blocks=0)
        passed = ((16, passed_allocated, 0, 2, 100, depth, h.time_s + 1.0),)
    waits = finish_waits(h.state, "a", free_blocks=free, next_step_max_blocks=0, passed=passed)
    if passed:
        h.feed(events.StepsPassed(steps=passed))
    shielded = h.finish("a", free=free).of(OpsShielded)
    assert waits == (shielded == [])


def test_under_fifo_every_finish_waits() -> None:
    h = Harness(default_config(Policy.FIFO), world_size=1)
    h.arrive("a")
    h.offer("a")
    assert finish_waits(h.state, "a", free_blocks=0, next_step_max_blocks=0, passed=())


def test_shield_below_the_reserve_takes_only_the_front_that_leaves_it() -> None:
    h = harness()
    blocks = shield_setup(h)
    result = h.finish("a", free=1)  # 1 + 4 freed - reserve 2: 3 blocks may be protected
    shielded = result.one(OpsShielded)
    assert (shielded.ops, shielded.blocks) == (1, 2)
    assert result.one(commands.ProtectBlocks).block_ids == blocks[:2]


def test_no_shield_at_depth_zero() -> None:
    h = harness()
    h.tick(allocated=0, requests=0)
    h.arrive("a")
    h.offer("a")
    assert h.finish("a", free=0).of(OpsShielded) == []


def test_shielded_request_is_selected_first_and_not_protected_twice() -> None:
    h = harness(max_drain_per_step=2)
    blocks = shield_setup(h)
    h.finish("a", free=5)
    h.queue.extend(blocks)  # freed: at the tail, but protected
    b = finished(h, "b")
    place(h, 0, *b)  # b is at the eviction head
    step = h.tick(allocated=4)
    assert [(d.req_id, d.reason, d.rank, d.ops) for d in step.of(OpsSelected)] == [
        ("a", SelectReason.SHIELDED, SHIELDED_RANK, 2)]
    assert [(d.req_id, d.reason) for d in step.of(OpsHeld)] == [("b", HoldReason.DRAIN_CAP)]
    assert step.of(commands.ProtectBlocks) == []
    assert step.one(commands.ReadHashes).block_ids == blocks
    assert step.one(commands.SubmitStore).block_ids == blocks
    assert h.state.counters["selected_shielded_ops"] == 2
    assert h.state.counters["protected_blocks"] == 4
    settle = h.complete("a")
    assert settle.one(commands.ReleaseBlocks).block_ids == blocks
    assert settle.one(commands.EndSession).req_id == "a"
    assert h.state.shielded == {} and h.pins == {}


def test_shielded_request_is_selected_under_a_zero_pin_budget() -> None:
    h = harness()
    blocks = shield_setup(h)
    h.finish("a", free=5)
    h.queue = []
    step = h.tick(allocated=4, requests=0)
    assert step.one(OpsSelected).reason is SelectReason.SHIELDED
    assert step.one(commands.SubmitStore).block_ids == blocks


# -- incremental validation -----------------------------------------------------


def test_step_cost_does_not_touch_buffered_ops_outside_the_window() -> None:
    h = harness()
    for i in range(50):
        h.arrive(f"r{i}")
        h.offer_ops(f"r{i}", 3)
    for step_index in range(1, 6):
        step = h.tick(allocated=4)
        assert step.of(OpsSelected) == [] and step.commands == []
        assert h.state.counters["window_blocks_read"] == 10 * step_index
    assert h.state.counters["blocks_checked"] == 0


def test_unreported_hash_change_stays_buffered_until_due_then_drops_as_stale() -> None:
    h = harness()
    blocks = finished(h, "a", ops=2)
    h.queue.extend(blocks)  # far from the head
    h.hashes[blocks[0]] = 31_337  # changed, but never reported as reallocated
    for _ in range(3):
        step = h.tick(allocated=4)
        assert step.decisions == []
    assert len(h.state.requests["a"].ops) == 2
    h.queue.remove(blocks[0])
    place(h, 0, blocks[0])
    step = h.tick(allocated=4)
    assert step.one(OpsSelected).ops == 1
    assert step.of(commands.SubmitStore) == []
    dropped = [(d.cause, d.start_token, d.end_token, d.block_id) for d in step.of(OpsDropped)]
    # The selected op is stale; the held-back op behind it loses its prefix.
    assert dropped == [(DropCause.STALE, 0, 64, blocks[0]), (DropCause.STALE, 64, 128, -1)]
    assert step.one(commands.EndSession).req_id == "a"
    assert h.state.counters["blocks_checked"] == 2
    assert ledger_terms(h.state)["dropped_stale"] == 2
