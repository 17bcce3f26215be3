"""What the core cannot hold: how to build each request's LMCache store.

The core sees a store op as a token range and flat block ids. LMCache needs
the request's token list, cache salt and request configs (from its latest
metadata) and each KV group's block ids. :class:`StoreBuilder` keeps these
per request and per op start, builds one coalesced STORE for a
``SubmitStore`` (the core may have trimmed already-stored leading chunks off
the first op), and forgets them when the core drops, rejects or ends them.
Its memory is bounded by what the core buffers. The core may cut an op at a
chunk boundary (``OpSplit``); a store or a drop that ends or starts inside
an op cuts the shell's record there too, so either side can go alone.

Token lists. LMCache's metadata carries a fresh copy of the request's whole
token list (``LMCacheMPRequestTracker.get_token_ids``), made on every offer.
Eager LMCache sends it at once and lets it go; a buffered op would keep it
for hundreds of steps, and until a second-generation collection promotes
it, every young collection of the cyclic GC visits each of its items: with
hundreds of buffered ops that is millions of items a collection, beside
vLLM's own requests' token lists. So when the
caller passes the request's live token list (vLLM's
``Request.all_token_ids``: append-only, and alive with the request anyway),
only it and the copy's length are kept, and the STORE's token list is
sliced from it when it is built: the same tokens as the copy. Without one
(no tracker, or multimodal prompt ids that differ from vLLM's), the copy is
kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestMetadata
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

from offload_fsm.vocabulary.commands import SubmitStore


class _Request(NamedTuple):
    """What a request's STOREs take from its latest offer: its token list's
    first ``num_tokens`` tokens (``tokens``: the live list, or the offer's
    copy), its cache salt and its request configs."""

    tokens: Sequence[int]
    num_tokens: int
    cache_salt: Any
    request_configs: Any


class StoreBuilder:
    def __init__(self, group_tokens_per_block: list[int]) -> None:
        self._group_tokens_per_block = list(group_tokens_per_block)
        self._latest: dict[str, _Request] = {}
        # req id -> op start token -> (op end token, per-group block ids)
        self._ops: dict[str, dict[int, tuple[int, list[list[int]]]]] = {}

    def offered(self, metadata: LMCacheMPRequestMetadata,
                live_tokens: Sequence[int] | None = None) -> None:
        """Note an offer. ``live_tokens``: the request's own append-only token
        list, whose first ``len(metadata.op.token_ids)`` tokens the offer's
        copy holds (kept instead of the copy: see the module docstring)."""
        op: Any = metadata.op
        copied = op.token_ids
        tokens = live_tokens if live_tokens is not None and len(live_tokens) >= len(copied) \
            else copied
        self._latest[metadata.request_id] = _Request(
            tokens, len(copied), metadata.cache_salt, metadata.request_configs)
        self._ops.setdefault(metadata.request_id, {})[op.start] = (op.end, op.block_ids)

    def build(self, command: SubmitStore) -> LMCacheMPRequestMetadata:
        latest = self._latest[command.req_id]
        ops = self._ops[command.req_id]
        self._cut(ops, command.end_token)
        start = max(s for s in ops if s <= command.start_token)
        end, first_groups = ops.pop(start)
        cut = command.start_token - start
        merged = [
            list(group[cut // tpb:]) if tpb > 0 else list(group)
            for group, tpb in zip(first_groups, self._group_tokens_per_block, strict=True)
        ]
        while end < command.end_token:
            end, group_block_ids = ops.pop(end)
            for into, group in zip(merged, group_block_ids, strict=True):
                into.extend(group)
        return LMCacheMPRequestMetadata(
            request_id=command.req_id,
            direction="STORE",
            op=LoadStoreOp(
                token_ids=list(latest.tokens[: latest.num_tokens]),
                block_ids=merged,
                start=command.start_token,
                end=command.end_token,
            ),
            cache_salt=latest.cache_salt,
            request_configs=latest.request_configs,
        )

    def _cut(self, ops: dict[int, tuple[int, list[list[int]]]], token: int) -> None:
        """Split the op that spans ``token`` there: the core cut it (``OpSplit``,
        a chunk boundary, so a block boundary of every group) and now names
        one side of the cut alone."""
        spanning = [start for start, (end, _) in ops.items() if start < token < end]
        if not spanning:
            return
        start = spanning[0]
        end, groups = ops.pop(start)
        cuts = [(token - start) // tpb if tpb > 0 else None
                for tpb in self._group_tokens_per_block]
        ops[start] = (token, [group[:cut] if cut is not None else group
                              for group, cut in zip(groups, cuts, strict=True)])
        ops[token] = (end, [group[cut:] if cut is not None else group
                            for group, cut in zip(groups, cuts, strict=True)])

    def forget_range(self, req_id: str, start: int, end: int) -> None:
        ops = self._ops.get(req_id)
        if not ops:
            return
        self._cut(ops, start)
        self._cut(ops, end)
        for op_start in [s for s in ops if start <= s < end]:
            del ops[op_start]

    def forget(self, req_id: str) -> None:
        self._latest.pop(req_id, None)
        self._ops.pop(req_id, None)

    def clear(self) -> None:
        self._latest.clear()
        self._ops.clear()
