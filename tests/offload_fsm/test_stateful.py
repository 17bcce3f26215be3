"""Model-based test: the machine, driven through a fake engine, against a
simple reference model, once per policy.

The reference model is the fake world itself plus three facts it can check
from outside: a submitted store covers only protected blocks whose hashes are
unchanged since offer; an op dropped as evicted or stale really lost a block;
sessions end only for finished requests. After every rule all of the core's
invariants must hold and the world's pin counts must equal the core's. The
ending delivers every receipt, finishes every request and shuts down: then no
pin may remain and the ledger must close with nothing pending.

A waiting request's lookup may be answered (its allocation's reach fed as
the connector feeds it) and a big allocation take the free queue's head
right after it, before any drain. Faults are rules too: receipts reordered,
duplicated and lost (the receipt lease lets a silent batch go), consumers
that take blocks from the free-queue head just before a drain (reported, or
not at all), and
exceptions raised by the shell's command executor (the shell then drains
what LMCache holds, ``offload_fsm.after_failure``). Every run ends with every
pin released, every finished session ended and no stale store.

With the idle tail flush on (``idle_flush_steps``, both policies), one more
rule lets the engine idle the way vLLM does: empty steps while
``keeps_stepping`` says so, every receipt delivered; it must go quiet
within a bounded number of steps with no finished request left buffered.
"""

from __future__ import annotations

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from offload_fsm import OffloadConfig, Policy, check_all, new_state
from offload_fsm.invariants import ledger_terms
from offload_fsm.queries import keeps_stepping
from offload_fsm.testing.world import FakePool, World
from offload_fsm.vocabulary.commands import (
    ProtectBlocks,
    ReadFreeQueue,
    ReadHashes,
    ReleaseBlocks,
    SubmitStore,
)
from offload_fsm.vocabulary.decisions import StoreSettled

REQUEST_IDS = ("a", "b", "c", "d", "e")
WORLD_SIZE = 2
MAX_CHUNKS = 3  # a request finishes by itself after this many chunks
LEASE_S = 0.2  # 20 steps of the world's 10 ms
COMMANDS = (ProtectBlocks, ReadHashes, ReadFreeQueue, SubmitStore, ReleaseBlocks)


