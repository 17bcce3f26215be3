"""``explain``: the causal story of one request's store ops, or of one token
step, from a replay (started where ``replay.seek`` allows).

:class:`ExplainObserver` follows one request id through a fold and records,
per store op (one offered chunk ``[start, end)`` of one generation of the
request): when it was buffered and with which blocks, every token step at
which one of its blocks sat in the danger window while it was buffered (rank
and depth), which block was reallocated and to whom (the request whose
offered chunk next used that block id, when the log shows one), why it was
rejected, held, dropped, skipped as stale or submitted, and the receipts
per worker. It also keeps a chronological list of every line.

Every drop gets a *cause chain* under its line (and in ``OpStory.chain``):
for a stale or evicted drop, the block's hash when buffered and when re-read,
and what changed it (a recorded prefix-cache reset, the request the block was
reallocated to, or a hash cleared with nothing in the log to say why), and
for an evicted op whose every chunk another request's completed batch had
stored, that batch and that nothing was lost; for a duplicate, the request
and batch whose completed store holds the content (or that it was stored
before the replay began); for every cause, what the
pins did (``OpStory.pins``: protected at finish or at selection, the shield
lifted on an empty step, released at settlement) and one line of what an
operator can do (``opstory.ADVICE``). To name a duplicate's storer the
observer remembers, for every batch it sees submitted, its content keys,
and for every stored one its batch (at most :data:`replay.storers.STORERS_MAX` keys).

One token step's events are ``replay.step``'s; block lists and messages
are summarised as ``replay.brief`` prints them.
"""

from __future__ import annotations

from typing import Any

from offload_fsm.state import State
from offload_fsm.vocabulary.commands import EndSession, ReadHashes
from offload_fsm.vocabulary.decisions import (
    BatchOrphaned,
    DropCause,
    OpsDropped,
    OpsHeld,
    OpSplit,
    OpsSelected,
    OpsShielded,
    ReceiptIgnored,
    ShieldLifted,
    StoreAbandoned,
    StoreSettled,
    StoreSubmitted,
)
from offload_fsm.vocabulary.events import (
    BlockHash,
    CandidateOffered,
    Event,
    HashesRead,
    LookupAnswered,
    PrefixCacheReset,
    ReceiptsArrived,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    StepScheduled,
)
from offload_fsm.vocabulary.outcome import Outcome
from replay.brief import blocks_text
from replay.opstory import ADVICE, DROP_WHY, OpStory, OpTracker
from replay.storers import Storers
from replay.text import field


