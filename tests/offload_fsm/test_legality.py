"""Generated from ``legality``'s tables: every (phase, event) pair is tried.
Legal pairs apply; illegal ones poison the machine with a message naming the
event and the phase; a closed machine refuses everything, naming both."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from offload_fsm import InvalidEvent, MachinePoisoned, step
from offload_fsm.invariants import check_all
from offload_fsm.rules.legality import (
    MACHINE_LEGAL,
    OP_MOVES,
    REQUEST_LEGAL,
    MachinePhase,
    RequestPhase,
    machine_phase,
    move,
    request_phase,
)
from offload_fsm.state import OpStatus
from offload_fsm.vocabulary import events
from offload_fsm.vocabulary.commands import ReadFreeQueue, ReadHashes
from offload_fsm.vocabulary.events import Event

from .helpers import Harness, ea

FILLER = tuple(range(10_000, 10_100))


class Setup:
    """A machine in a given phase, and a representative event of each type
    whose values are valid there."""

    def __init__(self, phase: MachinePhase) -> None:
        h = Harness(ea(horizon_steps=2.0), check=False)
        h.queue = list(FILLER)
        self.h = h
        self.answers: dict[type, Event] = {}
        h.arrive("live")
        h.offer("live")
        if phase is MachinePhase.AWAITING_ANSWERS:
            self._await_answers()
        elif phase is MachinePhase.CLOSED:
            h.shutdown()
        assert machine_phase(h.state) is phase

    def _await_answers(self) -> None:
        """The pin-cascade scenario, stepped without answering: hashes for a's
        batch and a free-queue read are outstanding."""
        h = self.h
        for req_id, rank in (("a", 0), ("b", 4)):
            h.arrive(req_id)
            h.offer(req_id)
            h.finish(req_id, free=len(h.visible()))
            for offset, block in enumerate(h.blocks_of[req_id][0]):
                h.queue.insert(rank + offset, block)
        h.time_s += 1
        event = events.StepScheduled(scheduled_tokens=16, allocated_blocks=2, next_step_blocks=0,
                              reserve_blocks=1, free_blocks=len(h.visible()),
                              window_block_ids=tuple(h.visible()[:4]), reallocated=(),
                              time_s=h.time_s)
        outcome = step(h.state, event)
        for command in outcome.commands:
            answer = h.execute(command)  # pins land; answers are kept, not fed
            if isinstance(command, ReadHashes | ReadFreeQueue):
                assert answer is not None
                self.answers[type(answer)] = answer

    def event(self, kind: type) -> Event:
        h = self.h
        made: dict[type, Callable[[], Event]] = {
            events.RequestArrived: lambda: events.RequestArrived(req_id="new"),
            events.CandidateOffered: lambda: events.CandidateOffered(
                req_id="live", start_token=64, end_token=128, block_ids=h.new_blocks(),
                block_hashes=(1, 2), time_s=h.time_s),
            events.StepScheduled: lambda: events.StepScheduled(
                scheduled_tokens=0, allocated_blocks=0, next_step_blocks=0, reserve_blocks=0,
                free_blocks=len(h.visible()), window_block_ids=(), reallocated=(),
                time_s=h.time_s + 1),
            events.RequestFinished: lambda: events.RequestFinished(req_id="live", free_blocks=10),
            events.RequestPreempted: lambda: events.RequestPreempted(req_id="live"),
            events.ReceiptsArrived: lambda: events.ReceiptsArrived(completed=(), failed=()),
            events.PrefixCacheReset: events.PrefixCacheReset,
            events.ShutdownRequested: events.ShutdownRequested,
            events.ChunksMissing: lambda: events.ChunksMissing(chunk_keys=(1,)),
            events.ShutdownBegan: lambda: events.ShutdownBegan(time_s=h.time_s),
            # No step yet: the EMA seeds at 0 allocated blocks, so the window is empty.
            events.StepsPassed: lambda: events.StepsPassed(
                steps=((16, 0, 0, 0, len(h.visible()), 0, h.time_s + 1),)),
            events.HashesRead: lambda: self.answers.get(
                events.HashesRead, events.HashesRead(batch_id=0, block_hashes=(1, 2))),
            events.FreeQueueRead: lambda: self.answers.get(
                events.FreeQueueRead, events.FreeQueueRead(window_block_ids=(1,))),
            events.LookupAnswered: lambda: events.LookupAnswered(
                req_id="live", allocation_blocks=2, free_blocks=len(h.visible()),
                window_block_ids=tuple(h.visible()[:2])),
        }
        return made[kind]()


MACHINE_PAIRS = [(phase, kind) for phase in MachinePhase for kind in events.EVENT_TYPES]


def test_every_machine_phase_has_a_row() -> None:
    assert set(MACHINE_LEGAL) == set(MachinePhase)
    legal = MACHINE_LEGAL[MachinePhase.OPEN] | MACHINE_LEGAL[MachinePhase.AWAITING_ANSWERS]
    assert legal == set(events.EVENT_TYPES)


@pytest.mark.parametrize(("phase", "kind"), MACHINE_PAIRS,
                         ids=[f"{p.value}-{k.__name__}" for p, k in MACHINE_PAIRS])
def test_machine_phase_table(phase: MachinePhase, kind: type) -> None:
    setup = Setup(phase)
    state = setup.h.state
    event = setup.event(kind)
    if phase is MachinePhase.CLOSED:
        with pytest.raises(MachinePoisoned) as closed:
            step(state, event)
        assert kind.__name__ in str(closed.value) and "closed" in str(closed.value)
        return
    if kind in MACHINE_LEGAL[phase]:
        step(state, event)
        closes = kind is events.ShutdownRequested
        assert (state.closed is not None) == closes
        assert machine_phase(state) is not MachinePhase.CLOSED or closes
        return
    with pytest.raises(InvalidEvent) as raised:
        step(state, event)
    for name in (kind.__name__, phase.value):
        assert name in str(raised.value)
        assert name in (state.closed or "")


REQUEST_PAIRS = sorted(REQUEST_LEGAL.items(), key=lambda kv: (kv[0][0].__name__, kv[0][1].value))


def _request_in(phase: RequestPhase) -> Harness:
    h = Harness(ea(), check=False)
    h.queue = list(FILLER)
    if phase is not RequestPhase.UNKNOWN:
        h.arrive("r")
        h.offer("r")
        h.offer("r")  # two ops: finishing with a buffer keeps the request known
    if phase is RequestPhase.FINISHED:
        h.finish("r", free=len(h.visible()))
    assert request_phase(h.state, "r") is phase
    return h


def _request_event(kind: type, h: Harness) -> Event:
    if kind is events.CandidateOffered:
        start = 128 if "r" in h.state.requests else 0
        return events.CandidateOffered(req_id="r", start_token=start, end_token=start + 64,
                                block_ids=h.new_blocks(), block_hashes=(7, 8), time_s=0.0)
    if kind is events.RequestFinished:
        return events.RequestFinished(req_id="r", free_blocks=10)
    if kind is events.LookupAnswered:
        return events.LookupAnswered(req_id="r", allocation_blocks=1,
                                     free_blocks=len(h.visible()),
                                     window_block_ids=tuple(h.visible()[:1]))
    result: Event = kind(req_id="r")
    return result


@pytest.mark.parametrize(("pair", "reason"), REQUEST_PAIRS,
                         ids=[f"{k.__name__}-{p.value}" for (k, p), _ in REQUEST_PAIRS])
def test_request_phase_table(pair: tuple[type, RequestPhase], reason: str | None) -> None:
    kind, phase = pair
    h = _request_in(phase)
    event = _request_event(kind, h)
    if reason is None:
        step(h.state, event)
        assert h.state.closed is None
        assert check_all(h.state) == []
        return
    with pytest.raises(InvalidEvent) as raised:
        step(h.state, event)
    for name in (kind.__name__, phase.value, reason):
        assert name in str(raised.value)


def test_every_request_scoped_pair_is_in_the_table() -> None:
    scoped = {events.RequestArrived, events.CandidateOffered, events.RequestFinished,
              events.RequestPreempted, events.LookupAnswered}
    assert set(REQUEST_LEGAL) == {(k, p) for k in scoped for p in RequestPhase}


def test_op_moves_outside_the_table_are_core_bugs() -> None:
    h = _request_in(RequestPhase.ACTIVE)
    op = h.state.requests["r"].ops[0]
    for status in OpStatus:
        allowed = OP_MOVES.get(op.status, frozenset())
        if status not in allowed:
            with pytest.raises(AssertionError, match="cannot move from buffered"):
                move(h.state, [op], status)
    assert op.status is OpStatus.BUFFERED
    # Terminal statuses move nowhere.
    assert all(s not in OP_MOVES for s in (OpStatus.STORED, OpStatus.DROPPED,
                                            OpStatus.FAILED, OpStatus.ABANDONED))
