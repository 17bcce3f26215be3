"""Block protections: the core's count of the pins it holds, and the budget
a drain must leave free.

``State.pins`` maps a block id to the protections the core holds on it; every
protection is a ``ProtectBlocks`` command (vLLM ``BlockPool.touch``) and every
release a ``ReleaseBlocks`` (``BlockPool.free_blocks``), counted in
``protected_blocks`` / ``released_blocks`` so that ``protected - released``
always equals the pins held (``invariants.pins_balance``). An op's ``pinned``
flag says its blocks are among them. Batch id ``-1`` marks protections that
belong to no batch (shields, and releases of buffered ops).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence
from itertools import chain
from typing import TypeVar

from offload_fsm.rules.scope import Scope
from offload_fsm.state import Op, State
from offload_fsm.vocabulary.commands import ProtectBlocks, ReleaseBlocks
from offload_fsm.vocabulary.counters import Counter

K = TypeVar("K", bound=Hashable)

PIN_RESERVE_SAFETY = 2.0


def decref(counts: dict[K, int], key: K) -> None:
    """Take one from ``counts[key]``, forgetting the key at zero."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


def blocks_of(ops: Iterable[Op]) -> tuple[int, ...]:
    """The block ids of ``ops``, in order (joined in C, not block by block)."""
    return tuple(chain.from_iterable(op.block_ids for op in ops))


def protect(state: State, batch_id: int, block_ids: tuple[int, ...], scope: Scope) -> None:
    pins = state.pins
    for block_id in block_ids:
        pins[block_id] = pins.get(block_id, 0) + 1
    state.counters[Counter.PROTECTED_BLOCKS] += len(block_ids)
    scope.commands.append(ProtectBlocks(batch_id=batch_id, block_ids=block_ids))


def release(state: State, batch_id: int, ops: Sequence[Op], scope: Scope) -> None:
    """Release the blocks of the pinned ones among ``ops``."""
    block_ids = blocks_of(op for op in ops if op.pinned)
    for op in ops:
        op.pinned = False
    unpin(state, batch_id, block_ids, scope)


def release_pinned(state: State, ops: Sequence[Op], scope: Scope) -> None:
    pinned = [op for op in ops if op.pinned]
    if pinned:
        release(state, -1, pinned, scope)


def unpin(state: State, batch_id: int, block_ids: tuple[int, ...], scope: Scope) -> None:
    if not block_ids:
        return
    pins = state.pins
    for block_id in block_ids:  # decref, inlined: this loop runs for every released block
        left = pins[block_id] - 1
        if left:
            pins[block_id] = left
        else:
            del pins[block_id]
    state.counters[Counter.RELEASED_BLOCKS] += len(block_ids)
    scope.commands.append(ReleaseBlocks(batch_id=batch_id, block_ids=block_ids))


def pin_reserve(state: State, reserve_blocks: int) -> int:
    """Free blocks a drain must leave: the running requests' per-step need
    (the shell's ``reserve_blocks``) for every step a pin is expected to live
    (selection to release, learned from settled batches) plus this one,
    doubled because the per-step need is a mean and arrives in bursts: a
    drain that leaves only the mean lets a burst preempt a running request
    that would have run without the connector, and twice the mean absorbs
    one at no cost in recall."""
    return math.ceil(PIN_RESERVE_SAFETY * reserve_blocks * (1.0 + state.pin_steps_ema))