class ExplainObserver:
    """One request's story (see the module docstring). Beyond the request, it
    keeps only what a cause chain needs: the prefix-cache resets, which
    request's batch stored each chunk of content (at most
    :data:`replay.storers.STORERS_MAX`, oldest forgotten first, as the core's own memory),
    and the reallocations of the request's own blocks."""

    def __init__(self, req_id: str, *, verbose: bool = False) -> None:
        self.req_id = req_id
        self.verbose = verbose
        self.seen = False
        self.first_seq = -1  # the first event this observer saw (where the replay began)
        self.tracker = OpTracker(lambda req_id: req_id == self.req_id)
        self.ops = self.tracker.ops.setdefault(req_id, [])  # the tracker appends to it
        self.lines: list[dict[str, Any]] = []  # {"seq", "step", "text", "ops": [starts]}
        self.block_users = self.tracker.block_users
        self.batches = self.tracker.batches
        self.resets: list[tuple[int, int]] = []  # (seq, step) of every PrefixCacheReset
        self.storers = Storers()  # which completed batch stored each chunk of content
        self.changes: dict[int, list[tuple[int, int, BlockHash]]] = {}  # our block -> changes
        self.read: dict[int, tuple[int, ...]] = {}  # our batch -> the block ids it re-read
        self.hashes_now: dict[int, BlockHash] = {}  # our block -> hash read at verification
        self.dropped_content: list[int] = []  # content keys of the drop being narrated
        self.event: Event | None = None  # the event whose decisions are being narrated

    # -- helpers ------------------------------------------------------------

    def _say(self, seq: int, state: State, text: str, ops: list[OpStory] | None = None) -> None:
        self.lines.append({"seq": seq, "step": state.step_index, "text": text,
                           "ops": [(o.generation, o.start_token) for o in ops or []]})
        for op in ops or []:
            op.notes.append(f"seq {seq} step {state.step_index}: {text}")

    # -- the observer -------------------------------------------------------

    def __call__(self, seq: int, event: Event, outcome: Outcome, state: State) -> None:
        me = self.req_id
        kind = type(event)
        self.event = event
        if self.first_seq < 0:
            self.first_seq = seq
        if kind is CandidateOffered:
            assert isinstance(event, CandidateOffered)
            op = self.tracker.offered(seq, event, outcome, state)
            if op is None:
                self._on_other_offer(seq, event, state)
            else:
                if op.status == "rejected":
                    self._say(seq, state, f"offered [{op.start_token}, {op.end_token}) and "
                              f"rejected: {op.cause}", [op])
                else:
                    self._say(seq, state, f"buffered [{op.start_token}, {op.end_token}) on "
                              f"{blocks_text(event.block_ids, self.verbose)}", [op])
        elif kind is StepScheduled:
            assert isinstance(event, StepScheduled)
            self._on_step(seq, event, state)
        elif kind is PrefixCacheReset:
            self.resets.append((seq, state.step_index))
            if any(op.status in ("buffered", "selected") for op in self.ops):
                self._say(seq, state, "the prefix cache was RESET (vLLM cleared every block "
                          "hash)", [op for op in self.ops
                                    if op.status in ("buffered", "selected")])
        elif kind is RequestArrived and event.req_id == me:  # type: ignore[union-attr]
            if self.seen:
                self._say(seq, state, "arrived again (new generation)")
            else:
                self._say(seq, state, "arrived")
            self.seen = True
        elif kind is RequestPreempted and event.req_id == me:  # type: ignore[union-attr]
            self._say(seq, state, "preempted: its blocks were freed, it restarts from token 0")
            self.tracker.preempted(me)
        elif kind is RequestFinished and event.req_id == me:  # type: ignore[union-attr]
            assert isinstance(event, RequestFinished)
            self._say(seq, state, f"finished with {event.free_blocks} free blocks in the queue")
        elif kind is HashesRead:
            assert isinstance(event, HashesRead)
            if event.batch_id in self.batches:
                self._say(seq, state, f"batch {event.batch_id}: current block hashes read "
                          "for verification", self.batches[event.batch_id])
                read = self.read.pop(event.batch_id, ())
                self.hashes_now.update(zip(read, event.block_hashes, strict=False))
        elif kind is ReceiptsArrived:
            assert isinstance(event, ReceiptsArrived)
            for req_id, count in event.completed:
                if req_id == me:
                    batch = self._in_flight_batch()
                    self._say(seq, state, f"{count} worker receipt(s) of {state.world_size} "
                              f"arrived" + (f" for batch {batch}" if batch >= 0 else ""),
                              self.batches.get(batch))
            if me in event.failed:
                batch = self._in_flight_batch()
                self._say(seq, state, "a worker reported the store FAILED",
                          self.batches.get(batch))
        for decision in outcome.decisions:
            self.storers.observe(seq, decision, state)
            if getattr(decision, "req_id", None) == me:
                keys = self._dropped_keys(decision)
                self.dropped_content = keys or []
                self._on_decision(seq, decision, self.tracker.decided(decision, state), state)
                if keys is not None and isinstance(decision, OpsDropped) \
                        and decision.cause is DropCause.DUPLICATE:
                    self._chain(decision, self.storers.duplicate_chain(keys, self.first_seq))
        for command in outcome.commands:
            if type(command) is EndSession and command.req_id == me:
                self._say(seq, state, "LMCache session ended")
            elif type(command) is ReadHashes and command.batch_id in self.batches:
                self.read[command.batch_id] = command.block_ids

    # -- what other requests did (for the cause chains) ---------------------

    def _dropped_keys(self, decision: object) -> list[int] | None:
        """For a duplicate or evicted drop of ours, the content keys it drops
        (read before the tracker trims or drops the ops)."""
        if type(decision) is not OpsDropped:
            return None
        assert isinstance(decision, OpsDropped)
        if decision.cause not in (DropCause.DUPLICATE, DropCause.EVICTED):
            return None
        return [key for op in self.ops if op.status in ("buffered", "selected")
                and op.overlaps(decision.start_token, decision.end_token)
                for key in op.chunk_keys_in(decision.start_token, decision.end_token)]

    def _chain(self, decision: OpsDropped, chain: list[str]) -> None:
        for op in self.ops:
            if op.status == "dropped" and op.start_token < decision.end_token and \
                    decision.start_token < op.end_token and not op.chain:
                op.chain = list(chain)
        if decision.ops == 0:  # a trim: the op goes on, its story keeps the chain as notes
            for op in self.ops:
                if op.start_token == decision.end_token and op.status != "dropped":
                    op.notes.extend(f"trimmed: {line}" for line in chain)
        self.lines[-1].setdefault("chain", []).extend(chain)

    def _on_other_offer(self, seq: int, event: CandidateOffered, state: State) -> None:
        """Another request's chunk covers blocks that our ops still need: with a
        new hash the block was reallocated (our data is gone); with the same hash
        it is a prefix-cache hit sharing our content (harmless)."""
        now = dict(zip(event.block_ids, event.block_hashes, strict=True))
        where = f"{event.req_id} (its chunk [{event.start_token}, {event.end_token}))"
        for op in self.ops:
            if op.status in ("buffered", "selected"):
                mine = dict(zip(op.block_ids, op.block_hashes, strict=True))
                lost = [b for b in op.block_ids if b in now and now[b] != mine[b]]
                shared = [b for b in op.block_ids if b in now and now[b] == mine[b]]
                if lost:
                    self._say(seq, state, f"{blocks_text(lost, self.verbose)} were reallocated "
                              f"to {where}", [op])
                if shared:
                    self._say(seq, state, f"{len(shared)} block(s) shared with {where} "
                              "(prefix-cache hit, content unchanged)", [op])

    def _in_flight_batch(self) -> int:
        for batch_id, ops in reversed(self.batches.items()):
            if any(op.status == "submitted" for op in ops):
                return batch_id
        return -1

    def _on_step(self, seq: int, event: StepScheduled, state: State) -> None:
        live = [op for op in self.ops if op.status in ("buffered", "selected")]
        if not live:
            return
        buffered = [op for op in live if op.status == "buffered"]
        ranks = {block_id: rank for rank, block_id in enumerate(event.window_block_ids)}
        for op in buffered:
            hits = [(ranks[b], b) for b in op.block_ids if b in ranks]
            if hits:
                rank, block_id = min(hits)
                op.at_risk.append({"seq": seq, "step": state.step_index, "block": block_id,
                                   "rank": rank, "depth": state.depth_blocks})
                self._say(seq, state, f"at risk: block {block_id} at free-queue rank {rank} "
                          f"(danger depth {state.depth_blocks})", [op])
        snapshot = {b: h for op in live
                    for b, h in zip(op.block_ids, op.block_hashes, strict=True)}
        for block_id, hash_now in event.reallocated:
            if block_id in snapshot and snapshot[block_id] != hash_now:
                self.changes.setdefault(block_id, []).append((seq, state.step_index, hash_now))
                user = self.block_users.get(block_id)
                whom = f" to {field(user[0])} (offered at seq {user[1]})" if user and \
                    user[0] != self.req_id else ""
                self._say(seq, state, f"block {block_id} was reallocated{whom}; "
                          f"hash {snapshot[block_id]} -> {hash_now}",
                          [op for op in live if block_id in op.block_ids])

    def _on_decision(self, seq: int, decision: object, moved: list[OpStory] | None,
                     state: State) -> None:
        """Narrate a decision about this request; ``moved``: the ops the
        tracker moved for it (None for decisions that move none)."""
        kind = type(decision)
        ops = moved or []
        at = f"seq {seq} (step {state.step_index})"
        if kind is OpsSelected:
            assert isinstance(decision, OpsSelected)
            rank = f", front rank {decision.rank}" if decision.rank >= 0 else ""
            for op in ops:
                op.pins.append(f"protected at {at}: selected into batch {decision.batch_id}")
                op.shielded = False
            self._say(seq, state, f"selected [{decision.start_token}, {decision.end_token}) "
                      f"({decision.ops} ops) into batch {decision.batch_id}: "
                      f"{decision.reason.value}{rank}", ops)
        elif kind is StoreSubmitted:
            assert isinstance(decision, StoreSubmitted)
            self._say(seq, state, f"hashes verified; store of [{decision.start_token}, "
                      f"{decision.end_token}) SUBMITTED ({decision.blocks} blocks, "
                      f"batch {decision.batch_id})", ops)
        elif kind is StoreSettled:
            assert isinstance(decision, StoreSettled)
            outcome = "failed" if decision.failed else "stored"
            orphan = " (orphaned batch)" if decision.orphaned else ""
            for op in ops:
                op.pins.append(f"released at {at}: batch {decision.batch_id} settled")
            self._say(seq, state, f"batch {decision.batch_id} settled: {decision.ops} ops "
                      f"{outcome.upper()}{orphan}; its blocks unpinned", ops)
        elif kind is StoreAbandoned:
            assert isinstance(decision, StoreAbandoned)
            for op in ops:
                op.pins.append(f"released at {at}: batch {decision.batch_id} abandoned")
            self._say(seq, state, f"batch {decision.batch_id} ABANDONED: {decision.receipts} "
                      f"of {state.world_size} receipts within {decision.waited_s:.1f} s; "
                      "its blocks unpinned", ops)
        elif kind is OpsDropped:
            assert isinstance(decision, OpsDropped)
            reused_by = ops[0].reused_by if ops else ""
            block = f"; block {decision.block_id}" if decision.block_id >= 0 else ""
            whom = f" reused by {field(reused_by)}" if reused_by else ""
            self._say(seq, state, f"DROPPED [{decision.start_token}, {decision.end_token}) "
                      f"({decision.ops} ops, {decision.tokens} tokens): "
                      f"{decision.cause.value}: {DROP_WHY[decision.cause.value]}{block}{whom}",
                      ops)
            if decision.cause is not DropCause.DUPLICATE:
                self._chain(decision, self._cause_chain(seq, decision, ops, state))
        elif kind is OpsHeld:
            assert isinstance(decision, OpsHeld)
            ops = [op for op in self.ops if op.status == "buffered"]
            self._say(seq, state, f"held ({decision.ops} ops due): {decision.reason.value}", ops)
        elif kind is OpsShielded:
            assert isinstance(decision, OpsShielded)
            ops = [op for op in self.ops if op.status == "buffered"]
            pinned = self._pinned_starts(state)
            lookup = self.event if type(self.event) is LookupAnswered else None
            when = "at finish" if lookup is None else f"at {field(lookup.req_id)}'s lookup"
            for op in ops:
                if op.start_token in pinned:
                    op.shielded = True
                    op.pins.append(f"protected at {at}: shielded {when}")
                else:
                    op.pins.append(f"NOT protected at {at}: outside the shield {when}")
            if lookup is None:
                why = (f"protected at finish: free queue {decision.free_blocks} < reach of "
                       f"the next step {decision.reach_blocks}")
            else:
                why = (f"protected at a lookup: request {field(lookup.req_id)}'s LMCache "
                       f"answer lets vLLM allocate {lookup.allocation_blocks} blocks at "
                       f"once, reaching {decision.reach_blocks} blocks into the free queue "
                       f"of {decision.free_blocks}, before any drain")
            self._say(seq, state, f"shielded {decision.ops} ops ({decision.blocks} blocks "
                      f"{why})", ops)
        elif kind is ShieldLifted:
            assert isinstance(decision, ShieldLifted)
            ops = [op for op in self.ops if op.status == "buffered" and op.shielded]
            for op in ops:
                op.shielded = False
                op.pins.append(f"released at {at}: the shield lifted on an empty step")
            self._say(seq, state, f"shield LIFTED: {decision.blocks} blocks of "
                      f"{decision.ops} ops unpinned (an empty step: the engine went idle, "
                      "and pins must not outlive the traffic; the ops stay buffered, "
                      "unprotected)", ops)
        elif kind is OpSplit:
            assert isinstance(decision, OpSplit)
            self._on_split(seq, decision, moved, state)
        elif kind is BatchOrphaned:
            assert isinstance(decision, BatchOrphaned)
            self._say(seq, state, f"batch {decision.batch_id} orphaned (detached from the "
                      "new generation)", self.batches.get(decision.batch_id))
        elif kind is ReceiptIgnored:
            assert isinstance(decision, ReceiptIgnored)
            self._say(seq, state, f"receipt ignored ({decision.count}, failed="
                      f"{decision.failed}): {decision.reason.value}")

    def _pinned_starts(self, state: State) -> set[int]:
        rec = state.requests.get(self.req_id)
        return {op.start_token for op in rec.ops if op.pinned} if rec is not None else set()

    def _cause_chain(self, seq: int, decision: OpsDropped, ops: list[OpStory],
                     state: State) -> list[str]:
        """Why ``decision`` dropped ``ops``: what changed the block, what the
        pins did, and what an operator can do."""
        cause = decision.cause
        chain: list[str] = []
        op = ops[0] if ops else None
        if cause in (DropCause.STALE, DropCause.EVICTED) and decision.block_id >= 0 \
                and op is not None:
            chain += self._block_history(decision.block_id, op)
        elif cause is DropCause.CACHE_RESET:
            chain.append(f"vLLM reset its prefix cache at seq {seq} (step {state.step_index}): "
                         "every block hash is gone, so no buffered store can be verified")
        elif cause is DropCause.PREEMPTED:
            chain.append(f"vLLM preempted the request at seq {seq} and freed its blocks")
        elif cause is DropCause.STORE_FAILED:
            chain.append("an earlier store of this request failed: LMCache retrieves a prefix "
                         "chunk by chunk, so what follows a hole cannot be used")
        elif cause in (DropCause.STALE, DropCause.EVICTED) and op is not None and \
                decision.block_id < 0:
            chain.append("an earlier op of this request was lost (the prefix chain broke), so "
                         "its later ops go too")
        if op is not None and op.pins:
            chain.append("pins: " + "; ".join(op.pins))
        elif op is not None and cause in (DropCause.STALE, DropCause.EVICTED,
                                          DropCause.CACHE_RESET):
            chain.append("pins: its blocks were never protected before this")
        stored = (self.storers.all_stored(self.dropped_content)
                  if cause is DropCause.EVICTED else [])
        if stored:
            chain += stored
            chain.append("what you can do: nothing: LMCache holds every chunk of it, stored by "
                         "the request above; the ledger counts the op as evicted all the same")
            return chain
        advice = ADVICE.get(cause.value)
        if advice:
            chain.append(f"what you can do: {advice}")
        return chain

    def _block_history(self, block_id: int, op: OpStory) -> list[str]:
        """What happened to ``block_id`` between ``op``'s buffering and now."""
        snapshot = dict(zip(op.block_ids, op.block_hashes, strict=True)).get(block_id)
        lines = []
        now = self.hashes_now.get(block_id, snapshot)
        if block_id in self.hashes_now:
            lines.append(f"block {block_id}: hash {_hash_text(snapshot)} when buffered, "
                         f"{_hash_text(now)} when re-read for verification")
        resets = [(s, step) for s, step in self.resets if s > op.buffered_seq]
        changes = [c for c in self.changes.get(block_id, []) if c[0] > op.buffered_seq]
        user = self.block_users.get(block_id)
        if resets:
            s, step = resets[-1]
            lines.append(f"what changed it: vLLM reset its prefix cache at seq {s} (step "
                         f"{step}), which cleared every block hash")
        elif user is not None and user[0] != self.req_id and user[1] > op.buffered_seq:
            lines.append(f"what changed it: vLLM reallocated the block to request "
                         f"{field(user[0])} (its chunk offered at seq {user[1]})"
                         + (f"; the new hash was seen at seq {changes[0][0]}" if changes
                            else ""))
        elif changes:
            s, step, _ = changes[0]
            lines.append(f"what changed it: vLLM reallocated the block at seq {s} (step "
                         f"{step}) to a request that has not offered it yet")
        elif now is None:
            lines.append("what changed it: its hash was cleared, and the log holds no reset "
                         "and no reallocation of it: vLLM clears hashes when it resets the "
                         "prefix cache (logs recorded before resets were recorded do not "
                         "show one) or hands the block to a new request")
        else:
            lines.append("what changed it: the log shows no reallocation of it before the "
                         "check (a reallocation of a block the core no longer watched)")
        return lines

    # -- output -------------------------------------------------------------

    def _on_split(self, seq: int, decision: OpSplit, fronts: list[OpStory] | None,
                  state: State) -> None:
        why = {"pin_budget": "the pin headroom", "shield": "the shield's headroom"}[
            decision.reason.value]
        split = decision.split_token
        self._say(seq, state, f"SPLIT [{decision.start_token}, {decision.end_token}) at token "
                  f"{split}: only its first {decision.front_blocks} blocks fit {why} "
                  f"({decision.reason.value}); [{split}, {decision.end_token}) stays buffered",
                  fronts)

    def selected_ops(self, tokens: tuple[int, int] | None) -> list[OpStory]:
        if tokens is None:
            return self.ops
        return [op for op in self.ops if op.overlaps(*tokens)]

    def to_json(self, tokens: tuple[int, int] | None = None) -> dict[str, Any]:
        ops = self.selected_ops(tokens)
        keys = {(op.generation, op.start_token) for op in ops}
        return {
            "req_id": self.req_id,
            "found": self.seen,
            "ops": [op.to_json() for op in ops],
            "story": [line for line in self.lines
                      if tokens is None or not line["ops"] or
                      any(tuple(k) in keys for k in line["ops"])],
        }


def _hash_text(block_hash: BlockHash) -> str:
    return "none (cleared)" if block_hash is None else f"{block_hash & (2**64 - 1):016x}"
