"""StoreBuilder keeps the rest of an op the core cut at a chunk boundary
(``OpSplit``): the front's STORE carries only the front's blocks, in every
KV group, and the rest's STORE finds its own."""

from __future__ import annotations

from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestMetadata
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

from connector.stores import StoreBuilder
from offload_fsm.vocabulary.commands import SubmitStore


def _submit(start: int, end: int) -> SubmitStore:
    return SubmitStore(batch_id=0, req_id="r", start_token=start, end_token=end, block_ids=())


def test_a_cut_op_is_stored_front_first_then_the_rest() -> None:
    builder = StoreBuilder([16, 32])  # two KV groups: 16 and 32 tokens a block
    op = LoadStoreOp(token_ids=list(range(256)), block_ids=[list(range(16)), list(range(8))],
                     start=0, end=256)
    builder.offered(LMCacheMPRequestMetadata(request_id="r", direction="STORE", op=op))
    front = builder.build(_submit(0, 128))
    assert (front.op.start, front.op.end) == (0, 128)
    assert front.op.block_ids == [list(range(8)), list(range(4))]
    rest = builder.build(_submit(128, 256))
    assert (rest.op.start, rest.op.end) == (128, 256)
    assert rest.op.block_ids == [list(range(8, 16)), list(range(4, 8))]


def test_dropping_a_cut_op_front_keeps_its_rest() -> None:
    builder = StoreBuilder([16])
    op = LoadStoreOp(token_ids=list(range(256)), block_ids=[list(range(16))], start=0, end=256)
    builder.offered(LMCacheMPRequestMetadata(request_id="r", direction="STORE", op=op))
    builder.forget_range("r", 0, 128)  # the front, dropped (e.g. a duplicate)
    rest = builder.build(_submit(192, 256))  # the rest, its first chunk trimmed
    assert (rest.op.start, rest.op.end) == (192, 256)
    assert rest.op.block_ids == [list(range(12, 16))]


def _offer(builder: StoreBuilder, copied: list[int], live: list[int] | None) -> None:
    op = LoadStoreOp(token_ids=copied, block_ids=[list(range(16))], start=0, end=256)
    builder.offered(LMCacheMPRequestMetadata(request_id="r", direction="STORE", op=op), live)


def test_a_store_takes_the_offers_tokens_from_the_live_list_not_the_copy() -> None:
    """The offer's copy is not kept (young-generation GC cost, ``connector.stores``):
    the STORE carries the live list's first tokens, as many as the copy had, even
    after the request decoded more."""
    builder = StoreBuilder([16])
    live, copied = list(range(300)), list(range(300))
    _offer(builder, copied, live)
    copied.clear()  # the copy is LMCache's, gone with its metadata
    live.extend(range(300, 340))  # the request decodes on
    assert builder.build(_submit(0, 256)).op.token_ids == list(range(300))


def test_without_a_live_list_the_offers_copy_is_kept() -> None:
    for live in (None, list(range(100))):  # none, or one shorter than the copy
        builder = StoreBuilder([16])
        _offer(builder, list(range(300)), live)
        assert builder.build(_submit(0, 256)).op.token_ids == list(range(300))
