"""EVICTION_AWARE's block -> op index and the losses it detects.

``State.owners`` maps each block id covered by a buffered op to that op, or
to a dict by op id when several ops share the block (a prefix-cache hit).
All holders of a block share its snapshot hash, kept beside it in
``State.owner_hashes`` (same keys): an op whose snapshot disagrees with the
indexed one proves the block was reallocated without a report, and the
earlier holders lost their data (:func:`index`).

Incremental loss detection: the shell reports only the watched blocks
allocated this step, with their hash now; :func:`apply_reallocations`
checks each in O(1) and drops, with the rest of its request (prefix
closure), every buffered op whose block really changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from offload_fsm.buffer import after_buffer_change, count_drop, maybe_end
from offload_fsm.decisions import DropCause
from offload_fsm.hooks import Scope
from offload_fsm.pins import release_pinned
from offload_fsm.state import Op, State, holders


def index(state: State, op: Op, scope: Scope) -> None:
    owners, hashes = state.owners, state.owner_hashes
    for block_id, block_hash in zip(op.block_ids, op.block_hashes, strict=True):
        entry = owners.get(block_id)
        if entry is None:
            owners[block_id] = op
            hashes[block_id] = block_hash
            continue
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


def unindex(state: State, ops: Sequence[Op]) -> None:
    owners = state.owners
    for op in ops:
        for block_id in op.block_ids:
            entry = owners.get(block_id)
            if entry is op:
                del owners[block_id]
                del state.owner_hashes[block_id]
            elif isinstance(entry, dict) and op.op_id in entry:
                del entry[op.op_id]
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
