"""EVICTION_AWARE's block -> op index and the losses it detects.

``State.owners`` maps each block id covered by a buffered op to that op, or
to a dict by op id when several ops share the block (a prefix-cache hit).
All holders of a block share its snapshot hash, kept beside it in
``State.owner_hashes`` (same keys): an op whose snapshot disagrees with the
indexed one proves the block was reallocated without a report, and the
earlier holders lost their data (:func:`index`).

Runs of chunks, not blocks: ops are whole LMCache chunks, and a
prefix-cache hit re-offers the chunks other ops hold (a shared prefix of
dozens of chunks), so the blocks of a stretch of shared chunks have the same
holders. They share one entry (``state.Holders``, which names its blocks and
their hashes): an op joining or leaving such a run is one dict update and
two tuple comparisons, not a lookup, a hash check and an update per block or
per chunk (with shared prefixes most blocks indexed are already held, and an
index kept per block or per chunk is a large share of a replay's fold). A
run is cut at a chunk boundary where an op joins part of it (one that ends
inside it, or starts inside it), each part keeping the holders and their
order; blocks an op holds alone map to the op, and are indexed and dropped
a run at a time too. Where the holders of a run's blocks part ways inside a chunk (a
reallocated block, an op not aligned with the run's chunks, one holding its
blocks out of order), the entry is split into one dict per block first, and
the block-by-block rules below apply as before; so the holders each block
has, and their order, never depend on the sharing.

Incremental loss detection: the shell reports only the watched blocks
allocated this step, with their hash now; :func:`apply_reallocations`
checks each in O(1) and drops, with the rest of its request (prefix
closure), every buffered op whose block really changed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from itertools import compress, count, repeat
from operator import is_not

from offload_fsm.rules.buffer import after_buffer_change, count_drop, maybe_end
from offload_fsm.rules.pins import release_pinned
from offload_fsm.rules.scope import Scope
from offload_fsm.state import PACKED_INT_BYTES, Holders, Op, State, holders
from offload_fsm.vocabulary.decisions import DropCause
from offload_fsm.vocabulary.events import BlockHash


def index(state: State, op: Op, ids: tuple[int, ...], snapshot: tuple[int, ...],
          scope: Scope) -> None:
    """Index ``op`` (``ids`` and ``snapshot``: its block ids and their hashes, unpacked)."""
    size = op.blocks_per_chunk
    if size < 2:
        _index_blocks(state, op, ids, snapshot, scope)
        return
    owners, hashes = state.owners, state.owner_hashes
    start, end = 0, len(ids)
    while start < end:
        stop = min(start + size, end)
        entry = owners.get(ids[start])
        if type(entry) is Holders:
            joined = _joined_run(owners, entry, op, ids[start], start, size)
            if joined is not None:
                joined[op.op_id] = op
                start += joined.num_blocks
                continue
        elif entry is None:
            fresh = _fresh_run(owners, ids, start, size)
            if fresh:
                blocks = ids[start:start + fresh]
                owners.update(zip(blocks, repeat(op)))
                hashes.update(zip(blocks, snapshot[start:start + fresh], strict=True))
                start += fresh
                continue
        elif type(entry) is Op:
            run = _run_held_alone(owners, hashes, entry, ids, snapshot, start, size)
            if run:
                run_bytes = slice(start * PACKED_INT_BYTES, (start + run) * PACKED_INT_BYTES)
                shared = Holders({entry.op_id: entry, op.op_id: op},
                                 op.packed_ids[run_bytes], op.packed_hashes[run_bytes])
                owners.update(zip(ids[start:start + run], repeat(shared)))
                start += run
                continue
        _index_blocks(state, op, ids[start:stop], snapshot[start:stop], scope)
        start = stop


def _joined_run(owners: dict[int, Op | dict[int, Op]], shared: Holders, op: Op,
                block_id: int, start: int, size: int) -> Holders | None:
    """The entry, cut from ``shared`` at chunk boundaries where needed, whose
    blocks and hashes ``op``'s repeat from its block ``start`` (``block_id``)
    on, in whole chunks (the op joining it holds them all); None when not
    even one chunk does. Compares the packed bytes, a chunk's at a time."""
    first = start * PACKED_INT_BYTES
    if shared.packed_ids[:PACKED_INT_BYTES] != op.packed_ids[first:first + PACKED_INT_BYTES]:
        at = shared.block_ids.index(block_id)  # the op starts inside the run
        if at % size:
            return None
        shared = _cut(owners, shared, at)
    blocks, hashes = shared.packed_ids, shared.packed_hashes
    length, chunk = len(blocks), size * PACKED_INT_BYTES
    ids, snapshot = op.packed_ids[first:first + length], op.packed_hashes[first:first + length]
    if ids == blocks and snapshot == hashes:
        return shared
    matched = 0
    while (matched + chunk < length
           and ids[matched:matched + chunk] == blocks[matched:matched + chunk]
           and snapshot[matched:matched + chunk] == hashes[matched:matched + chunk]):
        matched += chunk
    if not matched:
        return None
    _cut(owners, shared, matched // PACKED_INT_BYTES)
    return shared


def _cut(owners: dict[int, Op | dict[int, Op]], shared: Holders, at: int) -> Holders:
    """Cut ``shared`` after its first ``at`` blocks (a chunk boundary): it keeps
    the front, a new entry with the same holders, in the same order, takes
    the rest; returns the rest."""
    cut = at * PACKED_INT_BYTES
    rest = Holders(dict(shared), shared.packed_ids[cut:], shared.packed_hashes[cut:])
    shared.cut(at)
    owners.update(zip(rest.block_ids, repeat(rest)))
    return rest


def _fresh_run(owners: dict[int, Op | dict[int, Op]], ids: tuple[int, ...], start: int,
               size: int) -> int:
    """How many blocks from ``start`` on, in whole chunks, no op holds yet
    (each once: a block listed twice ends the run before its chunk)."""
    rest = ids[start:]
    held = next(compress(count(), map(owners.__contains__, rest)), len(rest))
    run = held - held % size
    if run > size and len(set(rest[:run])) != run:
        run = size  # a block listed twice: chunk by chunk from here
    return run


def _run_held_alone(owners: dict[int, Op | dict[int, Op]], hashes: dict[int, BlockHash],
                    holder: Op, ids: tuple[int, ...], snapshot: tuple[BlockHash, ...],
                    start: int, size: int) -> int:
    """How many blocks from ``start`` on, in whole chunks, ``holder`` alone
    holds with the hashes of ``snapshot``: the run a second holder shares."""
    rest = ids[start:]
    alone = _leading_held(owners, rest, holder)
    run = alone - alone % size
    if tuple(map(hashes.__getitem__, rest[:run])) == snapshot[start:start + run]:
        return run
    same = 0  # a block whose content changed: the chunks before it
    while snapshot[start + same:start + same + size] == tuple(
            map(hashes.__getitem__, rest[same:same + size])):
        same += size
    return same


def _leading_held(owners: dict[int, Op | dict[int, Op]], blocks: tuple[int, ...],
                  holder: Op) -> int:
    """How many of ``blocks``, from the first, ``owners`` maps to ``holder``
    itself (it alone holds them)."""
    return next(compress(count(), map(is_not, map(owners.get, blocks), repeat(holder))),
                len(blocks))


def _index_blocks(state: State, op: Op, ids: tuple[int, ...],
                  snapshot: tuple[BlockHash, ...], scope: Scope) -> None:
    """Block by block: what :func:`index` does where a chunk is not shared
    whole (and where a block was reallocated without a report)."""
    owners, hashes = state.owners, state.owner_hashes
    for block_id, block_hash in zip(ids, snapshot, strict=True):
        entry = owners.get(block_id)
        if entry is None:
            owners[block_id] = op
            hashes[block_id] = block_hash
            continue
        if type(entry) is Holders:
            entry = _split(owners, entry, block_id)
        if hashes[block_id] != block_hash:
            # The block was reallocated without a report (e.g. a prefix-cache
            # reset): its earlier holders' data is gone.
            lose_holders(state, block_id, scope)
            owners[block_id] = op
            hashes[block_id] = block_hash
        elif isinstance(entry, Op):
            owners[block_id] = {entry.op_id: entry, op.op_id: op}
        else:
            entry[op.op_id] = op


def _split(owners: dict[int, Op | dict[int, Op]], shared: Holders, block_id: int
           ) -> dict[int, Op]:
    """Give each block of ``shared`` a dict of its own (their holders are
    about to part ways); returns ``block_id``'s."""
    for member in shared.block_ids:
        if owners.get(member) is shared:
            owners[member] = dict(shared)
    mine = owners[block_id]
    assert isinstance(mine, dict)
    return mine


def unindex(state: State, ops: Sequence[Op]) -> None:
    owners, hashes = state.owners, state.owner_hashes
    for op in ops:
        ids, op_id = op.block_ids, op.op_id
        at, end = 0, len(ids)
        while at < end:
            block_id = ids[at]
            entry = owners.get(block_id)
            at += 1
            if entry is op:  # with the blocks after it that it alone holds
                rest = ids[at - 1:]
                alone = rest[:_leading_held(owners, rest, op)]
                # (a block listed twice is gone the second time: nothing to pop)
                deque(map(owners.pop, alone, repeat(None)), maxlen=0)
                deque(map(hashes.pop, alone, repeat(None)), maxlen=0)
                at += len(alone) - 1
                continue
            if type(entry) is Holders and op_id in entry:
                run = entry.packed_ids
                first = (at - 1) * PACKED_INT_BYTES
                if run == op.packed_ids[first:first + len(run)]:  # the whole run at once
                    del entry[op_id]
                    if len(entry) == 1:
                        owners.update(zip(entry.block_ids, repeat(next(iter(entry.values())))))
                    at += entry.num_blocks - 1
                    continue
                entry = _split(owners, entry, block_id)
            if isinstance(entry, dict) and op_id in entry:
                del entry[op_id]
                if len(entry) == 1:
                    owners[block_id] = next(iter(entry.values()))


def unindex_all(state: State) -> None:
    """Every buffered op leaves (shutdown): the index empties at once, not
    an op at a time (the whole backlog leaves in that one step, and
    unindexing it op by op would be most of the step's cost)."""
    state.owners.clear()
    state.owner_hashes.clear()


def apply_reallocations(
    state: State, reallocated: Iterable[tuple[int, int | None]], scope: Scope
) -> None:
    """Only blocks allocated this step are checked, each in O(1) unless it
    really changed (all holders share one snapshot)."""
    hashes = state.owner_hashes
    for block_id, hash_now in reallocated:
        if hashes.get(block_id, hash_now) != hash_now:  # indexed, and changed
            lose_holders(state, block_id, scope)


def lose_holders(state: State, block_id: int, scope: Scope) -> None:
    """Every buffered op on ``block_id`` lost its data: drop each with the rest
    of its request (prefix closure) and break the chain."""
    for op in holders(state.owners.get(block_id)):
        rec = op.req
        if op not in rec.ops:
            continue  # already dropped with an earlier op of its request
        cut = rec.ops.index(op)
        lost = rec.ops[cut:]
        del rec.ops[cut:]
        unindex(state, lost)
        release_pinned(state, lost, scope)
        count_drop(state, rec, lost, DropCause.EVICTED, block_id, scope)
        rec.broken = True
        after_buffer_change(state, rec)
        maybe_end(state, rec, scope)
