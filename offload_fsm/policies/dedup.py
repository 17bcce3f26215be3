"""EVICTION_AWARE's content dedup: store each chunk's content once, without
ever leaving a hole in a request's chain.

LMCache keys a chunk by its token prefix, which the chunk's last block hash
names (vLLM block hashes chain their parents): ``Op.chunk_keys``. The core
remembers the keys it stored (``State.stored_keys``, bounded by
``STORED_KEYS_MAX``, oldest forgotten first, with a running XOR for the
digest) and counts the keys of batches verifying or in flight
(``State.claimed_keys``).

LMCache retrieves a request's prefix chunk by chunk from token 0 and stops
at the first chunk it lacks. So leaving a chunk out of a request's store is
safe only if LMCache holds that chunk *for sure*; a chunk that another
request's batch is merely storing may still fail (or be abandoned at its
lease), and then every later chunk of the follower is unreachable: the
"not a loss" would be a loss nobody counted, and the chain rule ("any loss
breaks the request's prefix chain") would be broken behind the core's back.
The rules:

* Admission rejects a candidate whose every chunk is stored
  (``RejectReason.ALREADY_STORED``, outside the ledger).
* Selection leaves out only the leading chunks *confirmed stored*
  (``DropCause.DUPLICATE``, not a loss: LMCache holds them, the chain keeps
  no hole): whole duplicate ops are dropped, a partly duplicate first op is
  trimmed.
* A chunk only *claimed* by another batch in flight is never left out. The
  planner holds the follower (``HoldReason.CLAIMED``, :func:`waits_for_claimant`)
  when its whole selection is stored-or-claimed content and every block of
  the claimed chunks is pinned (by the claimant, the prefix-cache-hit case
  where both requests share the physical blocks, or by a shield): waiting
  then costs nothing, because pinned blocks cannot be evicted, and once the
  claimant settles the follower's chunks are either stored (trimmed, no
  write) or not (the follower stores them itself). Otherwise the follower
  stores the claimed chunks too: when it has later content, that content
  needs them, and when its own copies sit unpinned in the free queue,
  waiting could lose them. Writing a chunk twice is idempotent on the
  server (content keys); the write savings that remain are every chunk
  already stored, and every concurrent duplicate that waiting cannot lose.
* A settled batch unclaims its keys and, when stored, remembers them.
* LMCache's L1 is finite (LRU): a lookup that shows chunks missing
  (``ChunksMissing``) makes the core forget them
  (``StoredChunksForgotten``), so they are admitted and stored again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

from offload_fsm.rules.buffer import count_drop
from offload_fsm.rules.pins import decref, release_pinned, unpin
from offload_fsm.rules.scope import Scope
from offload_fsm.state import PACKED_INT_BYTES, STORED_KEYS_MAX, Op, RequestState, State
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.decisions import DropCause, OpsDropped, StoredChunksForgotten
from offload_fsm.vocabulary.errors import InvalidEvent
from offload_fsm.vocabulary.events import ChunksMissing


def already_stored(state: State, op: Op) -> bool:
    return all(map(state.stored_keys.__contains__, op.chunk_keys))


def chunk_blocks(op: Op) -> Iterator[tuple[int, tuple[int, ...]]]:
    """Each chunk of ``op``: its content key and its block ids."""
    step = op.blocks_per_chunk or len(op.block_ids)
    blocks = op.block_ids
    for key, first in zip(op.chunk_keys, range(0, len(blocks), step), strict=True):
        yield key, blocks[first : first + step]


def waits_for_claimant(
    state: State, ops: Sequence[Op], claiming: set[int], pinning: set[int]
) -> bool:
    """Whether a selection of ``ops`` should wait for the batch that claims
    its content (module docstring). ``claiming`` and ``pinning`` are the
    content keys and blocks of the picks made earlier in the same plan."""
    stored, claimed, pins = state.stored_keys, state.claimed_keys, state.pins
    waiting = False
    for op in ops:  # (the answer does not depend on the order: sets first, in C)
        unstored = set(op.chunk_keys).difference(stored)
        if not unstored:
            continue
        if unstored.difference(claimed, claiming):
            return False  # new content: store now
        if not op.pinned:
            for key, blocks in chunk_blocks(op):
                if key in unstored and any(b not in pins and b not in pinning for b in blocks):
                    return False  # its own copy could be evicted while it waits
        waiting = True
    return waiting


def note_pick(state: State, ops: Sequence[Op], claiming: set[int], pinning: set[int]) -> None:
    """Add what selecting ``ops`` will claim and pin (its chunks not stored:
    a subset of what the selection keeps, so :func:`waits_for_claimant`
    errs towards storing)."""
    stored = state.stored_keys
    for op in ops:
        keys = op.chunk_keys
        if stored.keys().isdisjoint(keys):  # nothing of it stored, the common case: in C
            claiming.update(keys)
            pinning.update(op.block_ids)
            continue
        for key, blocks in chunk_blocks(op):
            if key not in stored:
                claiming.add(key)
                pinning.update(blocks)


def claim(state: State, ops: Sequence[Op]) -> None:
    claimed = state.claimed_keys
    for op in ops:
        for key in op.chunk_keys:
            claimed[key] = claimed.get(key, 0) + 1


def skip_duplicates(state: State, rec: RequestState, ops: list[Op], scope: Scope) -> list[Op]:
    """The ops left to store once leading content confirmed stored is left out."""
    stored = state.stored_keys
    for position, op in enumerate(ops):
        keys = op.chunk_keys
        known = 0
        while known < len(keys) and keys[known] in stored:
            known += 1
        if known == len(keys):
            continue
        if position:
            duplicates = ops[:position]
            release_pinned(state, duplicates, scope)
            count_drop(state, rec, duplicates, DropCause.DUPLICATE, -1, scope)
        if known:
            trim(state, rec, op, known, scope)
        return ops[position:]
    release_pinned(state, ops, scope)
    count_drop(state, rec, ops, DropCause.DUPLICATE, -1, scope)
    return []


def trim(state: State, rec: RequestState, op: Op, chunks: int, scope: Scope) -> None:
    """Cut ``chunks`` leading chunks (already stored elsewhere) off ``op``."""
    chunk_tokens = op.tokens // len(op.chunk_keys)
    cut_blocks = chunks * op.blocks_per_chunk
    cut_tokens = chunks * chunk_tokens
    if op.pinned:
        unpin(state, -1, op.block_ids[:cut_blocks], scope)
    state.counters[Counter.DROPPED_DUPLICATE_TOKENS] += cut_tokens
    scope.decisions.append(
        OpsDropped(req_id=rec.req_id, start_token=op.start_token,
                   end_token=op.start_token + cut_tokens, ops=0, tokens=cut_tokens,
                   cause=DropCause.DUPLICATE, block_id=-1)
    )
    op.start_token += cut_tokens
    state.live_tokens[op.status] -= cut_tokens
    cut = cut_blocks * PACKED_INT_BYTES
    op.packed_ids, op.packed_hashes = op.packed_ids[cut:], op.packed_hashes[cut:]


def unclaim(state: State, ops: Sequence[Op], stored: bool) -> None:
    claimed = state.claimed_keys
    for op in ops:
        for key in op.chunk_keys:
            decref(claimed, key)
            if stored and key not in state.stored_keys:
                remember(state, key)


def remember(state: State, key: int) -> None:
    """Add a stored chunk key, forgetting the oldest beyond the bound."""
    state.stored_keys[key] = None
    state.stored_keys_xor ^= key
    state.stored_order.append(key)
    if len(state.stored_keys) > STORED_KEYS_MAX:
        oldest = _pop_oldest(state)
        del state.stored_keys[oldest]
        state.stored_keys_xor ^= oldest


def _pop_oldest(state: State) -> int:
    """Take the first key of ``stored_keys`` off ``stored_order``. A key's stale
    entries (one per forget) all come before its live one, so the first
    ``stored_stale[key]`` entries of a key met from the left are the stale ones."""
    order, stale = state.stored_order, state.stored_stale
    while True:
        key = order.popleft()
        if key not in stale:
            return key
        decref(stale, key)


def on_chunks_missing(state: State, event: ChunksMissing, scope: Scope) -> None:
    """A lookup showed these chunks missing on the server: forget the ones
    remembered stored (keeping the digest's fingerprint in step)."""
    if not event.chunk_keys:
        raise InvalidEvent(event.TAG, None, "a missing-chunks report names no chunk")
    stored = state.stored_keys
    forgotten = []
    for key in event.chunk_keys:
        if key in stored:
            del stored[key]
            state.stored_keys_xor ^= key
            forgotten.append(key)
    stale = state.stored_stale
    for key in forgotten:
        stale[key] = stale.get(key, 0) + 1
    if len(state.stored_order) > 2 * STORED_KEYS_MAX:  # stale entries piled up: compact
        state.stored_order = deque(stored)
        stale.clear()
    if forgotten:
        state.counters[Counter.FORGOTTEN_CHUNKS] += len(forgotten)
        scope.decisions.append(
            StoredChunksForgotten(chunk_keys=tuple(forgotten), reported=len(event.chunk_keys))
        )
