"""StoreBuilder keeps the rest of an op the core cut at a chunk boundary
(``OpSplit``): the front's STORE carries only the front's blocks, in every
KV group, and the rest's STORE finds its own; a STORE's token list is the
request's source as it was at the latest offer."""

from __future__ import annotations

import gc
import weakref

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


class _Tokens(list[int]):
    """vLLM's token list, as a list that can be weakly referenced."""


def test_a_finished_requests_source_is_packed_and_vllms_list_let_go() -> None:
    """Once packed, a finished request's STORE is what it was before, and the
    builder holds nothing the cyclic GC tracks for it: not vLLM's list."""
    builder = StoreBuilder([16])
    live = _Tokens(range(300))
    builder.offered("r", 0, 256, [list(range(16))], StoreSource(live, 300, "salt", None))
    live.append(300)  # the last output token, after the latest offer
    before = builder.build(_submit(0, 256))
    builder.finished("r")
    builder.pack()
    gone = weakref.ref(live)
    del live
    assert gone() is None
    after = builder.build(_submit(0, 256))
    assert after.op.token_ids == before.op.token_ids == list(range(300))
    assert (after.cache_salt, after.request_configs) == ("salt", None)
    assert not any(gc.is_tracked(held) for held in builder._packed.values())


def test_a_packed_source_keeps_an_empty_salt_empty_and_a_reused_id_takes_its_new_source(
) -> None:
    builder = StoreBuilder([16])
    builder.offered("r", 0, 256, [list(range(16))], StoreSource(list(range(256)), 256, "", None))
    builder.finished("r")
    builder.pack()
    assert builder.build(_submit(0, 256)).cache_salt == ""
    builder.offered("r", 0, 256, [list(range(16))], _source(list(range(1000, 1256))))
    assert "r" not in builder._packed  # in the live sources or the packed, never both
    builder.finished("r")  # not packed yet: the live source is the one built from
    store = builder.build(_submit(0, 256))
    assert store.op.token_ids == list(range(1000, 1256))
    assert store.cache_salt == "salt"


def test_a_source_with_request_configs_or_huge_key_ids_is_kept_as_it_is() -> None:
    builder = StoreBuilder([16])
    builder.offered("configs", 0, 256, [list(range(16))], _source(list(range(256))))
    huge = [1 << 70] * 256  # a key id past 64 bits
    builder.offered("huge", 0, 256, [list(range(16))], StoreSource(huge, 256, "", None))
    for req_id in ("configs", "huge"):
        builder.finished(req_id)
    builder.pack()
    assert builder._packed == {}
    configs = builder.build(SubmitStore(batch_id=0, req_id="configs", start_token=0,
                                        end_token=256, block_ids=()))
    assert configs.request_configs == {"lmcache.tag": "x"}
    assert builder.build(SubmitStore(batch_id=1, req_id="huge", start_token=0, end_token=256,
                                     block_ids=())).op.token_ids == huge


def test_a_forgotten_request_leaves_nothing_packed() -> None:
    builder = StoreBuilder([16])
    builder.offered("r", 0, 256, [list(range(16))], StoreSource(list(range(256)), 256, "s", None))
    builder.finished("r")
    builder.pack()
    builder.forget("r")
    assert (builder._latest, builder._packed, builder._salts) == ({}, {}, {})
