"""Chunk-granularity selection: cut a buffered op at a chunk boundary.

The tracker offers a prefix-cache-hit prefix as one op, up to hundreds of
blocks. A pin budget (``ea_planner``) or a shield at finish
(``eviction_aware``) that cannot protect all of it would protect none of it,
and the whole op is lost as soon as any of its blocks is reallocated. LMCache
retrieves by prefix, so a stored chunk prefix is useful on its own; a chunk
without its stored prefix is not. The rule: when an op does not fit, take
its longest chunk-aligned *prefix* that fits (:func:`fitting_prefix`), never
all of it and never less than one chunk, and cut the op there (:func:`split`).

The rest stays buffered, as a new op right behind the front: it is stored
later if its blocks survive (the next step's headroom, or a shield released
by the front's store), and dropped ``EVICTED`` with the block that was
reused if they do not: an honest loss, named like any other. Dropping it at
the cut would lose blocks that may well survive. Prefix closure holds: a
request's buffer drains front first, and a lost front drops the rest with it
(``blockindex.lose_holders``, ``buffer.drop_pending``).

Ledger: the rest is a new op, booked in ``admitted_ops`` (its tokens were
admitted with the original, so ``admitted_tokens`` does not move) and in
``split_ops`` / ``split_tokens``. Every cut is an ``OpSplit`` decision.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_fsm.rules.scope import Scope
from offload_fsm.state import PACKED_INT_BYTES, Op, RequestState, State
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.decisions import OpSplit, SplitReason


def fitting_prefix(op: Op, queued: set[int], budget_blocks: int) -> tuple[int, set[int]]:
    """The most leading blocks of ``op``, in whole chunks and fewer than all,
    whose blocks among ``queued`` number at most ``budget_blocks``; and those
    queued blocks. ``(0, set())`` when not even one chunk fits, or the op is
    one chunk (or carries no chunk size)."""
    step, blocks = op.blocks_per_chunk, op.block_ids
    taken: set[int] = set()
    cut = 0
    if not step or budget_blocks <= 0:
        return 0, taken
    for first in range(0, len(blocks) - step, step):
        more = queued.intersection(blocks[first : first + step])
        if len(taken) + len(more - taken) > budget_blocks:
            break
        taken |= more
        cut = first + step
    return cut, taken


def split(
    state: State, rec: RequestState, op: Op, front_blocks: int, reason: SplitReason,
    scope: Scope,
) -> Op:
    """Cut buffered ``op`` after ``front_blocks`` blocks (whole chunks, fewer
    than all); the front keeps the op's id, pins and deadline. Returns the rest."""
    blocks = op.num_blocks
    assert 0 < front_blocks < blocks, "a cut keeps both sides non-empty"
    block_tokens = -(-op.tokens // blocks)  # only the last block may be partial
    split_token = op.start_token + front_blocks * block_tokens
    hooks = scope.hooks
    hooks.unbuffered(state, [op])
    cut = front_blocks * PACKED_INT_BYTES
    rest = Op(op_id=state.next_op_id, req=rec, start_token=split_token,
              end_token=op.end_token, packed_ids=op.packed_ids[cut:],
              packed_hashes=op.packed_hashes[cut:], time_s=op.time_s,
              blocks_per_chunk=op.blocks_per_chunk, pinned=op.pinned)
    state.next_op_id += 1
    start, end = op.start_token, op.end_token
    op.end_token = split_token
    op.packed_ids, op.packed_hashes = op.packed_ids[:cut], op.packed_hashes[:cut]
    rec.ops.insert(rec.ops.index(op) + 1, rest)
    state.live_ops[rest.status] += 1  # the tokens only changed hands
    hooks.admitted(state, op, op.block_ids, op.block_hashes, scope)
    hooks.admitted(state, rest, rest.block_ids, rest.block_hashes, scope)
    counters = state.counters
    counters[Counter.ADMITTED_OPS] += 1
    counters[Counter.SPLIT_OPS] += 1
    counters[Counter.SPLIT_TOKENS] += rest.tokens
    scope.decisions.append(
        OpSplit(req_id=rec.req_id, start_token=start, split_token=split_token,
                end_token=end, front_blocks=front_blocks, reason=reason)
    )
    return rest


def shield_prefix(
    state: State, rec: RequestState, ops: Sequence[Op], budget_blocks: int, scope: Scope
) -> list[Op]:
    """The front of ``ops`` (a finished request's unpinned buffered ops) whose
    blocks not pinned already number at most ``budget_blocks``, the op that
    crosses the budget cut to its fitting prefix (``SplitReason.SHIELD``)."""
    taken: set[int] = set()
    front: list[Op] = []
    for op in ops:
        queued = set(op.block_ids).difference(state.pins) - taken
        if len(taken) + len(queued) <= budget_blocks:
            taken |= queued
            front.append(op)
            continue
        cut, _ = fitting_prefix(op, queued, budget_blocks - len(taken))
        if cut:
            split(state, rec, op, cut, SplitReason.SHIELD, scope)
            front.append(op)
        break
    return front
