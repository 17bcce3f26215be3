"""EVICTION_AWARE content dedup: a chunk whose content (its last block's chained
hash) is stored already is not written again; a chunk another batch is merely
storing is never left out of a follower's chain (it waits for the claimant
when waiting cannot lose it, else it is stored again); a lookup that shows
stored chunks missing on the server makes the core forget them."""

from __future__ import annotations

import functools
import operator
import random

import pytest

from offload_fsm import InvalidEvent
from offload_fsm.invariants import indexes_agree, ledger_terms
from offload_fsm.policies import dedup
from offload_fsm.vocabulary.commands import ProtectBlocks, SubmitStore
from offload_fsm.vocabulary.decisions import (
    DropCause,
    HoldReason,
    OpRejected,
    OpsDropped,
    OpsHeld,
    RejectReason,
    StoredChunksForgotten,
)
from offload_fsm.vocabulary.events import CandidateOffered, ChunksMissing
from tests.offload_fsm.helpers import Harness, Result, ea, fifo

H1, H2, H3 = 101, 102, 103  # block contents; H1 is a shared first chunk


def offer(
    h: Harness, req_id: str, blocks: tuple[int, ...], hashes: tuple[int, ...], *,
    start: int = 0, tokens_per_block: int = 32, blocks_per_chunk: int = 1,
) -> Result:
    h.hashes.update(zip(blocks, hashes, strict=True))
    return h.feed(
        CandidateOffered(req_id=req_id, start_token=start,
                         end_token=start + tokens_per_block * len(blocks),
                         block_ids=blocks, block_hashes=hashes, time_s=h.time_s,
                         blocks_per_chunk=blocks_per_chunk)
    )


def submits(result: Result) -> list[tuple[str, int, int, tuple[int, ...]]]:
    return [(s.req_id, s.start_token, s.end_token, s.block_ids) for s in result.of(SubmitStore)]


def duplicates(result: Result) -> list[tuple[str, int, int, int]]:
    return [(d.req_id, d.start_token, d.end_token, d.ops) for d in result.of(OpsDropped)
            if d.cause is DropCause.DUPLICATE]


def reachable_tokens(h: Harness, keys_by_chunk: list[int], chunk_tokens: int) -> int:
    """How far LMCache could retrieve a request whose chunks carry these keys:
    chunk by chunk from token 0, up to the first chunk nobody stored."""
    stored = h.state.stored_keys
    reach = 0
    for key in keys_by_chunk:
        if key not in stored:
            break
        reach += chunk_tokens
    return reach


# -- chunks confirmed stored ------------------------------------------------------


def stored_first_chunk() -> Harness:
    """``a`` stored H1 H2; ``b`` then offers H1 H3 on other physical blocks."""
    h = Harness(ea())
    h.arrive("a", "b")
    offer(h, "a", (0, 1), (H1, H2))
    h.queue = [0, 1]
    h.tick(allocated=1, next_blocks=1, requests=0)
    h.complete("a")
    offer(h, "b", (2, 3), (H1, H3))
    h.queue = [2, 3]
    return h


def test_a_chunk_confirmed_stored_is_trimmed_off() -> None:
    h = stored_first_chunk()
    result = h.tick(allocated=1, next_blocks=1, requests=0)
    assert submits(result) == [("b", 32, 64, (3,))]
    assert duplicates(result) == [("b", 0, 32, 0)]
    protected = [b for c in result.of(ProtectBlocks) for b in c.block_ids]
    assert 2 not in protected  # the trimmed block is never pinned


def test_a_candidate_whose_chunks_are_all_stored_is_rejected_not_lost() -> None:
    h = stored_first_chunk()
    h.tick(allocated=1, next_blocks=1, requests=0)
    h.complete("b")
    h.arrive("c")
    result = offer(h, "c", (4, 5), (H1, H2))
    [rejected] = result.of(OpRejected)
    assert rejected.reason is RejectReason.ALREADY_STORED
    assert not h.state.requests["c"].broken  # not a loss: its chain stays intact
    terms = ledger_terms(h.state, "tokens")
    assert terms["stored"] == 64 + 32 and terms["dropped_duplicate"] == 32


# -- chunks only claimed by a batch in flight -------------------------------------

# The case: horizon 1.0, free queue [1, 2, 3, 4]; a offers [0, 256) on
# blocks (1, 2); b, a prefix-cache hit on the same blocks and hashes, offers
# [0, 256) on (1, 2) and [256, 512) on (3, 4). Chunks are 256 tokens, 2 blocks.
K1, K2, K3, K4 = 11, 12, 13, 14


def prefix_hit(*, follower_ops: int) -> Harness:
    h = Harness(ea(horizon_steps=1.0))
    h.arrive("a", "b")
    chunk = {"tokens_per_block": 128, "blocks_per_chunk": 2}
    offer(h, "a", (1, 2), (K1, K2), **chunk)
    offer(h, "b", (1, 2), (K1, K2), **chunk)
    if follower_ops == 2:
        offer(h, "b", (3, 4), (K3, K4), start=256, **chunk)
    h.finish("a", "b")
    h.queue = [1, 2, 3, 4]
    return h


