"""EVICTION_AWARE's block -> op index and the losses it detects.

``State.owners`` maps each block id covered by a buffered op to that op, or
to a dict by op id when several ops share the block (a prefix-cache hit).
All holders of a block share its snapshot hash, kept beside it in
``State.owner_hashes`` (same keys): an op whose snapshot disagrees with the
indexed one proves the block was reallocated without a report, and the
earlier holders lost their data (:func:`index`).

Chunks, not blocks: ops are whole LMCache chunks, and a prefix-cache hit
re-offers the chunks other ops hold, so the blocks of a shared chunk have
the same holders. They share one entry (``state.Holders``, which names its
blocks and their hashes): an op joining or leaving such a chunk is one dict
update and two tuple comparisons, not a lookup, a hash check and an update
per block (on the roomy agentic trace 78 % of the blocks indexed were
already held, and the per-block index was a third of the fold). Where the
holders of a chunk's blocks part ways (a reallocated block, an op over part
of the chunk, one holding its blocks out of order), the entry is split into
one dict per block first, and the block-by-block rules below apply as before;
so the holders each block has, and their order, never depend on the sharing.

Incremental loss detection: the shell reports only the watched blocks
allocated this step, with their hash now; :func:`apply_reallocations`
checks each in O(1) and drops, with the rest of its request (prefix
closure), every buffered op whose block really changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import is_

from offload_fsm.buffer import after_buffer_change, count_drop, maybe_end
from offload_fsm.decisions import DropCause
from offload_fsm.hooks import Scope
from offload_fsm.pins import release_pinned
from offload_fsm.state import BlockHash, Holders, Op, State, holders


def index(state: State, op: Op, scope: Scope) -> None:
    ids, snapshot, size = op.block_ids, op.block_hashes, op.blocks_per_chunk
    if size < 2:
        _index_blocks(state, op, ids, snapshot, scope)
        return
    owners, hashes = state.owners, state.owner_hashes
    for start in range(0, len(ids), size):
        chunk, values = ids[start:start + size], snapshot[start:start + size]
        entry = owners.get(chunk[0])
        if type(entry) is Holders:
            if entry.blocks == chunk and entry.hashes == values:  # none reallocated
                entry[op.op_id] = op
                continue
        elif entry is None:
            if len(chunk) == size and not any(map(owners.__contains__, chunk)):
                owners.update(zip(chunk, repeat(op)))
                hashes.update(zip(chunk, values, strict=True))
                continue
        elif (type(entry) is Op and len(chunk) == size
              and all(map(is_, map(owners.get, chunk), repeat(entry)))
              and tuple(map(hashes.__getitem__, chunk)) == values):
            shared = Holders({entry.op_id: entry, op.op_id: op}, chunk, values)
            owners.update(zip(chunk, repeat(shared)))
            continue
        _index_blocks(state, op, chunk, values, scope)


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
    for member in shared.blocks:
        if owners.get(member) is shared:
            owners[member] = dict(shared)
    mine = owners[block_id]
    assert isinstance(mine, dict)
    return mine


def unindex(state: State, ops: Sequence[Op]) -> None:
    owners, hashes = state.owners, state.owner_hashes
    for op in ops:
        ids, size, op_id = op.block_ids, op.blocks_per_chunk, op.op_id
        at, end = 0, len(ids)
        while at < end:
            block_id = ids[at]
            entry = owners.get(block_id)
            at += 1
            if entry is op:
                del owners[block_id]
                del hashes[block_id]
                continue
            if type(entry) is Holders and op_id in entry:
                if entry.blocks == ids[at - 1:at - 1 + size]:  # the whole chunk at once
                    del entry[op_id]
                    if len(entry) == 1:
                        owners.update(zip(entry.blocks, repeat(next(iter(entry.values())))))
                    at += size - 1
                    continue
                entry = _split(owners, entry, block_id)
            if isinstance(entry, dict) and op_id in entry:
                del entry[op_id]
                if len(entry) == 1:
                    owners[block_id] = next(iter(entry.values()))


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