class OffloadMachine(RuleBasedStateMachine):
    policy: Policy = Policy.EVICTION_AWARE
    idle_flush_steps = 0

    def __init__(self) -> None:
        super().__init__()
        config = OffloadConfig(
            policy=self.policy, threshold=2, select_count=2,
            horizon_steps=2.5, max_drain_per_step=3,
            max_deferral_seconds=0.05 if self.policy is Policy.EVICTION_AWARE else 0.0,
            receipt_lease_s=LEASE_S, idle_flush_steps=self.idle_flush_steps,
        )
        self.world = World(
            state=new_state(config, world_size=WORLD_SIZE),
            pool=FakePool(12),
            shared_first_chunk=True,
        )
        self.settled_batches: set[int] = set()

    # -- requests ---------------------------------------------------------

    @initialize(req_ids=st.lists(st.sampled_from(REQUEST_IDS), min_size=1, unique=True))
    def start(self, req_ids: list[str]) -> None:
        note(f"start {req_ids}")
        for req_id in req_ids:
            self.world.arrive(req_id)

    @rule(req_ids=st.lists(st.sampled_from(REQUEST_IDS), min_size=1, unique=True))
    def arrive(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            if req_id not in self.world.active:
                note(f"arrive {req_id}")
                self.world.arrive(req_id)

    @rule(
        skip=st.lists(st.sampled_from(REQUEST_IDS), max_size=2, unique=True),
        next_step_blocks=st.integers(0, 6),
        steps=st.integers(1, 4),
    )
    def schedule(self, skip: list[str], next_step_blocks: int, steps: int) -> None:
        """Token steps: every active request not skipped computes one chunk."""
        for _ in range(steps):
            advance = [r for r in sorted(self.world.active) if r not in skip][:3]
            note(f"schedule {advance} next={next_step_blocks}")
            self.world.schedule(advance, next_step_blocks=next_step_blocks)
            for req_id in advance:
                request = self.world.active[req_id]
                if request.tokens >= MAX_CHUNKS * 64:
                    note(f"finish {req_id} (max length)")
                    self.world.finish(req_id)

    @rule()
    def idle_step(self) -> None:
        note("empty step")
        self.world.schedule([], next_step_blocks=0)

    @precondition(lambda self: self.idle_flush_steps > 0 and self.world.drain is None)
    @rule()
    def idle_until_quiet(self) -> None:
        """vLLM with nothing to schedule steps only while the connector asks."""
        self._idle_until_quiet()

    def _idle_until_quiet(self) -> None:
        world = self.world
        bound = self.idle_flush_steps + 4 * len(REQUEST_IDS) * MAX_CHUNKS
        steps = 0
        while keeps_stepping(world.state, world.time_s) and world.drain is None:
            assert steps < bound, f"still stepping after {steps} empty steps"
            world.schedule([], next_step_blocks=0)
            world.settle_all()
            steps += 1
        note(f"idle for {steps} steps")
        if world.drain is None:
            assert not world.state.ready, "a finished request's tail stayed buffered"

    @precondition(lambda self: self.world.active)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        active = sorted(self.world.active)
        req_ids = data.draw(st.lists(st.sampled_from(active), min_size=1, unique=True))
        for req_id in req_ids:
            note(f"finish {req_id}")
            self.world.finish(req_id)

    @precondition(lambda self: self.world.active)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.world.active)))
        note(f"preempt {req_id}")
        self.world.preempt(req_id)

    @precondition(lambda self: not self.world.active and not self.world.pins)
    @rule(dice=st.integers(0, 9))
    def reset_cache(self, dice: int) -> None:
        """Rare (vLLM refuses a reset while blocks are in use)."""
        if dice:
            return
        note("reset prefix cache")
        self.world.reset_cache()

    # -- receipts: late, partial, duplicated, out of order, failed -------

    @precondition(lambda self: self.world.in_flight)
    @rule(data=st.data(), count=st.integers(1, WORLD_SIZE), fail=st.booleans())
    def receipt(self, data: st.DataObject, count: int, fail: bool) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.world.in_flight)))
        note(f"receipt {req_id} count={count} fail={fail}")
        before = self._settled()
        self.world.receipts({req_id: count}, [req_id] if fail else [])
        if self._settled() > before:
            self.world.in_flight.pop(req_id, None)

    @rule(req_id=st.sampled_from(REQUEST_IDS), count=st.integers(1, 3))
    def stray_receipt(self, req_id: str, count: int) -> None:
        """A duplicate or unknown receipt: ignored unless it is a real one."""
        if req_id in self.world.in_flight:
            return
        note(f"stray receipt {req_id}")
        self.world.receipts({req_id: count})

    @precondition(lambda self: self.world.in_flight)
    @rule(data=st.data())
    def lose_receipt(self, data: st.DataObject) -> None:
        """A worker's report never arrives: only the lease lets the batch go."""
        req_id = data.draw(st.sampled_from(sorted(self.world.in_flight)))
        note(f"lose receipt {req_id}")
        del self.world.in_flight[req_id]

    @rule(count=st.integers(1, 3), report=st.booleans())
    def intrude(self, count: int, report: bool) -> None:
        """Blocks taken from the free-queue head just before the next drain."""
        note(f"intrude {count} report={report}")
        self.world.intrude(count, report=report)

    @precondition(lambda self: self.world.active)
    @rule(data=st.data(), blocks=st.integers(1, 8))
    def lookup_then_allocate(self, data: st.DataObject, blocks: int) -> None:
        """A waiting request's lookup is answered, and vLLM allocates its hit
        from the free-queue head at once (reported with the next step)."""
        req_id = data.draw(st.sampled_from(sorted(self.world.active)))
        note(f"lookup by {req_id}, then {blocks} blocks allocated")
        self.world.lookup(req_id, blocks)
        self.world.intrude(blocks, report=True)

    @rule(kind=st.sampled_from(COMMANDS), dice=st.integers(0, 3))
    def break_the_executor(self, kind: type, dice: int) -> None:
        """The shell's executor raises on the next command of ``kind`` (rare)."""
        if dice:
            return
        note(f"executor fails on the next {kind.__name__}")
        self.world.fail_commands.add(kind)

    def _settled(self) -> int:
        return sum(
            1 for _, outcome in self.world.applied for d in outcome.decisions
            if isinstance(d, StoreSettled)
        )

    # -- invariants -------------------------------------------------------

    @invariant()
    def core_invariants_hold(self) -> None:
        if self.world.drain is None:  # a failed shell leaves the state mid-callback
            assert check_all(self.world.state) == []

    @invariant()
    def world_saw_no_violation(self) -> None:
        assert self.world.violations == []

    @invariant()
    def pins_match_the_world(self) -> None:
        if self.world.drain is None:
            assert self.world.pins == self.world.state.pins

    def teardown(self) -> None:
        """Deliver everything and drain: no pin may survive, the ledger closes."""
        world = self.world
        world.fail_commands.clear()
        world.settle_all()
        for req_id in sorted(world.active):
            world.finish(req_id)
        world.settle_all()
        world.schedule([], next_step_blocks=0, dt_s=2 * LEASE_S)  # lost receipts: leases end
        if self.idle_flush_steps:  # that empty step may have flushed the tail
            world.settle_all()
            self._idle_until_quiet()
        world.release_intruders()
        if world.drain is None:
            terms = ledger_terms(world.state)
            assert terms["verifying"] == 0 and terms["in_flight"] == 0
        else:
            note(f"drain-only after: {world.failure}")
            assert not world.drain.busy
        world.shutdown()
        assert world.violations == []
        assert world.pins == {}
        assert all(ref == 0 for ref in world.pool.ref_cnt)
        assert world.finished == {}, "a finished request's session never ended"
        if world.drain is None:
            assert world.state.pins == {}
            terms = ledger_terms(world.state)
            assert terms["pending"] == 0
            assert check_all(world.state) == []


class EvictionAwareMachine(OffloadMachine):
    policy = Policy.EVICTION_AWARE


class FifoMachine(OffloadMachine):
    policy = Policy.FIFO


class EvictionAwareIdleFlushMachine(OffloadMachine):
    policy = Policy.EVICTION_AWARE
    idle_flush_steps = 2


class FifoIdleFlushMachine(OffloadMachine):
    policy = Policy.FIFO
    idle_flush_steps = 2


TestEvictionAware = EvictionAwareMachine.TestCase
TestFifo = FifoMachine.TestCase
TestEvictionAwareIdleFlush = EvictionAwareIdleFlushMachine.TestCase
TestFifoIdleFlush = FifoIdleFlushMachine.TestCase