def test_a_claimed_chunk_the_follower_builds_on_is_stored_again() -> None:
    h = prefix_hit(follower_ops=2)
    step = h.tick(allocated=4, requests=0)
    # b's [256, 512) needs [0, 256) on the server; a is only storing it.
    assert submits(step) == [("a", 0, 256, (1, 2)), ("b", 0, 512, (1, 2, 3, 4))]
    assert duplicates(step) == []
    h.receipts({"a": 1}, failed=["a"])  # the claimant's store fails
    h.complete("b")
    h.tick(allocated=4, requests=0)
    assert reachable_tokens(h, [K2, K4], 256) == 512  # nothing of b is unreachable
    assert h.state.counters["dropped_duplicate_tokens"] == 0


@pytest.mark.parametrize("claimant_fails", [False, True])
def test_a_wholly_claimed_selection_on_pinned_blocks_waits_for_its_claimant(
    claimant_fails: bool,
) -> None:
    h = prefix_hit(follower_ops=1)
    step = h.tick(allocated=4, requests=0)
    assert submits(step) == [("a", 0, 256, (1, 2))]
    held = step.one(OpsHeld)
    assert (held.req_id, held.ops, held.reason) == ("b", 1, HoldReason.CLAIMED)
    assert h.state.counters["held_claimed"] == 1
    assert h.state.requests["b"].ops  # still buffered: nothing was dropped
    if claimant_fails:
        h.receipts({"a": 1}, failed=["a"])
    else:
        h.complete("a")
    step = h.tick(allocated=4, requests=0)
    if claimant_fails:  # nobody stored it: the follower stores it itself
        assert submits(step) == [("b", 0, 256, (1, 2))] and duplicates(step) == []
        h.complete("b")
    else:  # stored for sure now: no second write
        assert submits(step) == [] and duplicates(step) == [("b", 0, 256, 1)]
    assert reachable_tokens(h, [K2], 256) == 256
    assert "b" not in h.state.requests  # its session ended


def test_a_claimed_chunk_whose_own_copy_could_be_evicted_is_stored_again() -> None:
    h = Harness(ea())
    h.arrive("a", "b")
    offer(h, "a", (0, 1), (H1, H2))
    offer(h, "b", (2,), (H1,))  # same content as a's first chunk, other physical block
    h.queue = [0, 1, 2, 3]
    step = h.tick(allocated=1, next_blocks=1, free=10, window=(0, 1, 2))
    # Waiting would leave block 2 in the free queue: store it now, twice if need be.
    assert submits(step) == [("a", 0, 64, (0, 1)), ("b", 0, 32, (2,))]
    assert step.of(OpsHeld) == [] and duplicates(step) == []


# -- the server forgets -------------------------------------------------------------


def test_chunks_missing_on_the_server_are_forgotten_and_stored_again() -> None:
    h = stored_first_chunk()
    assert set(h.state.stored_keys) == {H1, H2}
    result = h.feed(ChunksMissing(chunk_keys=(H1, 999)))  # 999: never stored
    forgotten = result.one(StoredChunksForgotten)
    assert (forgotten.chunk_keys, forgotten.reported) == ((H1,), 2)
    assert h.state.counters["forgotten_chunks"] == 1
    assert list(h.state.stored_keys) == [H2]
    assert h.state.stored_keys_xor == functools.reduce(operator.xor, h.state.stored_keys)
    step = h.tick(allocated=1, next_blocks=1, requests=0)
    assert submits(step) == [("b", 0, 64, (2, 3))]  # H1 is no longer trimmed
    h.complete("b")
    h.arrive("c")
    assert set(h.state.stored_keys) == {H1, H2, H3}  # b's store put H1 back
    [rejected] = offer(h, "c", (4, 5), (H1, H2)).of(OpRejected)
    assert rejected.reason is RejectReason.ALREADY_STORED


def test_chunks_missing_that_were_never_stored_decide_nothing() -> None:
    h = stored_first_chunk()
    digest_before = (len(h.state.stored_keys), h.state.stored_keys_xor)
    result = h.feed(ChunksMissing(chunk_keys=(998, 999)))
    assert result.decisions == [] and result.commands == []
    assert (len(h.state.stored_keys), h.state.stored_keys_xor) == digest_before
    h2 = Harness(fifo())  # FIFO keeps no stored-content memory
    assert h2.feed(ChunksMissing(chunk_keys=(H1,))).decisions == []


def test_an_empty_missing_chunks_report_is_invalid() -> None:
    h = Harness(ea(), check=False)
    with pytest.raises(InvalidEvent, match="names no chunk"):
        h.feed(ChunksMissing(chunk_keys=()))


# -- the bounded memory -------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_the_bounded_memory_forgets_oldest_first_like_dict_order(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``remember`` beyond the bound drops ``next(iter(stored_keys))``, found
    through ``stored_order`` (O(1)) even when forgotten keys come back: checked
    against the plain dict rule over random remember/forget runs."""
    monkeypatch.setattr(dedup, "STORED_KEYS_MAX", 8)
    rng = random.Random(seed)
    h = Harness(ea())
    reference: dict[int, None] = {}
    for _ in range(400):
        key = rng.randrange(1, 30)
        if rng.random() < 0.3:
            h.feed(ChunksMissing(chunk_keys=(key,)))
            reference.pop(key, None)
        elif key not in reference:
            dedup.remember(h.state, key)
            reference[key] = None
            if len(reference) > 8:
                del reference[next(iter(reference))]
        assert list(h.state.stored_keys) == list(reference)
        assert h.state.stored_keys_xor == functools.reduce(operator.xor, reference, 0)
        assert indexes_agree(h.state) == []
