"""A seeded synthetic serving workload over the fake engine, for golden logs,
tests, benchmarks and demos of the replay tool.

:func:`run_workload` drives :class:`offload_fsm.testing.world.World` like a
small continuous-batching server: requests arrive up to a concurrency limit,
each step advances every running request by one chunk while the block pool
has room, requests finish at their target length (freeing their blocks),
the youngest request holding blocks is preempted when nothing can make
progress, and each
submitted store is confirmed by every worker one to three steps later (a
few report a failure). Every applied callback goes to ``sink(applied, state)`` as the
connector would hand it to its recorder. Same arguments, same events.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import attrs

from offload_fsm.state import State, new_state
from offload_fsm.testing.world import FakePool, World
from offload_fsm.vocabulary.config import OffloadConfig, Policy
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome

Sink = Callable[[Sequence[tuple[Event, Outcome]], State], None]


@attrs.define(eq=False)
class RecordingWorld(World):
    """A :class:`World` that hands every callback's applied events to ``sink``."""

    sink: Sink | None = None

    def feed(self, event: Event) -> list[tuple[Event, Outcome]]:
        applied = super().feed(event)
        if self.sink is not None:
            self.sink(applied, self.state)
        return applied


def default_config(policy: Policy = Policy.EVICTION_AWARE) -> OffloadConfig:
    return OffloadConfig(policy=policy, threshold=4, select_count=4,
                         horizon_steps=2.5, max_drain_per_step=16,
                         max_deferral_seconds=0.5 if policy is Policy.EVICTION_AWARE else 0.0)


def run_workload(
    *,
    requests: int,
    seed: int = 0,
    config: OffloadConfig | None = None,
    world_size: int = 2,
    pool_blocks: int = 160,
    concurrency: int = 12,
    max_chunks: int = 8,
    fail_rate: float = 0.02,
    keep_applied: bool = True,
    sink: Sink | None = None,
) -> RecordingWorld:
    """Run ``requests`` requests to completion, then shut down; returns the world."""
    rng = random.Random(seed)
    world = RecordingWorld(
        state=new_state(config or default_config(), world_size=world_size),
        pool=FakePool(pool_blocks), sink=sink,
    )
    targets: dict[str, int] = {}
    arrived = 0
    receipts_due: dict[int, list[str]] = {}
    step = 0
    while arrived < requests or world.active:
        step += 1
        while arrived < requests and len(world.active) < concurrency:
            req_id = f"req-{arrived}"
            arrived += 1
            targets[req_id] = rng.randint(1, max_chunks)
            world.arrive(req_id)
        advance = sorted(world.active, key=lambda r: int(r[4:]))
        next_blocks = len(advance) * world.chunk_blocks
        submitted_before = len(world.submissions)
        tokens = world.schedule(advance, next_step_blocks=next_blocks)
        for store in world.submissions[submitted_before:]:
            receipts_due.setdefault(step + rng.randint(1, 3), []).append(store.req_id)
        holding = [r for r, request in world.active.items() if request.blocks]
        if tokens == 0 and holding:
            world.preempt(max(holding, key=lambda r: int(r[4:])))
        for req_id in advance:
            request = world.active.get(req_id)
            if request is not None and request.tokens >= targets[req_id] * 64:
                world.finish(req_id)
        due = receipts_due.pop(step, [])
        if due:
            failed = [req_id for req_id in due if rng.random() < fail_rate]
            world.receipts(dict.fromkeys(due, world_size), failed)
        if not keep_applied:
            world.applied.clear()
            world.submissions.clear()
    for when in sorted(receipts_due):
        world.receipts(dict.fromkeys(receipts_due[when], world_size))
    world.shutdown()
    return world
