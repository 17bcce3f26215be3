"""Shared helpers for the offload_fsm table tests.

:class:`Harness` drives the core through ``machine.drive`` with a scripted,
fully explicit block pool: the test owns the block hashes (``hashes``) and the
free queue (``queue``, eviction head first). Protected blocks are skipped when
the free queue is read, which is what vLLM's ``touch`` does, so the pin
cascade can be observed. Every ``feed`` checks the core's invariants.

For long, realistic event streams use ``offload_fsm.testing.world.World``
(see :func:`random_world_run`).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from offload_fsm import OffloadConfig, Policy, check_all, new_state, window_depth
from offload_fsm.machine import drive
from offload_fsm.state import State
from offload_fsm.testing.world import FakePool, World
from offload_fsm.vocabulary import events
from offload_fsm.vocabulary.commands import (
    Command,
    ProtectBlocks,
    ReadFreeQueue,
    ReadHashes,
    ReleaseBlocks,
)
from offload_fsm.vocabulary.decisions import StoreSettled
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

OP_TOKENS = 64
OP_BLOCKS = 2


def fifo(**overrides: Any) -> OffloadConfig:
    fields: dict[str, Any] = {"policy": Policy.FIFO}
    fields.update(overrides)
    return OffloadConfig(**fields)


def ea(**overrides: Any) -> OffloadConfig:
    fields: dict[str, Any] = {"policy": Policy.EVICTION_AWARE}
    fields.update(overrides)
    return OffloadConfig(**fields)


class Result:
    """What one observation led to: every (event, outcome) ``drive`` applied."""

    def __init__(self, applied: list[tuple[Event, Outcome]]) -> None:
        self.applied = applied
        self.decisions = [d for _, o in applied for d in o.decisions]
        self.commands = [c for _, o in applied for c in o.commands]
        self.events = [e for e, _ in applied]

    def of(self, kind: type | tuple[type, ...]) -> list[Any]:
        return [x for x in (*self.decisions, *self.commands, *self.events) if isinstance(x, kind)]

    def one(self, kind: type) -> Any:
        found = self.of(kind)
        assert len(found) == 1, f"expected one {kind.__name__}, got {found}"
        return found[0]


class Harness:
    def __init__(self, config: OffloadConfig, *, world_size: int = 1, check: bool = True) -> None:
        self.state: State = new_state(config, world_size=world_size)
        self.hashes: dict[int, int | None] = {}
        self.queue: list[int] = []  # the free queue, eviction head first
        self.pins: Counter[int] = Counter()
        self.log: list[tuple[Event, Outcome]] = []
        self.time_s = 0.0
        self.check = check
        self._next_block = 0
        self._next_hash = 1000
        self._next_start: dict[str, int] = {}
        self.blocks_of: dict[str, list[tuple[int, ...]]] = {}  # req -> blocks per offered op

    # -- the scripted shell -------------------------------------------------

    def execute(self, command: Command) -> Event | None:
        if isinstance(command, ProtectBlocks):
            self.pins.update(command.block_ids)
        elif isinstance(command, ReleaseBlocks):
            for block_id in command.block_ids:
                assert self.pins[block_id] > 0, f"block {block_id} released below zero"
                self.pins[block_id] -= 1
                if not self.pins[block_id]:
                    del self.pins[block_id]
        elif isinstance(command, ReadHashes):
            return events.HashesRead(
                batch_id=command.batch_id,
                block_hashes=tuple(self.hashes.get(b) for b in command.block_ids),
            )
        elif isinstance(command, ReadFreeQueue):
            window = tuple(self.visible()[: command.depth_blocks])
            return events.FreeQueueRead(window_block_ids=window)
        return None

    def visible(self) -> list[int]:
        """The free queue as vLLM would walk it: protected blocks left it."""
        return [b for b in self.queue if not self.pins.get(b)]

    def feed(self, event: Event) -> Result:
        applied = drive(self.state, event, self.execute)
        self.log.extend(applied)
        if self.check:
            assert check_all(self.state) == []
            assert dict(self.pins) == self.state.pins
        return Result(applied)

    # -- observations -------------------------------------------------------

    def new_blocks(self, count: int = OP_BLOCKS) -> tuple[int, ...]:
        blocks = tuple(range(self._next_block, self._next_block + count))
        self._next_block += count
        for block_id in blocks:
            self.hashes[block_id] = self._next_hash
            self._next_hash += 1
        return blocks

    def arrive(self, *req_ids: str) -> Result:
        results = [self.feed(events.RequestArrived(req_id=r)) for r in req_ids]
        return _merge(results)

    def offer(
        self,
        req_id: str,
        *,
        blocks: Sequence[int] | None = None,
        hashes: Sequence[int | None] | None = None,
        tokens: int = OP_TOKENS,
        start: int | None = None,
        time_s: float | None = None,
        blocks_per_chunk: int = 0,
    ) -> Result:
        """Offer the request's next contiguous range (fresh blocks by default)."""
        if blocks is None:
            blocks = self.new_blocks()
        blocks = tuple(blocks)
        if hashes is None:
            hashes = tuple(self.hashes.setdefault(b, self._fresh_hash()) for b in blocks)
        if start is None:
            start = self._next_start.get(req_id, 0)
        self._next_start[req_id] = start + tokens
        self.blocks_of.setdefault(req_id, []).append(blocks)
        return self.feed(
            events.CandidateOffered(
                req_id=req_id, start_token=start, end_token=start + tokens,
                block_ids=blocks, block_hashes=tuple(hashes),
                time_s=self.time_s if time_s is None else time_s,
                blocks_per_chunk=blocks_per_chunk,
            )
        )

    def offer_ops(self, req_id: str, count: int, **kwargs: Any) -> list[Result]:
        return [self.offer(req_id, **kwargs) for _ in range(count)]

    def blocks_in(self, req_id: str) -> tuple[int, ...]:
        """Every block the request's offered ops hold, in offer order."""
        return tuple(b for op in self.blocks_of[req_id] for b in op)

    def restart(self, req_id: str) -> None:
        """The request restarts from token 0 (preemption / id reuse)."""
        self._next_start.pop(req_id, None)
        self.blocks_of.pop(req_id, None)

    def tick(
        self,
        *,
        tokens: int = 16,
        allocated: int = 0,
        next_blocks: int = 0,
        requests: int | None = None,
        free: int | None = None,
        window: Sequence[int] | None = None,
        reallocated: Iterable[tuple[int, int | None]] = (),
        dt_s: float = 1.0,
    ) -> Result:
        """A token-producing step (``tokens`` > 0) or an empty one.
        ``requests`` (scheduled requests, the pin budget's reserve) defaults
        to 1 on a token step and 0 on an empty one."""
        self.time_s += dt_s
        if requests is None:
            requests = 1 if tokens else 0
        if free is None:
            free = len(self.visible())
        if window is None:
            depth = window_depth(self.state, scheduled_tokens=tokens,
                                 allocated_blocks=allocated, next_step_blocks=next_blocks)
            window = self.visible()[: min(depth, free)]
        return self.feed(
            events.StepScheduled(
                scheduled_tokens=tokens, allocated_blocks=allocated,
                next_step_blocks=next_blocks, reserve_blocks=requests, free_blocks=free,
                window_block_ids=tuple(window), reallocated=tuple(reallocated),
                time_s=self.time_s,
            )
        )

    def empty_step(self, dt_s: float = 1.0) -> Result:
        return self.tick(tokens=0, window=(), dt_s=dt_s)

    def finish(self, *req_ids: str, free: int | None = None) -> Result:
        results = []
        for req_id in req_ids:
            free_now = len(self.visible()) if free is None else free
            results.append(self.feed(events.RequestFinished(req_id=req_id, free_blocks=free_now)))
        return _merge(results)

    def preempt(self, req_id: str) -> Result:
        self.restart(req_id)
        return self.feed(events.RequestPreempted(req_id=req_id))

    def receipts(
        self, completed: dict[str, int] | None = None, failed: Iterable[str] = ()
    ) -> Result:
        return self.feed(
            events.ReceiptsArrived(completed=tuple((completed or {}).items()), failed=tuple(failed))
        )

    def complete(self, *req_ids: str) -> Result:
        """Every worker reports each request's in-flight store as done."""
        size = self.state.world_size
        return self.receipts({r: size for r in req_ids})

    def reset_cache(self) -> Result:
        return self.feed(events.PrefixCacheReset())

    def shutdown(self) -> Result:
        return self.feed(events.ShutdownRequested())

    # -- queries ------------------------------------------------------------

    def all_decisions(self) -> list[Any]:
        return [d for _, o in self.log for d in o.decisions]

    def all_commands(self) -> list[Any]:
        return [c for _, o in self.log for c in o.commands]

    def _fresh_hash(self) -> int:
        self._next_hash += 1
        return self._next_hash - 1


