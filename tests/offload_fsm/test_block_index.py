"""EVICTION_AWARE's block index shares one holders entry among the blocks of
a run of whole chunks (``state.Holders``): ops joining and leaving it in one
update, the run cut at a chunk boundary where an op joins part of it, and
the entry split back into one per block wherever the blocks' holders part
ways inside a chunk (a reallocated block, an op over part of a chunk, an op
that holds the chunk's blocks out of order). Every feed checks every invariant, the
shared entries' included; each test also states the holders it expects."""

from __future__ import annotations

import gc

from offload_fsm.state import Holders, Op, holders
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.events import RequestPreempted
from tests.offload_fsm.helpers import Harness, ea


def _holders(h: Harness, *blocks: int) -> dict[int, list[str]]:
    return {b: sorted(op.req.req_id for op in holders(h.state.owners.get(b))) for b in blocks}


def _offer(h: Harness, req: str, blocks: tuple[int, ...], **kwargs: object) -> None:
    h.offer(req, blocks=blocks, tokens=32 * len(blocks), blocks_per_chunk=4, **kwargs)


def _shared_by_a_and_b(blocks: int) -> tuple[Harness, tuple[int, ...]]:
    """Requests "a" and "b" each buffer one op over the same ``blocks`` blocks."""
    h = Harness(ea())
    h.arrive("a", "b")
    chunk = h.new_blocks(blocks)
    _offer(h, "a", chunk)
    _offer(h, "b", chunk)
    return h, chunk


def test_ops_sharing_a_chunk_join_and_leave_one_entry() -> None:
    h = Harness(ea())
    h.arrive("a", "b", "c")
    chunk = h.new_blocks(4)
    _offer(h, "a", chunk)
    assert all(h.state.owners[b] is h.state.owners[chunk[0]] for b in chunk)  # a's op
    _offer(h, "b", chunk)
    _offer(h, "c", chunk)
    shared = h.state.owners[chunk[0]]
    assert type(shared) is Holders and shared.block_ids == chunk and len(shared) == 3
    assert all(h.state.owners[b] is shared for b in chunk)
    h.feed(RequestPreempted(req_id="b"))
    assert _holders(h, *chunk) == dict.fromkeys(chunk, ["a", "c"])
    assert h.state.owners[chunk[0]] is shared
    h.feed(RequestPreempted(req_id="c"))
    assert _holders(h, *chunk) == dict.fromkeys(chunk, ["a"])
    assert type(h.state.owners[chunk[0]]) is not Holders


def test_a_block_reallocated_inside_a_shared_chunk_drops_its_holders() -> None:
    h = Harness(ea())
    h.arrive("a", "b", "c")
    chunk = h.new_blocks(4)
    _offer(h, "a", chunk)
    _offer(h, "b", chunk)
    changed = [h.hashes[b] for b in chunk]
    changed[2] = 999_999  # the third block holds other content now, unreported
    _offer(h, "c", chunk, hashes=changed)
    assert h.state.counters[Counter.DROPPED_EVICTED_OPS] == 2
    assert _holders(h, *chunk) == dict.fromkeys(chunk, ["c"])
    assert [h.state.owner_hashes[b] for b in chunk] == changed


def test_an_op_over_part_of_a_shared_chunk_splits_it() -> None:
    h = Harness(ea())
    h.arrive("a", "b", "c")
    chunk, more = h.new_blocks(4), h.new_blocks(2)
    _offer(h, "a", chunk)
    _offer(h, "b", chunk)
    _offer(h, "c", chunk[2:] + more)  # not aligned with a's and b's chunk
    assert _holders(h, *chunk, *more) == {
        chunk[0]: ["a", "b"], chunk[1]: ["a", "b"], chunk[2]: ["a", "b", "c"],
        chunk[3]: ["a", "b", "c"], more[0]: ["c"], more[1]: ["c"]}
    assert not any(type(h.state.owners[b]) is Holders for b in chunk)
    h.feed(RequestPreempted(req_id="a"))
    assert _holders(h, *chunk, *more) == {
        chunk[0]: ["b"], chunk[1]: ["b"], chunk[2]: ["b", "c"], chunk[3]: ["b", "c"],
        more[0]: ["c"], more[1]: ["c"]}


