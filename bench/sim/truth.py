"""Ground truth and loss attribution: what the simulator knows that no arm does.

Contract, ground truth (:class:`GroundTruth`): every whole chunk of a prompt is
keyed as LMCache keys it (the prefix-cache hash of the chunk's last block);
when a block of a chunk is evicted from vLLM's prefix cache for good, the chunk
is remembered as *evicted*, and as *open* if LMCache held it (stored, or a
store of it in flight) at that moment. A later prompt containing an evicted
chunk *needs* it, and the arm *recalled* it if it was open; recalled chunks
that some store wrote are *useful*. Chunk keys reach LMCache's stand-in
(``SimLMCache.stored``), and count as written, only when a store's last rank
reported and no rank failed.

Contract, loss attribution (:class:`LossAttribution`, lazy arms only): when a
block that some buffered op offered is reallocated while the op is still
buffered, with the content it had when offered, the op is lost, once, and
classified by mechanism from the last drain's snapshot: ``blind_window`` (its
request finished at or after that drain), ``preempted``, ``not_due(fifo)``
(FIFO drains on a threshold, not on eviction risk), ``freed_after_drain`` /
``outran_window`` (not in the free queue the drain walked, whole or cut short),
``in_window_not_drained`` (within the danger depth), ``pin_cascade`` (within the
depth plus the blocks the drain pinned), ``outran_window`` beyond that.

Theory of operation: the hooks (:mod:`bench.sim.hooks`) call in at each offer,
eviction, drain and finished request; the loop registers each released prompt
and the workers each store's submission and completion. Watchers are ints and
strings in dicts, never a tuple or list per watched block: the cyclic GC
tracks containers, and one per offered block would fill its young generation
and land its collections in the lazy arms' timed connector calls.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any, NamedTuple

from bench.sim.arms import BLOCK_TOKENS, CHUNK_TOKENS, ArmSpec
from bench.sim.results import ArmResult
from bench.sim.standin import SimLMCache
from bench.sim.views import ManagerView


class Retired(NamedTuple):
    """What the simulator keeps of a finished request: the block hashes that
    lazy stores and the loss attribution still read. vLLM lets go of the
    ``Request`` (its token lists with it); keeping it would grow the heap for
    the whole run and bring the young collections due more often than in vLLM."""

    block_hashes: list[Any]


class GroundTruth:
    def __init__(self, lm: SimLMCache, res: ArmResult) -> None:
        self.lm = lm
        self.res = res
        self.block2chunk: dict[bytes, bytes] = {}
        self.evicted_open: dict[bytes, bool] = {}  # chunk key -> was in LMCache at eviction
        self.inflight_keys: dict[bytes, int] = defaultdict(int)
        self.written: set[bytes] = set()
        self.useful: set[bytes] = set()

    def register_prompt(self, req: Any) -> None:
        """Key the prompt's whole chunks; count each evicted one as needed (and
        recalled when it was open)."""
        hashes = req.block_hashes
        n_prompt = len(req.prompt_token_ids)
        bpc = CHUNK_TOKENS // BLOCK_TOKENS
        for c in range(n_prompt // CHUNK_TOKENS):
            key = bytes(hashes[(c + 1) * bpc - 1])
            for j in range(c * bpc, (c + 1) * bpc):
                self.block2chunk[bytes(hashes[j])] = key
            was = self.evicted_open.pop(key, None)
            if was is not None:
                self.res.needed += 1
                if was:
                    self.res.recalled += 1
                    self.useful.add(key)
        self.res.prompt_tokens += n_prompt

    def evicted(self, block_hash: bytes) -> None:
        """The last cached block with ``block_hash`` was evicted."""
        key = self.block2chunk.get(block_hash)
        if key is not None and key not in self.evicted_open:
            self.evicted_open[key] = key in self.lm.stored or self.inflight_keys.get(key, 0) > 0

    def store_submitted(self, keys: list[bytes]) -> None:
        for k in keys:
            self.inflight_keys[k] += 1

    def store_completed(self, keys: list[bytes], failed: bool) -> None:
        """A store's last rank reported: its chunks are in LMCache unless a rank failed."""
        for k in keys:
            self.inflight_keys[k] -= 1
            if self.inflight_keys[k] <= 0:
                del self.inflight_keys[k]
            if not failed:
                self.lm.stored.add(k)
                self.written.add(k)


