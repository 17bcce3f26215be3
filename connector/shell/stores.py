"""What the core cannot hold: how to build each request's LMCache store.

The core sees a store op as a token range and flat block ids. LMCache needs
the request's token list, cache salt and request configs and each KV group's
block ids. :class:`StoreBuilder` keeps these per request
(:class:`StoreSource`) and per op start, builds one coalesced STORE for a
``SubmitStore`` (the core may have trimmed already-stored leading chunks off
the first op), and forgets them when the core drops, rejects or ends them.
Its memory is bounded by what the core buffers. The core may cut an op at a
chunk boundary (``OpSplit``); a store or a drop that ends or starts inside
an op cuts the shell's record there too, so either side can go alone.

Token lists. Eager LMCache copies the request's whole token list into the
metadata of every chunk it offers (``LMCacheMPRequestTracker.get_token_ids``)
and sends it at once. A buffered op would keep such a copy for hundreds of
steps, and every young collection of the cyclic GC would visit its items.
So a request's source holds vLLM's own token list (``Request.all_token_ids``:
append-only, and alive with the request anyway) and its length at the latest
offer, and the STORE's token list is sliced from it only when it is built:
the same tokens a copy at the offer would have held. Only multimodal
prompts, whose key ids differ from vLLM's, hold a copy
(``connector.shell.candidates``).

Finished requests. A request's buffered ops may wait long after it finished
(the eviction-aware policy stores them only near the eviction head), and its
source would keep three objects alive for every young collection of the
cyclic GC to count and visit: the ``StoreSource``, vLLM's token list and its
``ConstantList``. So the shell notes a finish (:meth:`StoreBuilder.finished`:
a list append on vLLM's step), and the next pass, beside the model, keeps only
what the request's STOREs take, in forms the GC does not track: its tokens
packed into ``bytes`` (:meth:`StoreBuilder.pack`, with the core's
``state.pack_ints``) and its cache salt (a ``str``). A source with request
configs stays as it is (a dict is tracked anyway), as does one whose key ids
do not fit 64 bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestMetadata
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

from offload_fsm.state import pack_ints, unpack_ints
from offload_fsm.vocabulary.commands import SubmitStore


class StoreSource(NamedTuple):
    """What a request's STOREs take from its latest offer: the first
    ``num_tokens`` of ``tokens`` (the key ids LMCache derives chunk keys
    from), its cache salt and its request configs."""

    tokens: Sequence[int]
    num_tokens: int
    cache_salt: Any
    request_configs: Any


class StoreBuilder:
    """Per request its :class:`StoreSource`; per buffered op, with several KV
    groups, each group's block ids. With one KV group (most models) the
    group's block ids are the core's flat ones, which every ``SubmitStore``
    carries, so nothing is kept per op."""

    def __init__(self, group_tokens_per_block: list[int]) -> None:
        self._group_tokens_per_block = list(group_tokens_per_block)
        self._one_group = len(self._group_tokens_per_block) == 1
        self._latest: dict[str, StoreSource] = {}
        # Finished requests' tokens, packed, and their salts where not empty (the
        # module docstring): a request is in ``_latest`` or ``_packed``, never both.
        self._packed: dict[str, bytes] = {}
        self._salts: dict[str, str] = {}
        self._finished: list[str] = []  # finished since the last pack, held in _latest
        # req id -> op start token -> (op end token, per-group block ids)
        self._ops: dict[str, dict[int, tuple[int, list[list[int]]]]] = {}

    def offered(self, req_id: str, start_token: int, end_token: int,
                group_block_ids: list[list[int]], source: StoreSource) -> None:
        """Note an offer of ``[start_token, end_token)`` with each KV group's
        block ids; ``source`` replaces the request's earlier one."""
        self._latest[req_id] = source
        if self._packed:  # a reused id: the new request's source wins
            self._packed.pop(req_id, None)
            self._salts.pop(req_id, None)
        if not self._one_group:
            self._ops.setdefault(req_id, {})[start_token] = (end_token, group_block_ids)

    def finished(self, req_id: str) -> None:
        """The request finished: its tokens are final. The next :meth:`pack`
        packs its source (a list append here, on vLLM's step)."""
        if req_id in self._latest:
            self._finished.append(req_id)

    def pack(self) -> None:
        """Pack the sources of the requests finished since the last call
        (beside the model: a copy of each one's tokens)."""
        finished, self._finished = self._finished, []
        latest = self._latest
        for req_id in finished:
            source = latest.get(req_id)
            if source is None or source.request_configs is not None \
                    or type(source.cache_salt) is not str:
                continue
            try:
                packed = pack_ints(source.tokens[: source.num_tokens])
            except (TypeError, OverflowError):  # a key id that is no 64-bit int: kept as it is
                continue
            del latest[req_id]
            self._packed[req_id] = packed
            if source.cache_salt:
                self._salts[req_id] = source.cache_salt

    def build(self, command: SubmitStore) -> LMCacheMPRequestMetadata:
        req_id = command.req_id
        latest = self._latest.get(req_id) or _unpacked(self._packed[req_id],
                                                       self._salts.get(req_id, ""))
        if self._one_group:
            return self._store(command, [list(command.block_ids)], latest)
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
        return self._store(command, merged, latest)

    def _store(self, command: SubmitStore, group_block_ids: list[list[int]],
               source: StoreSource) -> LMCacheMPRequestMetadata:
        return LMCacheMPRequestMetadata(
            request_id=command.req_id,
            direction="STORE",
            op=LoadStoreOp(
                token_ids=list(source.tokens[: source.num_tokens]),
                block_ids=group_block_ids,
                start=command.start_token,
                end=command.end_token,
            ),
            cache_salt=source.cache_salt,
            request_configs=source.request_configs,
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
        self._packed.pop(req_id, None)
        self._salts.pop(req_id, None)
        self._ops.pop(req_id, None)

    def clear(self) -> None:
        self._latest.clear()
        self._packed.clear()
        self._salts.clear()
        self._finished.clear()
        self._ops.clear()


def _unpacked(packed: bytes, cache_salt: str) -> StoreSource:
    tokens = unpack_ints(packed)
    return StoreSource(tokens, len(tokens), cache_salt, None)
