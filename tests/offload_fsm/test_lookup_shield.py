"""The lookup shield (issue 37): at a waiting request's answered lookup
(``LookupAnswered``), EVICTION_AWARE protects the buffered ops whose blocks
the request's coming allocation can reach, within the pin headroom that
leaves the allocation and the running requests' reserve in the free queue;
the step's drain then selects them first. FIFO refuses the event, and the
core checks what the log can check of the shell's walk."""

from __future__ import annotations

import pytest

from offload_fsm import InvalidEvent
from offload_fsm.vocabulary.commands import ProtectBlocks, SubmitStore
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.decisions import OpSplit, OpsSelected, OpsShielded, SelectReason
from offload_fsm.vocabulary.events import LookupAnswered

from .helpers import Harness, Result, ea, fifo

FILLER = tuple(range(10_000, 10_100))


def walk(h: Harness, allocation: int) -> tuple[int, ...]:
    """The shell's walk (``connector.shell.lookahead.reach``) over the scripted
    queue: the head through the ``allocation``-th block no buffered op covers."""
    out: list[int] = []
    left = allocation
    for block in h.visible():
        if not left:
            break
        out.append(block)
        if block not in h.state.owners:
            left -= 1
    return tuple(out)


def lookup(h: Harness, allocation: int, *, req_id: str = "w", free: int | None = None,
           window: tuple[int, ...] | None = None) -> Result:
    return h.feed(LookupAnswered(
        req_id=req_id, allocation_blocks=allocation,
        free_blocks=len(h.visible()) if free is None else free,
        window_block_ids=walk(h, allocation) if window is None else window))


def finished_at(h: Harness, req_id: str, rank: int, ops: int = 1) -> list[tuple[int, ...]]:
    """A finished request of ``ops`` ops whose blocks sit at ``rank`` on."""
    h.arrive(req_id)
    h.offer_ops(req_id, ops)
    h.finish(req_id, free=len(h.visible()))  # depth 0: no shield at finish
    placed = h.blocks_of[req_id]
    at = rank
    for blocks in placed:
        for block in blocks:
            h.queue.insert(at, block)
            at += 1
    return placed


def base() -> Harness:
    h = Harness(ea())
    h.queue = list(FILLER)
    h.arrive("w")  # the request that looks up
    return h


def test_the_ops_an_allocation_reaches_are_protected_and_drained_first() -> None:
    h = base()
    (a,) = finished_at(h, "a", rank=5)
    (b,) = finished_at(h, "b", rank=40)
    result = lookup(h, allocation=10)  # reaches ranks 0-11: a's blocks, not b's
    shielded = result.one(OpsShielded)
    assert (shielded.req_id, shielded.ops, shielded.blocks, shielded.reach_blocks) == \
        ("a", 1, 2, 12)
    assert result.one(ProtectBlocks).block_ids == a
    assert set(h.state.pins) == set(a)
    assert not set(b) & set(h.state.pins)
    assert h.state.counters[Counter.LOOKUP_SHIELDED_OPS] == 1
    assert h.state.counters[Counter.SHIELDED_OPS] == 0  # the finish-time shield's own
    step = h.tick(allocated=10)
    selected = step.one(OpsSelected)
    assert (selected.req_id, selected.reason) == ("a", SelectReason.SHIELDED)
    assert step.one(SubmitStore).block_ids == a


def test_an_allocation_short_of_every_buffered_block_protects_nothing() -> None:
    h = base()
    finished_at(h, "a", rank=12)
    result = lookup(h, allocation=10)  # ranks 0-9: a sits at 12
    assert result.of(OpsShielded) == [] and result.commands == []
    assert h.state.pins == {}


def test_prefix_closure_protects_the_front_ops_before_the_reached_one() -> None:
    h = base()
    h.arrive("a")
    h.offer_ops("a", 3)
    h.finish("a", free=len(h.visible()))
    first, second, third = h.blocks_of["a"]
    h.queue[50:50] = [*first, *third]
    h.queue[3:3] = list(second)  # only the second op's blocks are within reach
    result = lookup(h, allocation=8)
    assert result.one(OpsShielded).ops == 2
    assert set(h.state.pins) == {*first, *second}


def test_the_headroom_leaves_the_allocation_and_the_reserve() -> None:
    h = base()
    finished_at(h, "a", rank=0, ops=3)  # six queued blocks at the head
    h.tick(requests=1)  # the reserve: 2 * 1 * (1 + 1) = 4 blocks
    free = len(h.visible())
    # headroom = free - allocation - reserve = 4: two of the three ops (the
    # third op's two blocks would cross it)
    result = lookup(h, allocation=free - 8, free=free)
    assert result.one(OpsShielded).ops == 2
    assert len(h.state.pins) == 4


def test_no_headroom_no_protection() -> None:
    h = base()
    finished_at(h, "a", rank=0)
    free = len(h.visible())
    result = lookup(h, allocation=free - 2, free=free)  # headroom 2: the op's 2 blocks fit
    assert result.one(OpsShielded).blocks == 2
    h2 = base()
    finished_at(h2, "a", rank=0)
    free = len(h2.visible())
    result = lookup(h2, allocation=free - 1, free=free)  # headroom 1: nothing fits
    assert result.of(OpsShielded) == [] and h2.state.pins == {}


def test_the_op_that_crosses_the_headroom_is_cut_to_a_chunk_prefix() -> None:
    h = base()
    h.arrive("a")
    blocks = h.new_blocks(8)
    h.offer("a", blocks=blocks, tokens=256, blocks_per_chunk=2)
    h.finish("a", free=len(h.visible()))
    h.queue[0:0] = list(blocks)
    free = len(h.visible())
    result = lookup(h, allocation=free - 5, free=free)  # headroom 5: two chunks
    split = result.one(OpSplit)
    assert split.front_blocks == 4
    assert result.one(ProtectBlocks).block_ids == blocks[:4]
    assert result.one(OpsShielded).ops == 1


def test_fifo_refuses_a_lookup() -> None:
    h = Harness(fifo(), check=False)
    h.queue = list(FILLER)
    h.arrive("w")
    with pytest.raises(InvalidEvent, match="FIFO takes no LookupAnswered"):
        lookup(h, allocation=2, window=FILLER[:2])


@pytest.mark.parametrize(("allocation", "window", "free", "why"), [
    (0, FILLER[:1], 100, "positive allocation"),
    (2, FILLER[:3], 100, "expected allocation_blocks=2"),
    (2, FILLER[:1], 100, "expected allocation_blocks=2"),
    (2, (FILLER[0], FILLER[0]), 100, "distinct"),
    (3, FILLER[:2], 1, "no more than the queue"),
])
def test_a_walk_the_log_cannot_have_read_is_refused(
        allocation: int, window: tuple[int, ...], free: int, why: str) -> None:
    h = base()
    h.check = False
    with pytest.raises(InvalidEvent, match=why):
        lookup(h, allocation=allocation, window=window, free=free)


def test_a_walk_that_read_the_whole_queue_may_hold_fewer_blocks() -> None:
    h = base()
    h.queue = list(FILLER[:3])
    finished_at(h, "a", rank=1)
    result = lookup(h, allocation=10)  # accepted; an allocation past the queue leaves no headroom
    assert result.of(OpsShielded) == [] and h.state.pins == {}


def test_a_protected_block_in_the_walk_is_refused() -> None:
    h = base()
    (a,) = finished_at(h, "a", rank=0)
    lookup(h, allocation=4)
    h.check = False
    with pytest.raises(InvalidEvent, match="the core protects it"):
        lookup(h, allocation=2, window=(a[0], FILLER[0], FILLER[1]))