class LossAttribution:
    def __init__(self, arm: ArmSpec, view: ManagerView, pool: Any,
                 requests: dict[str, Any]) -> None:
        self.arm = arm
        self.view = view
        self.pool = pool
        self.requests = requests
        # Who watches a block: block id -> its latest watcher's number; a watcher is
        # "request id US start US snapshot hash hex" (``watcher_text``), and
        # ``watcher_next`` links it to the block's previous watcher.
        self.watch: dict[int, int] = {}
        self.watcher_text: dict[int, str] = {}
        self.watcher_next: dict[int, int] = {}
        self.watcher_numbers = itertools.count()
        self.lost: dict[tuple[str, int], str] = {}
        self.finish_step: dict[str, int] = {}
        # (step, free-queue rank by block id, depth, blocks pinned, walked the whole queue)
        self.last_drain: tuple[int, dict[int, int], int, int, bool] = (-1, {}, 0, 0, True)
        self._free_before = 0
        self._pre_ranks: dict[int, int] = {}
        self._walked_all = True

    def offered(self, req_id: str, start: int, block_ids: list[int]) -> None:
        """A lazy manager was offered ``block_ids`` of ``req_id``'s op at
        ``start``: watch its blocks with their content now."""
        blocks, watch, numbers = self.pool.blocks, self.watch, self.watcher_numbers
        text, after = self.watcher_text, self.watcher_next
        head = f"{req_id}\x1f{start}\x1f"
        for b in block_ids:
            number = next(numbers)
            text[number] = head + blocks[b].block_hash.hex()
            before = watch.get(b)
            if before is not None:
                after[number] = before
            watch[b] = number

    def finished(self, rid: str, step: int) -> None:
        self.finish_step[rid] = step

    def before_drain(self) -> None:
        """Rank the free queue's head (up to 8192 blocks) as the drain will see it."""
        q = self.pool.free_block_queue
        depth = min(self.pool.get_num_free_blocks(), 8192)
        ranks: dict[int, int] = {}
        b = q.fake_free_list_head.next_free_block
        tail = q.fake_free_list_tail
        i = 0
        while b is not None and b is not tail and i < depth:
            ranks[b.block_id] = i
            b = b.next_free_block
            i += 1
        self._free_before = self.pool.get_num_free_blocks()
        self._pre_ranks = ranks
        self._walked_all = i >= self._free_before

    def after_drain(self, step: int) -> None:
        pinned = max(0, self._free_before - self.pool.get_num_free_blocks())
        self.last_drain = (step, self._pre_ranks, self.view.depth(), pinned,
                           self._walked_all)

    def evicted(self, block_id: int, bh_group: Any) -> None:
        """Block ``block_id`` (cached as ``bh_group``) was evicted: every still-buffered
        op watching it with that content is lost, the oldest watcher first."""
        number = self.watch.pop(block_id, None)
        if number is None or self.view.mgr is None:
            return
        snap_now = bh_group.hex()
        text, after = self.watcher_text, self.watcher_next
        watchers = []
        while number is not None:
            watchers.append(text.pop(number))
            number = after.pop(number, None)
        for watcher in reversed(watchers):  # the oldest first
            rid, start_text, snap = watcher.split("\x1f")
            start = int(start_text)
            if snap != snap_now or (rid, start) in self.lost:
                continue
            if not self.view.is_pending(rid, start):
                continue
            self.lost[(rid, start)] = self._classify(rid, block_id)

    def _classify(self, rid: str, block_id: int) -> str:
        dstep, ranks, depth, pinned, walked_all = self.last_drain
        fs = self.finish_step.get(rid)
        if fs is not None and fs >= dstep:
            return "blind_window"
        req = self.requests.get(rid)
        if type(req) is not Retired and req is not None and req.status.name == "PREEMPTED":
            return "preempted"
        rank = ranks.get(block_id)
        if self.arm.policy == "FIFO":
            return "not_due(fifo)"
        if rank is None:
            # not in the free queue when the last drain ran: freed after it (by another
            # holder finishing, or a preemption), i.e. the blind window again
            return "freed_after_drain" if walked_all else "outran_window"
        if rank < depth:
            return "in_window_not_drained"
        if rank < depth + pinned:
            return "pin_cascade"
        return "outran_window"

    def by_mechanism(self) -> dict[str, int]:
        losses: dict[str, int] = defaultdict(int)
        for mech in self.lost.values():
            losses[mech] += 1
        return dict(losses)
