"""The lazy store-candidate path offers exactly what LMCache's store path
would (``connector.shell.candidates``): on random request trackers, the range, the
block ids and the stored-token mark are those of LMCache's own
``GetStoreMetadata``, under each limit it honours per request (the request's
``lmcache.max_offload_tokens``, the decode-cache setting, hits, allocation in
every KV group); the STORE built at submit carries the cache salt, the
request configs and, for a multimodal prompt, LMCache's key ids."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from testkit.env import require_stack

require_stack()  # skips without vLLM and LMCache; fails under CI=true

from lmcache.integration.vllm.lmcache_mp_metadata import (  # noqa: E402
    LMCacheMPRequestMetadata,
    LMCacheMPRequestTracker,
)
from lmcache.v1.multiprocess.group_view import slice_block_ids_per_group  # noqa: E402

from connector.shell.candidates import chunk_due, source_of, storable_end  # noqa: E402
from connector.shell.stores import StoreBuilder  # noqa: E402
from offload_fsm.vocabulary.commands import SubmitStore  # noqa: E402

CHUNK = 256


def _tracker(**fields: Any) -> Any:
    tracker = object.__new__(LMCacheMPRequestTracker)
    defaults = dict(request_id="r", cache_salt="", request_configs=None,
                    max_offload_tokens=None, lookup_started_at=None,
                    mm_adjusted_prompt_ids=[], num_stored_tokens=0, num_scheduled_tokens=0,
                    num_vllm_hit_tokens=0, num_lmcache_hit_tokens=0)
    for name, value in {**defaults, **fields}.items():
        setattr(tracker, name, value)
    return tracker


@st.composite
def trackers(draw: st.DrawFn) -> tuple[Any, list[int]]:
    groups = draw(st.sampled_from([[16], [32], [16, 32], [64, 0]]))
    prompt = draw(st.integers(0, 3000))
    decoded = draw(st.integers(0, 600))
    total = prompt + decoded
    stored = draw(st.integers(0, max(0, total) // CHUNK)) * CHUNK
    scheduled = draw(st.integers(0, total))
    allocated = {}
    for group, tokens_per_block in enumerate(groups):
        if tokens_per_block and draw(st.booleans() | st.just(True)):
            count = draw(st.integers(0, -(-total // tokens_per_block) + 2))
            allocated[group] = list(range(1000 * group, 1000 * group + count))
    cap = draw(st.none() | st.integers(0, total + CHUNK))
    tracker = _tracker(
        all_token_ids=list(range(total)), num_prompt_tokens=prompt,
        allocated_block_ids=allocated, num_stored_tokens=stored,
        num_scheduled_tokens=scheduled,
        num_vllm_hit_tokens=draw(st.integers(0, total)),
        num_lmcache_hit_tokens=draw(st.integers(0, total)),
        max_offload_tokens=cap, request_configs=None if cap is None else
        {"lmcache.max_offload_tokens": cap},
    )
    return tracker, groups


@settings(max_examples=400, deadline=None)
@given(trackers(), st.booleans())
def test_the_range_is_lmcaches_own(drawn: tuple[Any, list[int]], save_decode: bool) -> None:
    tracker, groups = drawn
    start = tracker.num_stored_tokens
    expected = LMCacheMPRequestMetadata.GetStoreMetadata(
        tracker, CHUNK, groups, save_decode_cache=save_decode)
    stored_after = tracker.num_stored_tokens
    tracker.num_stored_tokens = start
    end = storable_end(tracker, CHUNK, groups, save_decode)
    # The connector's loops ask chunk_due first and skip the request when it
    # says no: it must never skip one LMCache would store.
    assert chunk_due(tracker, CHUNK, save_decode) or expected is None
    if expected is None:
        assert end == 0
        assert stored_after == start
        return
    assert (start, end) == (expected.op.start, expected.op.end)
    assert slice_block_ids_per_group(tracker.allocated_block_ids, groups, start, end) == \
        expected.op.block_ids
    assert stored_after == end


def test_a_request_capped_by_max_offload_tokens_offers_nothing_past_the_cap() -> None:
    tracker = _tracker(all_token_ids=list(range(2048)), num_prompt_tokens=2048,
                       allocated_block_ids={0: list(range(128))}, num_scheduled_tokens=2048,
                       max_offload_tokens=600,
                       request_configs={"lmcache.max_offload_tokens": 600})
    assert storable_end(tracker, CHUNK, [16], False) == 512
    tracker.num_stored_tokens = 512
    assert storable_end(tracker, CHUNK, [16], False) == 0


def test_decoded_tokens_are_offered_only_when_the_decode_cache_is_saved() -> None:
    tracker = _tracker(all_token_ids=list(range(1024)), num_prompt_tokens=300,
                       allocated_block_ids={0: list(range(64))}, num_scheduled_tokens=1024)
    assert storable_end(tracker, CHUNK, [16], False) == 256
    assert storable_end(tracker, CHUNK, [16], True) == 1024


def test_the_store_carries_the_salt_the_configs_and_the_key_ids() -> None:
    configs = {"lmcache.tag.user": "a"}
    plain = _tracker(all_token_ids=list(range(512)), num_prompt_tokens=512,
                     cache_salt="salt-a", request_configs=configs)
    multimodal = _tracker(all_token_ids=list(range(512)), num_prompt_tokens=512,
                          mm_adjusted_prompt_ids=[-7] * 512, cache_salt="salt-b")
    for tracker, salt, first in ((plain, "salt-a", 0), (multimodal, "salt-b", -7)):
        builder = StoreBuilder([16])
        builder.offered("r", 0, 512, [list(range(32))], source_of(tracker))
        store = builder.build(SubmitStore(batch_id=0, req_id="r", start_token=0,
                                          end_token=512, block_ids=()))
        assert store.cache_salt == salt
        assert store.op.token_ids[0] == first and len(store.op.token_ids) == 512
        assert store.request_configs == (configs if tracker is plain else None)
    assert source_of(plain).tokens is plain.all_token_ids  # no copy for a text prompt


def test_the_real_tracker_is_read_as_lmcache_builds_it() -> None:
    """Fields come from a real tracker made from a request, not only the fakes above."""
    request = SimpleNamespace(
        request_id="r", cache_salt="s", sampling_params=None, all_token_ids=list(range(600)),
        num_prompt_tokens=600, prompt_token_ids=list(range(600)), mm_features=None)
    tracker = LMCacheMPRequestTracker(request)  # type: ignore[arg-type]
    tracker.append_block_ids(([*range(40)],))
    tracker.increase_num_scheduled_tokens(600)
    assert storable_end(tracker, CHUNK, [16], False) == 512
    assert source_of(tracker).cache_salt == "s"


def test_a_chunk_is_due_once_a_whole_chunk_is_computed_within_the_prompt() -> None:
    tracker = _tracker(all_token_ids=list(range(600)), num_prompt_tokens=600,
                       allocated_block_ids={0: list(range(40))}, num_scheduled_tokens=255)
    assert not chunk_due(tracker, CHUNK, False)
    tracker.num_scheduled_tokens = 256  # exactly one chunk
    assert chunk_due(tracker, CHUNK, False)
    assert storable_end(tracker, CHUNK, [16], False) == 256
    tracker.num_stored_tokens = 512
    tracker.num_scheduled_tokens = 600 + 300  # decoding past the prompt's partial chunk
    assert not chunk_due(tracker, CHUNK, False)
    assert chunk_due(tracker, CHUNK, True)
