"""The lazy path's store candidates: per step, only what a deferred store needs.

LMCache's scheduler side calls ``LMCacheMPRequestMetadata.GetStoreMetadata``
for every running request on every step (``_process_new_requests``,
``_process_cached_requests``), and for each request with a new chunk builds
metadata holding a fresh copy of the request's whole token list. Eager
needs that: it stores at once. A deferred store does not: it needs the
request, the token range and each KV group's block ids now, and LMCache's
metadata only if and when the store is submitted.

So on the lazy path the connector keeps LMCache's tracker bookkeeping as
LMCache does (scheduled tokens, appended block ids) and asks
:func:`chunk_due` instead: one integer comparison for a request without a
new chunk (no further call), and for one with a chunk :func:`storable_end`
and the slice of block ids it covers. ``connector.shell.stores`` builds
LMCache's metadata for what the core submits, from the request's
:func:`source_of`.

Contract of :func:`storable_end`: the end of the same range
``GetStoreMetadata`` would offer, under every limit LMCache's store path
honours per request: the tokens computed (scheduled plus the larger of the
vLLM and LMCache hits), allocated in every stored KV group, and known; the
prompt's end unless the decode cache is saved
(``lmcache.mp.save_decode_cache``); the request's own
``lmcache.max_offload_tokens`` (its request configs). The cache salt and
request configs ride on every STORE (:func:`source_of`); multimodal prompts
key on LMCache's adjusted prompt ids, a copy made at the offer as LMCache
makes it. ``tests/connector/test_candidates.py`` holds the range against
LMCache's own function on random trackers.
"""

from __future__ import annotations

from typing import Any

from connector.shell.stores import StoreSource

Tracker = Any  # lmcache's LMCacheMPRequestTracker (untyped here, as LMCache is)


def chunk_due(tracker: Tracker, chunk_tokens: int, save_decode_cache: bool) -> int:
    """The tokens the request's next offer may reach (computed: scheduled plus
    the larger of the vLLM and LMCache hits; within its prompt unless the
    decode cache is saved) when that is a whole chunk past its last offer,
    else 0: 0 for most running requests on most steps (decodes, a prompt's
    partial last chunk), which then cost the step no more than this test.
    :func:`storable_end` applies the other limits (allocation, known tokens,
    the request's cap)."""
    limit: int = tracker.num_scheduled_tokens + max(tracker.num_vllm_hit_tokens,
                                                    tracker.num_lmcache_hit_tokens)
    if not save_decode_cache and tracker.num_prompt_tokens < limit:
        limit = tracker.num_prompt_tokens
    stored: int = tracker.num_stored_tokens
    return limit if limit - stored >= chunk_tokens else 0


def storable_end(tracker: Tracker, chunk_tokens: int, group_tokens_per_block: list[int],
                 save_decode_cache: bool) -> int:
    """The end token of the request's next offer (a whole number of chunks
    from ``tracker.num_stored_tokens``), or 0 when no whole chunk is ready."""
    limit = chunk_due(tracker, chunk_tokens, save_decode_cache)
    if not limit:
        return 0
    stored = tracker.num_stored_tokens
    cap = tracker.max_offload_tokens
    if cap is not None and cap < limit:
        limit = cap
    allocated = tracker.allocated_block_ids
    limit = min(limit, len(tracker.all_token_ids), min(
        (len(allocated.get(group, ())) * tokens_per_block
         for group, tokens_per_block in enumerate(group_tokens_per_block)
         if tokens_per_block > 0), default=0))
    chunks = (limit - stored) // chunk_tokens
    return stored + chunks * chunk_tokens if chunks > 0 else 0


def source_of(tracker: Tracker) -> StoreSource:
    """What the request's STOREs take (``connector.shell.stores``): vLLM's own token
    list and its length now, or for a multimodal prompt LMCache's key ids."""
    tokens = tracker.get_token_ids() if tracker.mm_adjusted_prompt_ids else \
        tracker.all_token_ids
    return StoreSource(tokens, len(tokens), tracker.cache_salt, tracker.request_configs)
