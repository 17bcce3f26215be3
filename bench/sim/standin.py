"""A stand-in for LMCache's scheduler-side server adapter (lookups only).

The scheduler role of ``LMCacheMPConnector`` talks to an LMCache server for three
things: the chunk size, prefix lookups (with lookup locks), and session bookkeeping.
Without workers the real server never holds data, so its lookups always miss. This
stand-in answers lookups from the chunks the *simulated* workers have stored in this
arm (an unbounded L1), which makes LMCache hits, and the RETRIEVE path, part of the
simulation. It also is the store-completion tracker LMCache's lazy manager uses
(``update_pending_store_count``: per-rank counts summed to the world size).

Chunk keys: the vLLM prefix-cache hash of the chunk's last block
(``request.block_hashes[(c + 1) * blocks_per_chunk - 1]``), which encodes the whole
token prefix up to the chunk's end; the ground-truth tracker uses the same keys.

It is installed by replacing the adapter class name in LMCache's connector module
before the scheduler (and so the connector) is constructed; see
``bench.sim.arms.build_engine``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

CHUNK_TOKENS = 256


class SimLMCache:
    """What one arm's LMCache server knows: stored chunk keys (unbounded). With
    ``keeps`` False it is a server that keeps nothing: every lookup answers 0
    hit tokens (``bench.simulate --lookups missing``)."""

    def __init__(self, block_size: int, world_size: int, keeps: bool = True) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = CHUNK_TOKENS // block_size
        self.world_size = world_size
        self.keeps = keeps
        self.stored: set[bytes] = set()
        self.requests: dict[str, Any] = {}  # request id -> vllm Request (set by the loop)
        self.lookups = 0
        self.hit_tokens = 0
        self.sessions_ended = 0

    def chunk_keys(self, req: Any, start: int, end: int) -> list[bytes]:
        hashes = req.block_hashes
        bpc = self.blocks_per_chunk
        out = []
        for c in range(start // CHUNK_TOKENS, end // CHUNK_TOKENS):
            j = (c + 1) * bpc - 1
            if j < len(hashes):
                out.append(bytes(hashes[j]))
        return out

    def lookup(self, req_id: str, n_tokens: int, reserve_last: bool) -> int:
        req = self.requests.get(req_id)
        self.lookups += 1
        if req is None or not self.keeps:
            return 0
        limit = n_tokens - 1 if reserve_last else n_tokens
        hashes = req.block_hashes
        bpc = self.blocks_per_chunk
        hit = 0
        c = 0
        while (c + 1) * CHUNK_TOKENS <= limit:
            j = (c + 1) * bpc - 1
            if j >= len(hashes) or bytes(hashes[j]) not in self.stored:
                break
            hit = (c + 1) * CHUNK_TOKENS
            c += 1
        self.hit_tokens += hit
        return hit


CURRENT: SimLMCache | None = None  # the arm being built/run


class StandInSchedulerAdapter:
    """Duck-typed ``LMCacheMPSchedulerAdapter`` for the scheduler role."""

    def __init__(self, server_urls: Any = None, context: Any = None, model_name: str = "",
                 vllm_block_size: int = 32, parallel_strategy: Any = None,
                 extra_config: Any = None, **_: Any) -> None:
        assert CURRENT is not None, "set bench.sim.standin.CURRENT before building the scheduler"
        self.sim = CURRENT
        try:  # simulate ``world_size`` workers (TP) without a TP vLLM config
            parallel_strategy = dataclasses.replace(parallel_strategy,
                                                    vllm_world_size=self.sim.world_size)
        except (TypeError, ValueError):
            pass
        self.parallel_strategy = parallel_strategy
        self.lmcache_tokens_per_chunk = CHUNK_TOKENS
        self._results: dict[str, int] = {}
        self._pending_counts: dict[str, int] = {}

    # lookups -----------------------------------------------------------------
    def maybe_submit_lookup_request(self, request_id: str, token_ids: list[int],
                                    cache_salt: str = "", request_configs: Any = None,
                                    reserve_last_token: bool = False) -> None:
        if request_id not in self._results:
            self._results[request_id] = self.sim.lookup(request_id, len(token_ids),
                                                        reserve_last_token)

    def check_lookup_result(self, request_id: str) -> int | None:
        return self._results.get(request_id)

    def cleanup_lookup_result(self, request_id: str) -> None:
        self._results.pop(request_id, None)

    def free_lookup_locks(self, **_: Any) -> None:
        return None

    # sessions and bookkeeping -----------------------------------------------
    def end_session(self, request_id: str) -> None:
        self.sim.sessions_ended += 1

    def report_block_allocations(self, records: Any) -> None:
        return None

    def reset_cache(self) -> bool:
        self.sim.stored.clear()
        return True

    def shutdown(self) -> None:
        return None

    def update_pending_store_count(self, req_id: str, count: int) -> bool:
        total = self._pending_counts.get(req_id, 0) + count
        if total >= self.sim.world_size:
            self._pending_counts.pop(req_id, None)
            return True
        self._pending_counts[req_id] = total
        return False

    @property
    def num_blocks_per_chunk(self) -> int:
        return self.sim.blocks_per_chunk

    @property
    def world_size(self) -> int:
        return self.sim.world_size

    @property
    def tp_size(self) -> int:
        return self.sim.world_size

    def is_healthy(self) -> bool:
        return True
