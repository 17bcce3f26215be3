"""StoreBuilder keeps the rest of an op the core cut at a chunk boundary
(``OpSplit``): the front's STORE carries only the front's blocks, in every
KV group, and the rest's STORE finds its own; a STORE's token list is the
request's source as it was at the latest offer."""

from __future__ import annotations

from connector.shell.stores import StoreBuilder, StoreSource
from offload_fsm.vocabulary.commands import SubmitStore


def _submit(start: int, end: int) -> SubmitStore:
    return SubmitStore(batch_id=0, req_id="r", start_token=start, end_token=end, block_ids=())


def _source(tokens: list[int]) -> StoreSource:
    return StoreSource(tokens, len(tokens), "salt", {"lmcache.tag": "x"})


def test_a_cut_op_is_stored_front_first_then_the_rest() -> None:
    builder = StoreBuilder([16, 32])  # two KV groups: 16 and 32 tokens a block
    builder.offered("r", 0, 256, [list(range(16)), list(range(8))], _source(list(range(256))))
    front = builder.build(_submit(0, 128))
    assert (front.op.start, front.op.end) == (0, 128)
    assert front.op.block_ids == [list(range(8)), list(range(4))]
    rest = builder.build(_submit(128, 256))
    assert (rest.op.start, rest.op.end) == (128, 256)
    assert rest.op.block_ids == [list(range(8, 16)), list(range(4, 8))]


def test_dropping_a_cut_op_front_keeps_its_rest() -> None:
    builder = StoreBuilder([16, 32])
    builder.offered("r", 0, 256, [list(range(16)), list(range(8))], _source(list(range(256))))
    builder.forget_range("r", 0, 128)  # the front, dropped (e.g. a duplicate)
    rest = builder.build(_submit(192, 256))  # the rest, its first chunk trimmed
    assert (rest.op.start, rest.op.end) == (192, 256)
    assert rest.op.block_ids == [list(range(12, 16)), list(range(6, 8))]


def test_with_one_kv_group_the_store_takes_the_cores_block_ids_and_nothing_is_kept_per_op(
) -> None:
    builder = StoreBuilder([16])
    builder.offered("r", 0, 256, [list(range(16))], _source(list(range(256))))
    builder.offered("r", 256, 512, [list(range(16, 32))], _source(list(range(512))))
    assert builder._ops == {}  # one source per request, no record per op
    store = builder.build(SubmitStore(batch_id=0, req_id="r", start_token=128, end_token=512,
                                      block_ids=tuple(range(8, 32))))
    assert (store.op.start, store.op.end) == (128, 512)
    assert store.op.block_ids == [list(range(8, 32))]
    assert store.op.token_ids == list(range(512))


def test_a_store_takes_the_sources_first_tokens_and_its_salt_and_configs() -> None:
    """The source is vLLM's live token list: the STORE carries as many of its
    tokens as it had at the offer, even after the request decoded more."""
    builder = StoreBuilder([16])
    live = list(range(300))
    builder.offered("r", 0, 256, [list(range(16))], _source(live))
    live.extend(range(300, 340))  # the request decodes on
    store = builder.build(_submit(0, 256))
    assert store.op.token_ids == list(range(300))
    assert (store.cache_salt, store.request_configs) == ("salt", {"lmcache.tag": "x"})
