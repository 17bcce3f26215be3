"""EVICTION_AWARE's content dedup: store each chunk's content once.

LMCache keys a chunk by its token prefix, which the chunk's last block hash
names (vLLM block hashes chain their parents): ``Op.chunk_keys``. The core
remembers the keys it stored (``State.stored_keys``, bounded by
``STORED_KEYS_MAX``, oldest forgotten first, with a running XOR for the
digest) and counts the keys of batches verifying or in flight
(``State.claimed_keys``).

* Admission rejects a candidate whose every chunk is stored
  (``RejectReason.ALREADY_STORED``, outside the ledger).
* Selection leaves out the leading chunks another batch stored or is storing
  (``DropCause.DUPLICATE``, not a loss: the chain keeps no hole): whole
  duplicate ops are dropped, a partly duplicate first op is trimmed.
* A settled batch unclaims its keys and, when stored, remembers them.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_fsm.buffer import count_drop
from offload_fsm.counters import Counter
from offload_fsm.decisions import DropCause, OpsDropped
from offload_fsm.hooks import Scope
from offload_fsm.pins import decref, release_pinned, unpin
from offload_fsm.state import STORED_KEYS_MAX, Op, RequestState, State


def already_stored(state: State, op: Op) -> bool:
    stored = state.stored_keys
    return all(key in stored for key in op.chunk_keys)


def claim(state: State, ops: Sequence[Op]) -> None:
    claimed = state.claimed_keys
    for op in ops:
        for key in op.chunk_keys:
            claimed[key] = claimed.get(key, 0) + 1


def skip_duplicates(state: State, rec: RequestState, ops: list[Op], scope: Scope) -> list[Op]:
    """The ops left to store once leading duplicate content is left out."""
    stored, claimed = state.stored_keys, state.claimed_keys
    for position, op in enumerate(ops):
        keys = op.chunk_keys
        known = 0
        while known < len(keys) and (keys[known] in stored or keys[known] in claimed):
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
    op.block_ids = op.block_ids[cut_blocks:]
    op.block_hashes = op.block_hashes[cut_blocks:]


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
    if len(state.stored_keys) > STORED_KEYS_MAX:
        oldest = next(iter(state.stored_keys))
        del state.stored_keys[oldest]
        state.stored_keys_xor ^= oldest
