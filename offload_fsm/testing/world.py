"""A small, deterministic stand-in for vLLM's block pool and scheduler, and a
shell that executes the core's commands against it.

Used by the stateful tests, the table tests and the replay tests to produce
realistic event streams without vLLM. It models exactly what the core relies
on: a free queue with the eviction head first, hashed blocks rejoining at the
tail and hashless ones at the head, reallocation resetting a block's hash,
``touch`` dequeuing on 0 -> 1, per-worker store receipts, and a waiting
request's lookup read as the connector reads it (``lookup``: the reach of
the allocation that follows, ``LookupAnswered``).

The world also checks the core from outside (``World.violations``): a
submitted store covers only protected blocks whose hashes still equal the
snapshot taken when the range was offered; an op dropped as evicted or stale
really lost a block; a session ends only for a finished request.

Faults (in the spirit of FoundationDB's buggify): ``fail_commands`` makes the
executor raise on the next command of a type (the shell then switches to
drain-only mode, ``offload_fsm.after_failure``, exactly as the connector does);
``intrude`` lets an unmodelled consumer take blocks from the free-queue head,
reported with the next step (an eviction just before a drain) or not at all
(only the hash check can catch it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import attrs

from offload_fsm.after_failure import DrainOnly
from offload_fsm.machine import drive
from offload_fsm.queries import watches, window_depth
from offload_fsm.state import State
from offload_fsm.vocabulary import events
from offload_fsm.vocabulary.commands import (
    Command,
    EndSession,
    ProtectBlocks,
    ReadFreeQueue,
    ReadHashes,
    ReleaseBlocks,
    SubmitStore,
)
from offload_fsm.vocabulary.config import Policy
from offload_fsm.vocabulary.decisions import DropCause, OpsDropped, StoreAbandoned, StoreSettled
from offload_fsm.vocabulary.errors import CommandFailed, StepFailed
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome


class FakePool:
    """Blocks with hashes and reference counts, and an LRU free queue."""

    def __init__(self, num_blocks: int) -> None:
        self.hashes: list[int | None] = [None] * num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._next_hash = 1

    def allocate(self, count: int) -> list[int] | None:
        if len(self.free) < count:
            return None
        taken = []
        for _ in range(count):
            block_id, _ = self.free.popitem(last=False)
            self.hashes[block_id] = None  # evicted: its cached content is gone
            self.ref_cnt[block_id] = 1
            taken.append(block_id)
        return taken

    def fill(self, block_id: int, content_hash: int | None = None) -> int:
        """The block was computed: it gets ``content_hash`` (content computed
        before, e.g. a shared system prompt on another block) or a fresh hash."""
        if content_hash is None:
            content_hash = self._next_hash
            self._next_hash += 1
        self.hashes[block_id] = content_hash
        return content_hash

    def touch(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free[block_id]
            self.ref_cnt[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            assert self.ref_cnt[block_id] > 0, f"block {block_id} released below zero"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free[block_id] = None
                if self.hashes[block_id] is None:
                    self.free.move_to_end(block_id, last=False)

    def window(self, depth: int) -> tuple[int, ...]:
        out: list[int] = []
        for block_id in self.free:
            if len(out) >= depth:
                break
            out.append(block_id)
        return tuple(out)

    def reset_hashes(self) -> None:
        for block_id in self.free:
            self.hashes[block_id] = None


@attrs.define(eq=False)
class FakeRequest:
    req_id: str
    blocks: list[int] = attrs.Factory(list)
    tokens: int = 0
    snapshots: dict[int, dict[int, int | None]] = attrs.Factory(dict)  # start -> block -> hash


@attrs.define(eq=False)
class World:
    """The fake engine. ``chunk_blocks`` blocks of ``block_tokens`` make one op."""

    state: State
    pool: FakePool
    block_tokens: int = 32
    chunk_blocks: int = 2
    shared_first_chunk: bool = False  # every request's first block has the same content
    time_s: float = 0.0
    active: dict[str, FakeRequest] = attrs.Factory(dict)
    finished: dict[str, FakeRequest] = attrs.Factory(dict)  # awaiting session end
    in_flight: dict[str, SubmitStore] = attrs.Factory(dict)
    submissions: list[SubmitStore] = attrs.Factory(list)
    pins: dict[int, int] = attrs.Factory(dict)
    sessions_ended: list[str] = attrs.Factory(list)
    applied: list[tuple[Event, Outcome]] = attrs.Factory(list)
    violations: list[str] = attrs.Factory(list)
    step_metadata: list[SubmitStore] = attrs.Factory(list)
    fail_commands: set[type] = attrs.Factory(set)  # raise once on the next of each type
    drain: DrainOnly | None = None  # set once the shell failed
    failure: str = ""
    drain_on_failure: bool = True  # False: a failed step raises, as drive does
    intruders: list[int] = attrs.Factory(list)  # blocks an unmodelled consumer holds
    reported_intruders: list[int] = attrs.Factory(list)  # to report with the next step

    # -- driving the core -------------------------------------------------

    def feed(self, event: Event) -> list[tuple[Event, Outcome]]:
        if self.drain is not None:
            self._drain_feed(event)
            return []
        try:
            applied = drive(self.state, event, self.execute)
        except (StepFailed, CommandFailed) as error:
            if not self.drain_on_failure:
                raise
            self._applied(list(error.applied))
            self.failure = error.reason
            submitted = {r: (c.batch_id, c.block_ids) for r, c in self.in_flight.items()}
            unexecuted = error.unexecuted if isinstance(error, CommandFailed) else ()
            self.drain, commands = DrainOnly.take_over(self.state, submitted, self.pins,
                                                       self.time_s, unexecuted)
            for command in commands:
                self.execute(command)
            return list(error.applied)
        self._applied(applied)
        return applied

    def _applied(self, applied: list[tuple[Event, Outcome]]) -> None:
        for _, outcome in applied:
            for decision in outcome.decisions:
                if isinstance(decision, OpsDropped):
                    self._check_drop(decision)
                elif isinstance(decision, StoreSettled | StoreAbandoned):
                    held = self.in_flight.get(decision.req_id)
                    if held is not None and held.batch_id == decision.batch_id:
                        del self.in_flight[decision.req_id]
        self.applied.extend(applied)

    def _drain_feed(self, event: Event) -> None:
        """Drain-only mode: what the connector's shell does after a failure."""
        drain = self.drain
        assert drain is not None
        commands: list[Command] = []
        if isinstance(event, events.StepScheduled):
            commands = drain.step(event.time_s)
        elif isinstance(event, events.ReceiptsArrived):
            commands = drain.receipts(dict(event.completed), event.failed)
        elif isinstance(event, events.RequestFinished):
            commands = drain.finished(event.req_id)
        elif isinstance(event, events.RequestArrived):
            drain.arrived(event.req_id)
        elif isinstance(event, events.ShutdownRequested):
            commands = drain.shutdown()
        for command in commands:
            if isinstance(command, ReleaseBlocks) and command.batch_id >= 0:
                self.in_flight = {r: c for r, c in self.in_flight.items()
                                  if c.batch_id != command.batch_id}
            self.execute(command)

    def release_intruders(self) -> None:
        self.pool.release(self.intruders)
        self.intruders = []
        self.reported_intruders = []

    def intrude(self, count: int, *, report: bool) -> None:
        """An unmodelled consumer takes ``count`` blocks from the free-queue head
        and overwrites them (their hashes change)."""
        blocks = self.pool.allocate(min(count, len(self.pool.free))) or []
        for block_id in blocks:
            self.pool.fill(block_id)
        self.intruders.extend(blocks)
        if report:
            self.reported_intruders.extend(blocks)

    def execute(self, command: Command) -> Event | None:
        if type(command) in self.fail_commands and self.drain is None:
            self.fail_commands.discard(type(command))
            raise RuntimeError(f"injected failure executing {type(command).__name__}")
        if isinstance(command, ProtectBlocks):
            self.pool.touch(command.block_ids)
            for block_id in command.block_ids:
                self.pins[block_id] = self.pins.get(block_id, 0) + 1
        elif isinstance(command, ReadHashes):
            return events.HashesRead(
                batch_id=command.batch_id,
                block_hashes=tuple(self.pool.hashes[b] for b in command.block_ids),
            )
        elif isinstance(command, ReadFreeQueue):
            return events.FreeQueueRead(window_block_ids=self.pool.window(command.depth_blocks))
        elif isinstance(command, SubmitStore):
            self._check_submit(command)
            self.in_flight[command.req_id] = command
            self.submissions.append(command)
            self.step_metadata.append(command)
        elif isinstance(command, ReleaseBlocks):
            for block_id in command.block_ids:
                left = self.pins.get(block_id, 0) - 1
                if left < 0:
                    self.violations.append(f"block {block_id} released more than protected")
                    continue
                if left:
                    self.pins[block_id] = left
                else:
                    del self.pins[block_id]
            self.pool.release(command.block_ids)
        elif isinstance(command, EndSession):
            if command.req_id in self.active and command.req_id not in self.finished:
                self.violations.append(f"session of running request {command.req_id} ended")
            self.finished.pop(command.req_id, None)
            self.sessions_ended.append(command.req_id)
        return None

    # -- observations -----------------------------------------------------

    def arrive(self, req_id: str) -> None:
        assert req_id not in self.active
        self.active[req_id] = FakeRequest(req_id=req_id)
        self.feed(events.RequestArrived(req_id=req_id))

    def schedule(self, advance: Iterable[str], *, next_step_blocks: int, dt_s: float = 0.01) -> int:
        """One engine step: each named active request computes one more chunk
        (allocating blocks; a request that cannot get blocks is skipped).
        Offers its range, then reports the step. Returns scheduled tokens."""
        self.time_s += dt_s
        self.step_metadata = []
        allocated: list[int] = []
        offers: list[events.CandidateOffered] = []
        for req_id in advance:
            req = self.active[req_id]
            blocks = self.pool.allocate(self.chunk_blocks)
            if blocks is None:
                continue
            start = req.tokens
            shared = self.shared_first_chunk and start == 0
            hashes = tuple(  # a shared first block: chunk-level dedup trims it
                self.pool.fill(b, -1 if shared and i == 0 else None) for i, b in enumerate(blocks)
            )
            req.blocks.extend(blocks)
            req.tokens += self.chunk_blocks * self.block_tokens
            req.snapshots[start] = dict(zip(blocks, hashes, strict=True))
            allocated.extend(blocks)
            offers.append(
                events.CandidateOffered(req_id=req_id, start_token=start, end_token=req.tokens,
                                 block_ids=tuple(blocks), block_hashes=hashes,
                                 time_s=self.time_s, blocks_per_chunk=1)
            )
        tokens = len(offers) * self.chunk_blocks * self.block_tokens
        for offer in offers:
            self.feed(offer)
        if tokens:  # reported with the next token step (empty steps carry none)
            allocated = self.reported_intruders + allocated
            self.reported_intruders = []
        depth = window_depth(self.state, scheduled_tokens=tokens,
                             allocated_blocks=len(allocated), next_step_blocks=next_step_blocks)
        window = self.pool.window(min(depth, len(self.pool.free)))
        reallocated = tuple(
            (b, self.pool.hashes[b]) for b in allocated if watches(self.state, b)
        )
        self.feed(
            events.StepScheduled(scheduled_tokens=tokens, allocated_blocks=len(allocated),
                          next_step_blocks=next_step_blocks,
                          reserve_blocks=len(offers), free_blocks=len(self.pool.free),
                          window_block_ids=window if tokens else (),
                          reallocated=reallocated if tokens else (), time_s=self.time_s)
        )
        if not self.reported_intruders and self.intruders:  # the consumer lets go
            self.pool.release(self.intruders)
            self.intruders = []
        return tokens

    def lookup(self, req_id: str, allocation_blocks: int) -> None:
        """LMCache answered ``req_id``'s lookup and vLLM allocates
        ``allocation_blocks`` for it next: under EVICTION_AWARE, the free
        queue's head through the ``allocation_blocks``-th block no buffered
        op covers, fed when a covered one is among them (as
        ``connector.shell.lookahead`` reads it)."""
        state = self.state
        owners = state.owners
        if state.config.policy is not Policy.EVICTION_AWARE or not owners or \
                self.drain is not None:
            return
        window: list[int] = []
        left = allocation_blocks
        for block_id in self.pool.free:
            if not left:
                break
            window.append(block_id)
            left -= block_id not in owners
        if any(block_id in owners for block_id in window):
            self.feed(events.LookupAnswered(
                req_id=req_id, allocation_blocks=allocation_blocks,
                free_blocks=len(self.pool.free), window_block_ids=tuple(window)))

    def finish(self, req_id: str) -> None:
        req = self.active.pop(req_id)
        self.finished[req_id] = req
        self.feed(events.RequestFinished(req_id=req_id, free_blocks=len(self.pool.free)))
        self.pool.release(reversed(req.blocks))

    def preempt(self, req_id: str) -> None:
        req = self.active[req_id]
        self.feed(events.RequestPreempted(req_id=req_id))
        self.pool.release(reversed(req.blocks))
        self.active[req_id] = FakeRequest(req_id=req_id)
        self.feed(events.RequestArrived(req_id=req_id))

    def receipts(self, completed: dict[str, int], failed: Iterable[str] = ()) -> None:
        self.feed(events.ReceiptsArrived(completed=tuple(completed.items()), failed=tuple(failed)))

    def settle_all(self) -> None:
        """Every worker reports every in-flight store as completed."""
        world_size = self.state.world_size
        while self.in_flight:
            pending = dict.fromkeys(self.in_flight, world_size)
            self.in_flight.clear()
            self.receipts(pending)

    def reset_cache(self) -> None:
        self.pool.reset_hashes()
        self.feed(events.PrefixCacheReset())

    def shutdown(self) -> None:
        self.feed(events.ShutdownRequested())

    # -- outside checks ---------------------------------------------------

    def _snapshot(self, req_id: str) -> dict[int, int | None]:
        req = self.active.get(req_id) or self.finished.get(req_id)
        if req is None:
            return {}
        merged: dict[int, int | None] = {}
        for snap in req.snapshots.values():
            merged.update(snap)
        return merged

    def _check_submit(self, command: SubmitStore) -> None:
        snapshot = self._snapshot(command.req_id)
        for block_id in command.block_ids:
            if self.pool.ref_cnt[block_id] == 0 or block_id not in self.pins:
                self.violations.append(f"{command}: block {block_id} submitted unprotected")
            if block_id in snapshot and self.pool.hashes[block_id] != snapshot[block_id]:
                self.violations.append(f"{command}: block {block_id} is stale")

    def _check_drop(self, decision: OpsDropped) -> None:
        if decision.cause not in (DropCause.EVICTED, DropCause.STALE) or decision.block_id < 0:
            return
        snapshot = self._snapshot(decision.req_id)
        block_id = decision.block_id
        if block_id in snapshot and self.pool.hashes[block_id] == snapshot[block_id]:
            self.violations.append(f"{decision}: block {block_id} was intact")
