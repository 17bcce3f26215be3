"""One poison path: any exception inside a step poisons the machine with a
description of it, and ``drive`` keeps what it applied before the failure."""

from __future__ import annotations

import pytest

from offload_fsm import MachinePoisoned, drive, step
from offload_fsm.vocabulary.commands import Command, ReadHashes
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.errors import CommandFailed, CoreFault, InvalidEvent, StepFailed
from offload_fsm.vocabulary.events import Event, HashesRead, RequestArrived, StepScheduled

from .helpers import Harness, fifo


def _empty_step(time_s: float) -> StepScheduled:
    return StepScheduled(scheduled_tokens=0, allocated_blocks=0, next_step_blocks=0,
                         reserve_blocks=0, free_blocks=0, window_block_ids=(),
                         reallocated=(), time_s=time_s)


def _token_step(time_s: float) -> StepScheduled:
    return StepScheduled(scheduled_tokens=16, allocated_blocks=0, next_step_blocks=0,
                         reserve_blocks=0, free_blocks=0, window_block_ids=(),
                         reallocated=(), time_s=time_s)


def test_a_bug_inside_a_step_poisons_with_its_description() -> None:
    h = Harness(fifo(), check=False)
    del h.state.counters[Counter.EMPTY_STEPS]  # a core bug: a missing counter
    with pytest.raises(CoreFault) as raised:
        step(h.state, _empty_step(1.0))
    error = raised.value
    assert isinstance(error, StepFailed)
    assert isinstance(error.__cause__, KeyError)
    assert isinstance(error.event, StepScheduled)
    assert "KeyError" in error.reason and "StepScheduled" in error.reason
    assert "drain.py:" in error.reason  # where it was raised
    assert h.state.closed == error.reason
    with pytest.raises(MachinePoisoned, match="RequestArrived after the machine closed"):
        step(h.state, RequestArrived(req_id="x"))


def test_an_assertion_inside_a_step_poisons() -> None:
    h = Harness(fifo(threshold=1), check=False)
    h.arrive("a")
    h.offer("a")
    h.finish("a")
    h.state.requests["a"].ops.clear()  # corrupt the buffer behind the indexes' back
    with pytest.raises(CoreFault, match="AssertionError"):
        step(h.state, _token_step(1.0))
    assert h.state.closed is not None


def _fifo_ready() -> Harness:
    h = Harness(fifo(threshold=1), check=False)
    h.arrive("a")
    h.offer("a")
    h.finish("a")
    return h


def test_drive_attaches_the_events_it_applied_before_a_rejected_answer() -> None:
    h = _fifo_ready()

    def bad_answers(command: Command) -> Event | None:
        if isinstance(command, ReadHashes):
            return HashesRead(batch_id=command.batch_id, block_hashes=(1,))  # one short
        return None

    with pytest.raises(InvalidEvent) as raised:
        drive(h.state, _token_step(1.0), bad_answers)
    error = raised.value
    assert [type(e) for e, _ in error.applied] == [StepScheduled]
    assert isinstance(error.event, HashesRead)
    assert "hashes read, expected" in error.reason
    assert h.state.closed is not None


def test_drive_poisons_and_attaches_when_the_executor_raises() -> None:
    h = _fifo_ready()

    def broken(command: Command) -> Event | None:
        raise RuntimeError("block pool gone")

    with pytest.raises(CommandFailed) as raised:
        drive(h.state, _token_step(1.0), broken)
    error = raised.value
    assert [type(e) for e, _ in error.applied] == [StepScheduled]
    assert "block pool gone" in error.reason and "ProtectBlocks" in error.reason
    assert h.state.closed == error.reason
    with pytest.raises(MachinePoisoned):
        step(h.state, RequestArrived(req_id="b"))