def test_an_op_holding_a_chunks_blocks_out_of_order_leaves_it_block_by_block() -> None:
    h = Harness(ea())
    h.arrive("a", "b")
    chunk, other = h.new_blocks(4), h.new_blocks(4)
    _offer(h, "a", (chunk[0], other[0], *chunk[1:], *other[1:]))  # not as a chunk of its own
    _offer(h, "b", chunk)
    shared = h.state.owners[chunk[0]]
    assert type(shared) is Holders and sorted(shared) == sorted(
        op.op_id for op in holders(shared))
    h.feed(RequestPreempted(req_id="a"))
    assert _holders(h, *chunk, *other) == {**dict.fromkeys(chunk, ["b"]),
                                           **dict.fromkeys(other, [])}


def test_a_snapshot_restores_shared_entries_as_one_per_block() -> None:
    from offload_fsm import check_all
    from offload_fsm.log import snapshot

    h, chunk = _shared_by_a_and_b(4)
    restored = snapshot.restore(snapshot.take(h.state), h.state.config)
    assert check_all(restored) == []
    assert not any(type(restored.owners[b]) is Holders for b in chunk)
    assert {b: sorted(restored.owners[b]) for b in chunk} == {  # type: ignore[arg-type]
        b: sorted(h.state.owners[b]) for b in chunk}  # type: ignore[arg-type]


def test_ops_sharing_a_run_of_chunks_share_one_entry_cut_where_they_part() -> None:
    h = Harness(ea())
    h.arrive("a", "b", "c", "d")
    run = h.new_blocks(12)  # three chunks
    _offer(h, "a", run)
    _offer(h, "b", run)
    shared = h.state.owners[run[0]]
    assert type(shared) is Holders and shared.block_ids == run
    assert all(h.state.owners[b] is shared for b in run)  # one entry, not one per chunk
    _offer(h, "c", run[:4])  # the first chunk only: the entry is cut after it
    _offer(h, "d", run[8:])  # from the third chunk on: cut again, where d starts
    entries = [h.state.owners[b] for b in (run[0], run[4], run[8])]
    assert [e.block_ids for e in entries] == [run[:4], run[4:8], run[8:]]  # type: ignore[union-attr]
    assert all(type(e) is Holders and all(h.state.owners[b] is e for b in e.block_ids)
               for e in entries)
    order = [[op.req.req_id for op in holders(e)] for e in entries]
    assert order == [["a", "b", "c"], ["a", "b"], ["a", "b", "d"]]  # joining order kept
    h.feed(RequestPreempted(req_id="a"))
    assert _holders(h, *run) == {**dict.fromkeys(run[:4], ["b", "c"]),
                                 **dict.fromkeys(run[4:8], ["b"]),
                                 **dict.fromkeys(run[8:], ["b", "d"])}
    assert type(h.state.owners[run[4]]) is not Holders  # one holder left: the op itself
    h.feed(RequestPreempted(req_id="b"))
    _offer(h, "b", run)  # b again: it rejoins c's and d's entries, and holds the middle
    assert _holders(h, *run) == {**dict.fromkeys(run[:4], ["b", "c"]),
                                 **dict.fromkeys(run[4:8], ["b"]),
                                 **dict.fromkeys(run[8:], ["b", "d"])}


def test_a_buffered_op_and_a_shared_run_hold_nothing_the_cyclic_gc_tracks_of_their_own(
) -> None:
    """A buffered op may wait thousands of steps, and every object of a GC type
    it keeps counts towards the next young collection: an op keeps its request
    and its status (shared, not its own), a shared run its ops; block ids and
    hashes are bytes, which the GC does not track. (A collection would stop
    tracking a tuple of ints it visits, so none runs here.)"""
    gc.disable()
    try:
        _check_held_objects()
    finally:
        gc.enable()


def _check_held_objects() -> None:
    h, chunk = _shared_by_a_and_b(8)
    op = h.state.requests["a"].ops[0]
    own = [r for r in gc.get_referents(op) if gc.is_tracked(r) and r is not Op]
    assert sorted(map(id, own)) == sorted(map(id, (op.req, op.status)))
    assert (op.block_ids, op.block_hashes) == (chunk, tuple(h.hashes[b] for b in chunk))
    shared = h.state.owners[chunk[0]]
    assert type(shared) is Holders
    ops = list(shared.values())
    assert [r for r in gc.get_referents(shared) if gc.is_tracked(r) and r is not Holders] == ops
