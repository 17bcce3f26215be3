"""EVICTION_AWARE content dedup: a chunk whose content (its last block's chained
hash) another batch already stored or is storing is not written again."""

from __future__ import annotations

from offload_fsm.commands import ProtectBlocks, SubmitStore
from offload_fsm.decisions import DropCause, OpRejected, OpsDropped, RejectReason
from offload_fsm.events import CandidateOffered
from offload_fsm.invariants import ledger_terms
from tests.offload_fsm.helpers import Harness, ea

H1, H2, H3 = 101, 102, 103  # block contents; H1 is a shared first chunk


def offer(h: Harness, req_id: str, blocks: tuple[int, ...], hashes: tuple[int, ...]) -> object:
    return h.feed(
        CandidateOffered(req_id=req_id, start_token=0, end_token=32 * len(blocks),
                         block_ids=blocks, block_hashes=hashes, time_s=h.time_s,
                         blocks_per_chunk=1)
    )


def two_requests_sharing_a_first_chunk() -> Harness:
    h = Harness(ea())
    h.arrive("a", "b")
    offer(h, "a", (0, 1), (H1, H2))
    offer(h, "b", (2, 3), (H1, H3))  # same first-chunk content, other physical block
    h.hashes.update({0: H1, 1: H2, 2: H1, 3: H3})
    h.queue = [0, 1, 2, 3]
    return h


def test_a_chunk_claimed_by_another_batch_is_trimmed_off() -> None:
    h = two_requests_sharing_a_first_chunk()
    result = h.tick(allocated=1, next_blocks=1, free=10, window=(0, 1, 2))
    submits = result.of(SubmitStore)
    assert [(s.req_id, s.start_token, s.end_token, s.block_ids) for s in submits] == [
        ("a", 0, 64, (0, 1)),
        ("b", 32, 64, (3,)),
    ]
    trimmed = [d for d in result.of(OpsDropped) if d.cause is DropCause.DUPLICATE]
    assert [(d.req_id, d.ops, d.tokens) for d in trimmed] == [("b", 0, 32)]
    protected = [b for c in result.of(ProtectBlocks) for b in c.block_ids]
    assert 2 not in protected  # the trimmed block is never pinned


def test_a_candidate_whose_chunks_are_all_stored_is_rejected_not_lost() -> None:
    h = two_requests_sharing_a_first_chunk()
    h.tick(allocated=1, next_blocks=1, free=10, window=(0, 1, 2))
    h.complete("a", "b")
    h.arrive("c")
    result = offer(h, "c", (4, 5), (H1, H2))
    [rejected] = result.of(OpRejected)  # type: ignore[attr-defined]
    assert rejected.reason is RejectReason.ALREADY_STORED
    assert not h.state.requests["c"].broken  # not a loss: its chain stays intact
    terms = ledger_terms(h.state, "tokens")
    assert terms["stored"] == 64 + 32 and terms["dropped_duplicate"] == 32
