"""Where each store op went: from its offer to stored, failed, abandoned,
rejected or dropped (with the cause), reconstructed from a replay.

:class:`OpTracker` is fed the events and decisions of a fold (``explain``
narrates one request with it, ``timeline`` draws many): :meth:`offered` on
every ``CandidateOffered``, :meth:`preempted` on ``RequestPreempted`` (ops
offered after it belong to the next generation), :meth:`decided` on every
decision. It keeps one :class:`OpStory` per op of the requests it follows,
in offer order, and moves it through the statuses ``buffered``, ``selected``
(taken into a verifying batch), ``submitted``, then ``stored``, ``failed``
or ``abandoned`` (its batch's receipts never all arrived); or ``rejected``
at the offer, or ``dropped`` with a :class:`~offload_fsm.vocabulary.decisions.DropCause`.
An ``OpSplit`` cuts an op's story in two (the rest is buffered behind the
front, as in the core). A duplicate drop of no whole op (``ops=0``) trims an op instead: its leading
chunks are stored elsewhere, the rest goes on (``start_token`` moves on,
``trimmed_tokens`` counts the cut).
Ops are matched to decisions by request and token range, as the core
reports them; a batch's ops by batch id. It also remembers, for every block
id, the request that last offered a chunk on it (who reused a block).
:data:`DROP_WHY` says what each drop cause means and :data:`ADVICE` what an
operator can do about it (``explain``, ``timeline``, the demo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from offload_fsm.state import State
from offload_fsm.vocabulary.decisions import (
    OpRejected,
    OpsDropped,
    OpSplit,
    OpsSelected,
    StoreAbandoned,
    StoreSettled,
    StoreSubmitted,
)
from offload_fsm.vocabulary.events import CandidateOffered
from offload_fsm.vocabulary.outcome import Outcome

ENDED = ("stored", "failed", "abandoned", "rejected", "dropped")

DROP_WHY = {
    "evicted": "a block was reallocated before the drain",
    "stale": "a block's hash changed before the store (skipped, never stored)",
    "preempted": "the request was preempted",
    "id_reuse": "the request id was reused",
    "store_failed": "held behind a failed store (prefix chain broken)",
    "cache_reset": "the prefix cache was reset",
    "shutdown": "the connector shut down",
    "duplicate": "another request's batch already stored the same content (not a loss)",
}

# What an operator can do about each cause, one line (none where nothing helps).
ADVICE = {
    "evicted": "drain sooner: raise lmcache.mp.lazy_offload_horizon_steps or "
               "lmcache.mp.lazy_offload_max_drain_per_step (FIFO: lower "
               "lmcache.mp.lazy_offload_threshold); `replay whatif LOG --set KEY=VALUE` "
               "estimates the effect",
    "stale": "if a reset caused it, nothing to tune (store before resetting: "
             "lmcache.mp.lazy_offload_idle_flush_steps); otherwise drain sooner, as for "
             "evicted (lmcache.mp.lazy_offload_horizon_steps)",
    "cache_reset": "expected after reset_prefix_cache(); to store finished requests first, "
                   "turn on the tail flush (lmcache.mp.lazy_offload_idle_flush_steps) and "
                   "reset once the engine has been idle that long",
    "preempted": "vLLM ran out of KV blocks: give it more (gpu_memory_utilization) or run "
                 "fewer requests at once (max_num_seqs)",
    "id_reuse": "give every request a unique id",
    "store_failed": "look in the LMCache server's log for the failed store; the request's "
                    "later ops cannot be used without it",
    "shutdown": "set lmcache.mp.lazy_offload_shutdown_flush_s to store what is buffered "
                "when vLLM shuts down",
}


@attrs.define(kw_only=True)
class OpStory:
    generation: int
    start_token: int
    end_token: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[int | None, ...]
    buffered_seq: int
    buffered_step: int
    blocks_per_chunk: int = 0
    op_id: int = -1  # the core's op id (-1: rejected, never an op)
    status: str = "buffered"  # buffered, selected, submitted, or one of ENDED
    cause: str = ""
    block_id: int = -1
    reused_by: str = ""
    batch_id: int = -1
    trimmed_tokens: int = 0  # leading tokens cut off as duplicates (start_token moved on)
    selected_step: int = -1
    ended_step: int = -1  # token step it was stored, failed, abandoned, rejected or dropped
    at_risk: list[dict[str, int]] = attrs.Factory(list)
    notes: list[str] = attrs.Factory(list)
    pins: list[str] = attrs.Factory(list)  # when its blocks were protected and released
    shielded: bool = False  # protected at finish, until selected or the shield lifts
    chain: list[str] = attrs.Factory(list)  # why it ended as it did (``explain``)

    def overlaps(self, start: int, end: int) -> bool:
        return self.start_token < end and start < self.end_token

    def chunk_keys_in(self, start: int, end: int) -> list[int]:
        """The content keys (each chunk's last block hash, as the core's
        ``Op.chunk_keys``) of its chunks inside ``[start, end)``."""
        step = self.blocks_per_chunk or len(self.block_ids)
        chunks = max(1, len(self.block_ids) // step) if step else 1
        tokens = (self.end_token - self.start_token) // chunks
        keys = []
        for number in range(chunks):
            first = self.start_token + number * tokens
            key = self.block_hashes[(number + 1) * step - 1] if step else None
            if start <= first and first + tokens <= end and key is not None:
                keys.append(key)
        return keys

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


class OpTracker:
    def __init__(self, follows: Callable[[str], bool]) -> None:
        self.follows = follows
        self.ops: dict[str, list[OpStory]] = {}  # request id -> its ops, in offer order
        self.generation: dict[str, int] = {}
        self.batches: dict[int, list[OpStory]] = {}
        self.block_users: dict[int, tuple[str, int]] = {}  # block -> (req, seq) last offered

    def of(self, req_id: str) -> list[OpStory]:
        return self.ops.get(req_id, [])

    def live(self, req_id: str, start: int, end: int, statuses: tuple[str, ...]
             ) -> list[OpStory]:
        return [op for op in self.ops.get(req_id, ())
                if op.status in statuses and start <= op.start_token < end]

    def offered(self, seq: int, event: CandidateOffered, outcome: Outcome, state: State
                ) -> OpStory | None:
        """The new op's story, when the tracker follows its request."""
        for block_id in event.block_ids:
            self.block_users[block_id] = (event.req_id, seq)
        if not self.follows(event.req_id):
            return None
        op = OpStory(generation=self.generation.get(event.req_id, 0),
                     start_token=event.start_token, end_token=event.end_token,
                     block_ids=event.block_ids, block_hashes=event.block_hashes,
                     buffered_seq=seq, buffered_step=state.step_index,
                     blocks_per_chunk=event.blocks_per_chunk)
        rejected = [d for d in outcome.decisions if isinstance(d, OpRejected)]
        if rejected:
            op.status, op.cause = "rejected", rejected[0].reason.value
            op.ended_step = state.step_index
        else:
            op.op_id = state.next_op_id - 1
        self.ops.setdefault(event.req_id, []).append(op)
        return op

    def preempted(self, req_id: str) -> None:
        self.generation[req_id] = self.generation.get(req_id, 0) + 1

    def decided(self, decision: object, state: State) -> list[OpStory] | None:
        """Move the ops a decision names; the ops moved, or None when the
        decision is not about an op's lifecycle or the request is not followed."""
        req_id = getattr(decision, "req_id", None)
        if req_id is None or not self.follows(req_id):
            return None
        kind = type(decision)
        step = state.step_index
        if kind is OpsSelected:
            assert isinstance(decision, OpsSelected)
            ops = self.live(req_id, decision.start_token, decision.end_token, ("buffered",))
            for op in ops:
                op.status, op.batch_id, op.selected_step = "selected", decision.batch_id, step
            self.batches[decision.batch_id] = ops
            return ops
        if kind is StoreSubmitted:
            assert isinstance(decision, StoreSubmitted)
            ops = self.live(req_id, decision.start_token, decision.end_token, ("selected",))
            for op in ops:
                op.status = "submitted"
            return ops
        if kind is StoreSettled or kind is StoreAbandoned:
            assert isinstance(decision, StoreSettled | StoreAbandoned)
            ops = [op for op in self.batches.get(decision.batch_id, [])
                   if op.status == "submitted"]
            if isinstance(decision, StoreAbandoned):
                outcome = "abandoned"
            else:
                outcome = "failed" if decision.failed else "stored"
            for op in ops:
                op.status, op.ended_step = outcome, step
            return ops
        if kind is OpsDropped:
            assert isinstance(decision, OpsDropped)
            if decision.ops == 0:  # a trim: leading chunks already stored elsewhere
                return self._trim(req_id, decision.start_token, decision.end_token)
            ops = self.live(req_id, decision.start_token, decision.end_token,
                            ("buffered", "selected"))
            reused_by = ""
            if decision.block_id >= 0:
                user = self.block_users.get(decision.block_id)
                if user is not None and user[0] != req_id:
                    reused_by = user[0]
            for op in ops:
                op.status, op.cause, op.block_id = "dropped", decision.cause.value, \
                    decision.block_id
                op.reused_by, op.ended_step = reused_by, step
            return ops
        if kind is OpSplit:
            assert isinstance(decision, OpSplit)
            return self._split(req_id, decision)
        return None

    def _split(self, req_id: str, decision: OpSplit) -> list[OpStory]:
        """Cut the op's story where the core cut the op: the rest (same
        buffering, inserted right behind it) has its own fate from here on.
        Returns the fronts."""
        cut, split = decision.front_blocks, decision.split_token
        ops = [op for op in self.live(req_id, decision.start_token, split, ("buffered",))
               if op.end_token == decision.end_token]
        stories = self.ops[req_id] if ops else []
        for op in ops:
            rest = attrs.evolve(op, start_token=split, block_ids=op.block_ids[cut:],
                                block_hashes=op.block_hashes[cut:],
                                at_risk=list(op.at_risk), notes=list(op.notes),
                                pins=list(op.pins), chain=[])
            op.end_token, op.block_ids = split, op.block_ids[:cut]
            op.block_hashes = op.block_hashes[:cut]
            stories.insert(stories.index(op) + 1, rest)
        return ops

    def _trim(self, req_id: str, start: int, end: int) -> list[OpStory]:
        """Cut ``[start, end)`` off the front of the op that starts at ``start``;
        its blocks in proportion (an op covers whole blocks)."""
        ops = self.live(req_id, start, start + 1, ("buffered", "selected"))
        for op in ops:
            cut = len(op.block_ids) * (end - start) // (op.end_token - op.start_token)
            op.block_ids, op.block_hashes = op.block_ids[cut:], op.block_hashes[cut:]
            op.start_token, op.trimmed_tokens = end, op.trimmed_tokens + end - start
        return ops