def _merge(results: list[Result]) -> Result:
    return Result([pair for r in results for pair in r.applied])


def shielded_then_cleared(h: Harness, req_id: str) -> tuple[int, ...]:
    """``req_id`` (one op of 4 blocks) finishes into a full free queue (shielded), the
    engine idles (the shield lifts), then its blocks' hashes are cleared as by a
    prefix-cache reset the core was not told of; returns its blocks. The next step
    whose window reaches them drops the op as stale (or for the reset, once the
    harness reports one)."""
    h.arrive(req_id)
    blocks = h.new_blocks(4)
    h.offer(req_id, blocks=blocks)
    h.queue = list(range(100, 140))
    h.tick(allocated=8, next_blocks=8)
    h.queue = [*blocks, *range(100, 140)]
    h.finish(req_id, free=2)
    h.empty_step()
    for block_id in blocks:
        h.hashes[block_id] = None
    return blocks


# --------------------------------------------------------------------------
# A seeded random driver over the fake World (determinism tests).


def random_world_run(policy: Policy, seed: int, actions: int) -> World:
    """Drive a World with a seeded pseudo-random workload. Uses only
    ``random.Random`` and sorted collections, so the event stream does not
    depend on PYTHONHASHSEED."""
    rng = random.Random(seed)
    config = OffloadConfig(
        policy=policy, threshold=2, select_count=2, horizon_steps=2.5,
        max_drain_per_step=3,
        max_deferral_seconds=0.05 if policy is Policy.EVICTION_AWARE else 0.0,
    )
    world = World(state=new_state(config, world_size=2), pool=FakePool(24))
    names = [f"req-{i}" for i in range(8)]

    def settled(applied_from: int, req_id: str) -> bool:
        return any(
            isinstance(d, StoreSettled) and d.req_id == req_id
            for _, outcome in world.applied[applied_from:] for d in outcome.decisions
        )

    for _ in range(actions):
        roll = rng.random()
        active = sorted(world.active)
        if roll < 0.15:
            idle = [n for n in names if n not in world.active]
            if idle:
                world.arrive(rng.choice(idle))  # may reuse a finished id
        elif roll < 0.55:
            advance = [r for r in active if rng.random() < 0.7][:3]
            world.schedule(advance, next_step_blocks=rng.randint(0, 6))
            for req_id in advance:
                if req_id in world.active and world.active[req_id].tokens >= 4 * 64:
                    world.finish(req_id)
        elif roll < 0.62:
            world.schedule([], next_step_blocks=0)
        elif roll < 0.75 and active:
            world.finish(rng.choice(active))
        elif roll < 0.80 and active:
            world.preempt(rng.choice(active))
        elif roll < 0.95 and world.in_flight:
            req_id = rng.choice(sorted(world.in_flight))
            count = rng.randint(1, 2)
            fail = rng.random() < 0.15
            mark = len(world.applied)
            world.receipts({req_id: count}, [req_id] if fail else [])
            if settled(mark, req_id):
                world.in_flight.pop(req_id, None)
        elif roll < 0.98:
            stray = rng.choice(names)
            if stray not in world.in_flight:
                world.receipts({stray: rng.randint(1, 3)})
        elif not world.active and not world.pins:
            world.reset_cache()
    return world
