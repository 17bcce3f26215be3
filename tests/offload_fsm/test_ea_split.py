"""Chunk-granularity selection (issue 12): an op too big for the pin
headroom or the shield's headroom is cut to its longest chunk-aligned prefix
that fits (``OpSplit``); the rest stays buffered behind it, stored if its
blocks survive and dropped ``EVICTED`` if they do not.

The op: 12 blocks of 32 tokens, 2 blocks a chunk (a prefix-cache-hit prefix
offered whole, scaled down). Whole, it never fits; its front chunks do."""

from __future__ import annotations

import pytest

from offload_fsm.invariants import ledger_terms
from offload_fsm.vocabulary.commands import ProtectBlocks, ReadFreeQueue, SubmitStore
from offload_fsm.vocabulary.decisions import (
    DropCause,
    HoldReason,
    OpsDropped,
    OpsHeld,
    OpSplit,
    OpsSelected,
    OpsShielded,
    SelectReason,
    SplitReason,
)

from .helpers import Harness, ea

FILLER = tuple(range(10_000, 10_100))
BLOCKS, PER_CHUNK, TOKENS = 12, 2, 384


def huge(h: Harness, req_id: str, per_chunk: int = PER_CHUNK) -> tuple[int, ...]:
    h.arrive(req_id)
    blocks = h.new_blocks(BLOCKS)
    h.offer(req_id, blocks=blocks, tokens=TOKENS, blocks_per_chunk=per_chunk)
    return blocks


def budget_case(free_filler: int) -> tuple[Harness, tuple[int, ...]]:
    """A finished huge op at the eviction head with ``free_filler`` more free
    blocks behind it; the next step's pin reserve is 2 * 1 * (1 + 1) = 4."""
    h = Harness(ea())
    a = huge(h, "a")
    h.finish("a", free=0)
    h.queue = [*a, *FILLER[:free_filler]]
    return h, a


def test_pin_budget_selects_the_chunk_prefix_that_fits() -> None:
    h, a = budget_case(free_filler=3)  # 15 free - 4 reserve: headroom 11 -> 5 chunks
    step = h.tick(allocated=20, requests=1)
    split = step.one(OpSplit)
    assert (split.req_id, split.start_token, split.split_token, split.end_token,
            split.front_blocks, split.reason) == ("a", 0, 320, 384, 10, SplitReason.PIN_BUDGET)
    selected = step.one(OpsSelected)
    assert (selected.start_token, selected.end_token, selected.ops) == (0, 320, 1)
    assert step.one(ProtectBlocks).block_ids == a[:10]
    assert step.one(SubmitStore).block_ids == a[:10]
    assert step.of(OpsHeld) == []
    rest = h.state.requests["a"].ops
    assert [(op.start_token, op.end_token, op.block_ids) for op in rest] == [(320, 384, a[10:])]
    counters = h.state.counters
    assert (counters["split_ops"], counters["split_tokens"], counters["admitted_ops"],
            counters["admitted_tokens"]) == (1, 64, 2, TOKENS)


def test_the_rest_is_stored_later_when_its_blocks_survive() -> None:
    h, a = budget_case(free_filler=3)
    h.tick(allocated=20, requests=1)
    h.complete("a")
    step = h.tick(allocated=20, requests=0)  # headroom for the last chunk now
    selected = step.one(OpsSelected)
    assert (selected.start_token, selected.end_token) == (320, 384)
    assert step.one(SubmitStore).block_ids == a[10:]
    h.complete("a")
    assert h.state.counters["stored_tokens"] == TOKENS
    assert h.state.counters["stored_ops"] == 2 == h.state.counters["admitted_ops"]


def test_the_rest_is_dropped_evicted_alone_when_its_block_is_reused() -> None:
    h, a = budget_case(free_filler=3)
    h.tick(allocated=20, requests=1)
    step = h.tick(allocated=20, requests=1, reallocated=((a[11], 999_999),))
    dropped = step.one(OpsDropped)
    assert (dropped.start_token, dropped.end_token, dropped.cause, dropped.block_id) == (
        320, 384, DropCause.EVICTED, a[11])
    h.complete("a")
    terms = ledger_terms(h.state, "tokens")
    assert (terms["stored"], terms["dropped_evicted"]) == (320, 64)


@pytest.mark.parametrize("per_chunk", [0, 12])
def test_an_op_without_a_fitting_chunk_prefix_is_held_whole(per_chunk: int) -> None:
    h = Harness(ea())
    a = huge(h, "a", per_chunk)  # no chunk size, or one chunk: nothing to cut
    h.finish("a", free=0)
    h.queue = [*a, *FILLER[:3]]
    step = h.tick(allocated=20, requests=1)
    assert step.of(OpSplit) == [] and step.of(OpsSelected) == []
    assert step.one(OpsHeld).reason is HoldReason.PIN_BUDGET


def test_shield_protects_the_chunk_prefix_that_leaves_the_reserve() -> None:
    h = Harness(ea())
    h.queue = list(FILLER)
    h.tick(allocated=4, requests=3)  # D = 10, reserve 3
    a = huge(h, "a")
    result = h.finish("a", free=1)  # 1 + 12 freed - 3: 10 blocks may be protected
    split = result.one(OpSplit)
    assert (split.split_token, split.front_blocks, split.reason) == (320, 10, SplitReason.SHIELD)
    shielded = result.one(OpsShielded)
    assert (shielded.ops, shielded.blocks) == (1, 10)
    assert result.one(ProtectBlocks).block_ids == a[:10]
    # The next schedule() takes the unprotected tail; the shielded front is stored.
    h.queue = [*a[10:], *FILLER]
    step = h.tick(allocated=4, requests=3, reallocated=((a[10], 999_999),))
    assert step.one(OpsDropped).start_token == 320
    selected = step.one(OpsSelected)
    assert (selected.start_token, selected.end_token, selected.reason) == (
        0, 320, SelectReason.SHIELDED)
    assert step.one(SubmitStore).block_ids == a[:10]


def test_no_cut_in_a_round_a_cascade_follows() -> None:
    h = Harness(ea())
    a = huge(h, "a")
    h.arrive("b")
    h.offer("b")
    h.finish("a", "b", free=0)
    h.queue = [*h.blocks_of["b"][0], *a, *FILLER[:3]]  # 17 free - 4 reserve: headroom 13
    step = h.tick(allocated=20, requests=1)
    # b's 2 blocks fit whole and pin window blocks, so a cascade re-read follows; a's 12
    # do not fit in the 11 left, and no cut takes them: the re-read may need them.
    assert [d.req_id for d in step.of(OpsSelected)] == ["b"]
    assert len(step.of(ReadFreeQueue)) == 1
    assert step.of(OpSplit) == []
    assert [(d.req_id, d.reason) for d in step.of(OpsHeld)] == [("a", HoldReason.PIN_BUDGET)]
