"""The engine's side of the event log (``connector.handoff``) against a fake
link: the byte budget, outages and their one warning, a dead recorder
restarted with backoff, the resume with a snapshot, and a seal that never
waits. The real recorder process is in ``test_recorder_process.py``."""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from typing import Any

import attrs
import pytest

from connector.handoff.link import io_loop
from connector.handoff.messages import PROTOCOL, Message, Reply, state_summary
from connector.handoff.sender import Handoff
from offload_fsm import drive, new_state
from offload_fsm.log import snapshot
from offload_fsm.log.wire import from_wire, packb, unpackb
from offload_fsm.testing.synthetic import default_config, run_workload
from offload_fsm.vocabulary.events import StepScheduled


class FakeLink:
    """A recorder that takes what it is sent, acknowledges when told, and
    exits when told."""

    def __init__(self, *, accept: bool = True) -> None:
        self.messages: list[Any] = []
        self.bytes = 0
        self.accept = accept
        self.code: int | None = None
        self.pending: list[tuple[Any, ...]] = []
        self.closed = False

    def send(self, message: bytes) -> bool:
        if not self.accept:
            return False
        self.messages.append(unpackb(message))
        self.bytes += len(message)
        return True

    def ack(self) -> None:
        self.pending.append((Reply.ACK, self.bytes, None))

    def flush(self) -> bool:
        return self.accept

    def replies(self) -> list[tuple[Any, ...]]:
        out, self.pending = self.pending, []
        return out

    def exit_code(self) -> int | None:
        return self.code

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _handoff(links: list[FakeLink], warnings: list[str], clock: Clock, budget: int,
             *, failures: int = 0, end_wait_s: float = 0.05) -> Handoff:
    pending = list(links)
    failing = [failures]

    def launch() -> FakeLink:
        if failing[0]:
            failing[0] -= 1
            raise OSError("no python")
        return pending.pop(0)

    return Handoff(launch, budget_bytes=budget, warn=warnings.append, clock=clock,
                   wall_clock=lambda: 0.0, liveness_every_s=0.0, backoff_s=(1.0, 8.0),
                   flush_every_s=0.0, end_wait_s=end_wait_s, register_atexit=False,
                   io_thread=False)


def _events(messages: list[Any]) -> int:
    count = 0
    for message in messages:
        if message[0] == Message.STEP:
            count += sum(len(callback) // 2 for callback in message[4])
    return count


def test_every_event_is_handed_over_in_order_with_its_check() -> None:
    link = FakeLink()
    warnings: list[str] = []
    handoff = _handoff([link], warnings, Clock(), budget=1 << 30)
    world = run_workload(requests=40, seed=1, sink=handoff.record)
    handoff.close(world.state)
    assert link.messages[0] == (Message.START, 0, 0.0, 0, None, PROTOCOL)
    steps = [m for m in link.messages if m[0] == Message.STEP]
    seq = 0
    for message in steps:
        assert message[1] == seq
        for callback in message[4]:
            for wire in callback[::2]:
                assert from_wire(wire) == world.applied[seq][0]
                seq += 1
    assert seq == len(world.applied)
    assert link.messages[-1][:2] == (Message.END, seq)
    assert link.messages[-1][3] == state_summary(world.state)
    assert warnings == [] and handoff.events_lost == 0


def test_the_bytes_in_flight_never_pass_the_budget_and_an_outage_warns_once() -> None:
    link = FakeLink()  # never acknowledges: a stalled recorder
    warnings: list[str] = []
    handoff = _handoff([link], warnings, Clock(), budget=4096)
    world = run_workload(requests=40, seed=1, sink=handoff.record)
    assert handoff.stats.bytes_in_flight_max <= 4096
    assert link.bytes <= 4096
    assert "budget (4096 bytes) is full" in warnings[0]
    # The only other: no snapshot fits 4096 bytes (said once, with the key).
    assert len(warnings) == 2 and "lazy_offload_log_budget_mib to at least 4" in warnings[1]
    assert handoff.events_lost == len(world.applied) - _events(link.messages)
    assert not handoff.recorder_up


def test_acknowledged_room_ends_the_outage_with_the_lost_count_and_a_snapshot() -> None:
    link = FakeLink()
    warnings: list[str] = []
    handoff = _handoff([link], warnings, Clock(), budget=16384)
    caught_up = [False]

    def sink(applied: Any, state: Any) -> None:
        handoff.record(applied, state)
        if handoff.events_lost and not caught_up[0]:
            caught_up[0] = True
            link.ack()  # the recorder catches up, once

    world = run_workload(requests=100, seed=1, sink=sink)
    starts = [m for m in link.messages if m[0] == Message.START]
    assert len(starts) == 2
    _, seq, _, lost, packed, _ = starts[1]
    assert lost > 0 and packed is not None
    restored = snapshot.restore(unpackb(packed), default_config())
    assert restored.step_index <= world.state.step_index
    steps_after = [m for m in link.messages[link.messages.index(starts[1]):]
                   if m[0] == Message.STEP]
    assert steps_after[0][1] == seq  # the events after the snapshot follow it
    assert handoff.stats.events_lost == lost
    assert len(warnings) == 2  # this outage, and the next (the recorder never acks again)


def test_a_dead_recorder_is_restarted_with_backoff_and_resumes_from_a_snapshot() -> None:
    first, second = FakeLink(), FakeLink()
    warnings: list[str] = []
    clock = Clock()
    handoff = _handoff([first, second], warnings, clock, budget=1 << 30)
    calls = [0]

    def sink(applied: Any, state: Any) -> None:
        calls[0] += 1
        if calls[0] == 100:
            first.code = -9  # killed
        if calls[0] == 200:
            clock.now += 1.5  # past the first backoff
        first.ack()
        second.ack()
        handoff.record(applied, state)

    world = run_workload(requests=40, seed=1, sink=sink)
    handoff.close(world.state)
    assert first.closed
    assert handoff.stats.recorder_restarts == 1
    assert len(warnings) == 1 and "exited (code -9)" in warnings[0]
    start = second.messages[0]
    assert start[0] == Message.START and start[3] > 0 and start[4] is not None
    assert handoff.stats.events_lost == start[3]
    assert second.messages[-1][0] == Message.END and second.messages[-1][4] is None


def test_a_recorder_that_cannot_start_is_tried_again_later() -> None:
    link = FakeLink()
    warnings: list[str] = []
    clock = Clock()
    handoff = _handoff([link], warnings, clock, budget=1 << 30, failures=2)
    world = run_workload(requests=10, seed=1, sink=handoff.record)
    assert not handoff.recorder_up and "could not start" in warnings[0]
    clock.now += 1.0
    handoff.close(world.state)  # too early for the second try (backoff 2 s)
    assert link.messages == []
    assert handoff.events_lost == len(world.applied)


def test_the_seal_returns_at_once_and_says_where_an_open_outage_began() -> None:
    link = FakeLink()  # never acknowledges; the snapshot would not fit the budget
    handoff = _handoff([link], [], Clock(), budget=600)
    world = run_workload(requests=10, seed=1, sink=handoff.record)
    lost_from = handoff.events_lost and len(world.applied) - handoff.events_lost
    handoff.close(world.state)
    end = link.messages[-1]
    assert end[0] == Message.END and end[1] == len(world.applied) and end[3] is None
    assert end[4] == lost_from  # the GAP the recorder writes starts there
    assert handoff.stats.events_lost == len(world.applied) - lost_from
    assert handoff.wait_for_end() is False  # nobody acknowledges here: it gives up


class ExitBeforeAck(FakeLink):
    """A recorder whose clean exit is heard before its last acknowledgement
    (the exit code comes by a pipe, the ACK through ZeroMQ's I/O thread)."""

    def __init__(self, *, code: int) -> None:
        super().__init__()
        self.exit_with = code
        self.delay = 3  # reply reads before the ACK shows

    def replies(self) -> list[tuple[Any, ...]]:
        if self.messages and self.messages[-1][0] == Message.END:
            self.code = self.exit_with
            self.delay -= 1
            if self.delay == 0 and self.code == 0:
                self.ack()
        return super().replies()


@pytest.mark.parametrize(("code", "ended"), [(0, True), (1, False)])
def test_a_clean_exit_heard_before_the_last_ack_still_waits_for_it(
        code: int, ended: bool) -> None:
    link = ExitBeforeAck(code=code)
    handoff = _handoff([link], [], Clock(), budget=1 << 30, end_wait_s=30.0)
    world = run_workload(requests=3, seed=3, sink=handoff.record)
    handoff.close(world.state)
    started = time.monotonic()
    assert handoff.wait_for_end() is ended
    assert time.monotonic() - started < 5.0  # neither waits out end_wait_s


def test_resync_asks_for_a_snapshot_without_a_loss() -> None:
    link = FakeLink()
    handoff = _handoff([link], [], Clock(), budget=1 << 30)
    calls = [0]

    def sink(applied: Any, state: Any) -> None:
        calls[0] += 1
        if calls[0] == 100:
            link.pending.append((Reply.RESYNC,))
        link.ack()
        handoff.record(applied, state)

    run_workload(requests=20, seed=1, sink=sink)
    starts = [m for m in link.messages if m[0] == Message.START]
    assert len(starts) == 2 and starts[1][3] == 0 and starts[1][4] is not None
    assert handoff.events_lost == 0


@pytest.mark.parametrize("budget", [0, -1])
def test_a_budget_below_one_byte_is_refused(budget: int) -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        _handoff([FakeLink()], [], Clock(), budget=budget)


def test_a_packed_step_is_the_message_it_says() -> None:
    """The STEP message is spliced from packed callbacks: it decodes as the
    array (STEP, seq, wall_s, summary, callbacks)."""
    link = FakeLink()
    handoff = _handoff([link], [], Clock(), budget=1 << 30)
    world = run_workload(requests=3, seed=2, sink=handoff.record)
    step = next(m for m in link.messages if m[0] == Message.STEP)
    assert len(step) == 5 and isinstance(step[4], tuple)
    assert packb(step) and world.applied


class PipedLink(FakeLink):
    """A link whose recorder is a :class:`connector.recorder.Recorder` in this
    process, fed each message as it is sent: the protocol end to end, with
    no process in between."""

    def __init__(self, recorder_of: Any) -> None:
        super().__init__()
        self.recorder = recorder_of(lambda reply: self.pending.append(reply))

    def send(self, message: bytes) -> bool:
        super().send(message)
        self.recorder.handle(message)
        self.ack()
        return True

    def ack(self) -> None:
        self.pending.append((Reply.ACK, self.bytes, None))


def _piped(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> tuple[Handoff, PipedLink]:
    from connector.recorder.process import Recorder
    from offload_fsm import Settings

    spec = {"directory": str(tmp_path), "prefix": "run", "world_size": 2,
            "header_config": Settings(offload=default_config()).to_wire(),
            "versions": {"package": "test", "vllm": "", "lmcache": ""},
            "max_file_bytes": 1 << 20, "max_total_bytes": None, "budget_bytes": 1 << 26,
            "digest_every": 50}
    link = PipedLink(lambda reply: Recorder(spec, lambda message: reply(unpackb(message))))
    handoff = Handoff(lambda: link, budget_bytes=1 << 26, digest_every=50, flush_every_s=0.0,
                      warn=lambda message: None, register_atexit=False, io_thread=False)
    return handoff, link


def test_the_recorder_logs_what_the_engine_hands_over_and_it_verifies(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    from replay.runner import replay

    handoff, link = _piped(tmp_path, caplog)
    world = run_workload(requests=60, seed=3, sink=handoff.record)
    handoff.close(world.state)
    assert link.recorder.done
    result = replay(tmp_path)
    assert result.ok and result.ended_cleanly, (result.divergence, result.lost)
    assert result.events_applied == len(world.applied)
    assert result.digests_checked >= 2


def test_the_recorder_lays_out_the_engines_batches_as_an_in_process_recorder_does(
        tmp_path: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """One cursor (``offload_fsm.log.cursor``): the recorder process writes
    each batch the engine sent as one INPUTS record, its digests where the
    engine's cursor put them, so its log holds the same records at the same
    ``seq`` as an in-process recorder fed the same events (what ``replay
    diff`` compares); and it never rebuilds an event through
    ``log.wire.from_wire``."""
    import offload_fsm.log.wire as wire
    from connector.recorder.recording import EventRecorder
    from logfiles.scan import Entry, read_log
    from offload_fsm.log.records import Digest, Inputs

    def layout(directory: Any) -> list[tuple[str, int, int]]:
        return [(type(e.record).__name__, e.record.seq,
                 len(e.record.events) if isinstance(e.record, Inputs) else 0)
                for e in read_log(directory) if isinstance(e, Entry)
                and isinstance(e.record, (Inputs, Digest))]

    monkeypatch.setattr(wire, "_TYPES", {})  # wire.from_wire would raise UnknownTag
    handoff, link = _piped(tmp_path / "process", caplog)
    world = run_workload(requests=60, seed=3, sink=handoff.record)
    handoff.close(world.state)
    monkeypatch.undo()
    local = EventRecorder(default_config(), 2, str(tmp_path / "local"),
                          {"package": "test", "vllm": "", "lmcache": ""}, prefix="run",
                          digest_every=50, register_atexit=False)
    again = run_workload(requests=60, seed=3, sink=local.record)
    local.close(again.state)
    assert again.applied == world.applied
    recorded = layout(tmp_path / "process")
    assert recorded == layout(tmp_path / "local")
    assert any(kind == "Digest" for kind, _, _ in recorded)
    assert not any("UnknownTag" in r.getMessage() for r in caplog.records)


def test_a_live_state_changed_outside_step_shows_in_the_log(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The engine's summary at a digest point differs from the recorder's
    fold: one warning, RESYNC, a snapshot of the live state, and replay
    reports the digest of that snapshot as not what the events give."""
    from offload_fsm.vocabulary.counters import Counter
    from replay.runner import replay

    handoff, link = _piped(tmp_path, caplog)
    calls = [0]

    def sink(applied: Any, state: Any) -> None:
        calls[0] += 1
        if calls[0] == 5:
            state.counters[Counter.RELEASED_BLOCKS] += 1  # outside step
        handoff.record(applied, state)

    with caplog.at_level("WARNING", logger="connector.recorder"):
        world = run_workload(requests=60, seed=3, sink=sink)
        handoff.close(world.state)
    assert any("differs from the engine's" in r.getMessage() for r in caplog.records)
    assert len([m for m in link.messages if m[0] == Message.START]) == 2
    result = replay(tmp_path)
    assert result.divergence is not None and result.divergence.kind == "digest"
    assert "differs from the snapshot's" in result.divergence.detail


def test_steps_are_handed_to_zeromq_together_at_the_flush_pace() -> None:
    """Within ``flush_every_s`` the link holds the steps; one flush hands
    them over (one ZeroMQ call instead of one a step)."""
    flushes = [0]

    class Counting(FakeLink):
        def flush(self) -> bool:
            flushes[0] += 1
            return True

    link = Counting()
    clock = Clock()
    handoff = Handoff(lambda: link, budget_bytes=1 << 30, warn=lambda m: None, clock=clock,
                      flush_every_s=0.01, register_atexit=False, io_thread=False)
    world = run_workload(requests=20, seed=1, sink=handoff.record)
    steps = len([m for m in link.messages if m[0] == Message.STEP])
    assert steps >= 10 and flushes[0] <= 2  # the clock never moved: the start and one more
    handoff.close(world.state)
    assert flushes[0] <= 3 and link.messages[-1][0] == Message.END


def test_the_recorder_is_up_once_it_acknowledged_its_start() -> None:
    """``recorder_up`` (the ``log_recorder_up`` gauge) says a recorder took
    its START in: a recorder process still starting, whose START waits in
    the socket, writes no log yet (an engine killed now leaves none)."""
    link = FakeLink()
    handoff = Handoff(lambda: link, budget_bytes=1 << 30, warn=lambda m: None,
                      register_atexit=False, io_thread=False)
    assert link.messages[0][0] == Message.START and not handoff.recorder_up
    handoff.io_turn()  # the I/O thread's turn: no reply yet
    assert not handoff.recorder_up
    link.ack()
    handoff.io_turn()
    assert handoff.recorder_up
    handoff.close(None)


def test_with_its_io_thread_the_scheduler_thread_makes_no_zeromq_call() -> None:
    """The I/O thread on: steps past ``flush_every_s`` only append to the
    open frame on the scheduler thread (no flush, no reply read); the
    thread's turn hands the frame over and reads the replies."""
    calls = {"flush": 0, "replies": 0}

    class Counting(FakeLink):
        def flush(self) -> bool:
            calls["flush"] += 1
            return super().flush()

        def replies(self) -> list[Any]:
            calls["replies"] += 1
            return super().replies()

    link = Counting()
    clock = Clock()
    # The thread's first turn is an hour away: this test takes its turns.
    handoff = Handoff(lambda: link, budget_bytes=1 << 30, warn=lambda m: None, clock=clock,
                      flush_every_s=3600.0, register_atexit=False)
    handoff._flush_every_s = 0.01
    started = dict(calls)  # the START's flush

    def paced(applied: Any, state: Any) -> None:
        clock.now += 0.02  # every step is due
        handoff.record(applied, state)

    world = run_workload(requests=20, seed=2, sink=paced)
    assert calls == started and handoff._flight.open_first is not None
    handoff.io_turn()
    assert calls["flush"] == started["flush"] + 1 and calls["replies"] > started["replies"]
    assert handoff._flight.open_first is None
    handoff.close(world.state)
    assert link.messages[-1][0] == Message.END


# --------------------------------------------------------------------------
# Backoff that holds (issue 38): counted over simulated minutes, not timed.


class DyingLink(FakeLink):
    """A recorder that dies on every START: after a FAILED reply when
    ``failure`` is given (it could not open its log), else without a word."""

    def __init__(self, failure: tuple[str, str] | None) -> None:
        super().__init__()
        self.failure = failure

    def send(self, message: bytes) -> bool:
        super().send(message)
        if self.messages[-1][0] == Message.START:
            if self.failure is not None:
                self.pending.append((Reply.FAILED, *self.failure))
            self.code = 3 if self.failure is not None else 1
        return True


def _simulated(handoff: Handoff, clock: Clock, minutes: float, tick_s: float = 0.1,
               state: Any = None, each: Any = None) -> None:
    """Idle scheduler steps, one per ``tick_s`` of the fake clock."""
    if state is None:
        state = new_state(default_config(), world_size=2)
    step = StepScheduled(scheduled_tokens=0, allocated_blocks=0, next_step_blocks=0,
                         reserve_blocks=0, free_blocks=100, window_block_ids=(),
                         reallocated=(), time_s=0.0)
    for _ in range(round(minutes * 60 / tick_s)):
        clock.now += tick_s
        if each is not None:
            each()
        event = attrs.evolve(step, time_s=state.time_s + tick_s)
        handoff.record(drive(state, event, lambda c: None), state)


@pytest.mark.parametrize("failure", [None, ("EROFS", "the log directory /x cannot be "
                                             "written (Read-only file system); remount it")])
def test_a_recorder_that_dies_on_every_start_is_not_a_storm(
        failure: tuple[str, str] | None) -> None:
    """The backoff returns to its minimum only when a START is acknowledged:
    over five simulated minutes a recorder that dies on each START is
    started about log2(60) + 5 times (not every 1.5 s), with one warning."""
    clock = Clock()
    links: list[DyingLink] = []
    warnings: list[str] = []

    def launch() -> DyingLink:
        links.append(DyingLink(failure))
        return links[-1]

    handoff = Handoff(launch, budget_bytes=1 << 30, warn=warnings.append, clock=clock,
                      wall_clock=lambda: 0.0, liveness_every_s=0.0, backoff_s=(1.0, 60.0),
                      flush_every_s=0.0, register_atexit=False, io_thread=False)
    _simulated(handoff, clock, minutes=5)
    # Deaths at about 0, 1, 3, 7, 15, 31, 63, 123, 183, 243 s: ten starts.
    assert len(links) <= 11, len(links)
    assert len(warnings) == 1, warnings
    if failure is not None:
        assert "cannot record: the log directory /x cannot be written" in warnings[0]
        assert "remount it" in warnings[0]
    else:
        assert "exited (code 1)" in warnings[0]


def test_a_persistent_resync_is_answered_with_backoff() -> None:
    """A recorder whose fold disagrees after every snapshot: each START (a
    snapshot on the scheduler thread, a new file) doubles the wait for the
    next, up to a minute; not one every half second."""
    clock = Clock()

    class Mismatched(FakeLink):
        def send(self, message: bytes) -> bool:
            super().send(message)
            self.ack()
            if self.messages[-1][0] == Message.START and self.messages[-1][4] is not None:
                self.pending.append((Reply.RESYNC,))
            return True

    link = Mismatched()
    link.pending.append((Reply.RESYNC,))
    handoff = Handoff(lambda: link, budget_bytes=1 << 30, warn=lambda m: None, clock=clock,
                      wall_clock=lambda: 0.0, liveness_every_s=0.5, backoff_s=(1.0, 60.0),
                      flush_every_s=0.0, register_atexit=False, io_thread=False)
    _simulated(handoff, clock, minutes=5)
    starts = [m for m in link.messages if m[0] == Message.START and m[4] is not None]
    assert 5 <= len(starts) <= 11, len(starts)
    assert handoff.events_lost == 0


def test_a_snapshot_larger_than_the_budget_warns_once_with_the_key_and_backs_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The outage cannot end while the snapshot does not fit: one warning
    naming the setting and the bytes needed, and the state is packed again
    only with the doubling backoff, not at every liveness check."""
    import connector.handoff.sender as module

    packs = [0]
    take = module.snapshot.take

    def counted(state: Any) -> Any:
        packs[0] += 1
        return take(state)

    monkeypatch.setattr(module.snapshot, "take", counted)
    clock = Clock()
    first, second = FakeLink(), FakeLink()
    warnings: list[str] = []
    busy: list[Any] = []  # a state mid-run, whose snapshot is a few KiB

    def keep(applied: Any, state: Any) -> None:
        if len(state.stored_keys) > 20 and state.requests and not busy:
            busy.append(snapshot.restore(unpackb(packb(snapshot.take(state))),
                                           default_config()))

    run_workload(requests=60, seed=1, sink=keep)
    assert len(packb(snapshot.take(busy[0]))) > 2048
    links = [first, second]
    handoff = Handoff(lambda: links.pop(0), budget_bytes=2048, warn=warnings.append,
                      clock=clock, wall_clock=lambda: 0.0, liveness_every_s=0.0,
                      backoff_s=(1.0, 60.0), flush_every_s=0.0, register_atexit=False,
                      io_thread=False)
    first.code = -9
    packs[0] = 0
    _simulated(handoff, clock, minutes=5, state=busy[0], each=second.ack)
    snapshot_warnings = [w for w in warnings if "snapshot needs" in w]
    assert len(snapshot_warnings) == 1
    assert "lmcache.mp.lazy_offload_log_budget_mib to at least 4" in snapshot_warnings[0]
    # Tried at about 1, 3, 7, 15, 31, 63, 123, 183, 243 s.
    assert packs[0] <= 10, packs[0]
    assert not handoff.recorder_up


def test_a_frame_left_open_by_an_engine_gone_idle_is_handed_over() -> None:
    """The last steps before the engine goes quiet reach ZeroMQ within about
    ``flush_every_s``, without another call from the engine."""
    flushed = threading.Event()

    class Watched(FakeLink):
        def __init__(self) -> None:
            super().__init__()
            self.flushes = 0

        def flush(self) -> bool:
            self.flushes += 1
            if self.flushes > 2:
                flushed.set()
            return True

    link = Watched()
    handoff = Handoff(lambda: link, budget_bytes=1 << 30, warn=lambda m: None,
                      flush_every_s=3600.0, register_atexit=False, io_thread=False)
    assert link.flushes == 1  # the START
    state = new_state(default_config(), world_size=2)
    step = StepScheduled(scheduled_tokens=0, allocated_blocks=0, next_step_blocks=0,
                         reserve_blocks=0, free_blocks=100, window_block_ids=(),
                         reallocated=(), time_s=0.0)
    handoff.record(drive(state, step, lambda c: None), state)  # due: handed over
    step = attrs.evolve(step, time_s=1.0)
    handoff.record(drive(state, step, lambda c: None), state)  # within the hour: held
    assert link.flushes == 2 and handoff._flight.open_first is not None
    handoff._flush_every_s = 0.01  # the engine is idle from here on
    threading.Thread(target=io_loop, args=(weakref.ref(handoff), 0.01),
                     daemon=True).start()
    assert flushed.wait(10.0), "the idle engine's last step was never handed over"
    assert handoff._flight.frames and handoff._flight.open_first is None


def _unpacked_into(replies: list[Any], message: bytes) -> None:
    replies.append(unpackb(message))


def test_a_recorder_refuses_an_engine_of_another_protocol_once(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An upgrade installed under a running engine: the new recorder gets a
    START of another protocol version and refuses it (FAILED, which the
    engine warns about once). An engine from before the handshake does not
    read FAILED: the recorder says it on stderr itself, once per engine."""
    from connector.recorder.process import Recorder
    from offload_fsm import Settings

    spec = {"directory": str(tmp_path / "logs"), "prefix": "run", "world_size": 2,
            "header_config": Settings(offload=default_config()).to_wire(),
            "versions": {"package": "test", "vllm": "", "lmcache": ""},
            "max_file_bytes": 1 << 20, "max_total_bytes": None, "budget_bytes": 1 << 26,
            "endpoint": f"ipc://{tmp_path}/recorder-0.sock"}
    for start in [(Message.START, 0, 0.0, 0, None, PROTOCOL + 1), (Message.START, 0, 0.0, 0, None),
                  (Message.START, 0, 0.0, 0, None)]:
        replies: list[Any] = []
        recorder = Recorder(spec, functools.partial(_unpacked_into, replies))
        with caplog.at_level("WARNING", logger="connector.recorder"):
            recorder.handle(packb(start))
        assert recorder.done and recorder.failed and recorder.recorder is None
        ((kind, cause, why),) = replies
        assert (kind, cause) == (Reply.FAILED, "protocol") and "restart vLLM" in why
    said = [r.getMessage() for r in caplog.records if "speaks protocol" in r.getMessage()]
    assert len(said) == 1 and "one from before version 2" in said[0]
    assert not (tmp_path / "logs").exists()  # nothing written for a refused engine


def test_a_failure_inside_the_hand_off_is_an_outage_not_an_exception() -> None:
    """The hand-off's own failure (here the socket's send raising) never
    reaches the caller: the events are counted as lost, one warning per
    kind of error, and recording resumes when the failure stops."""
    class Raising(FakeLink):
        broken = False

        def send(self, message: bytes) -> bool:
            if self.broken:
                raise RuntimeError("socket gone mad")
            return super().send(message)

    link = Raising()
    warnings: list[str] = []
    handoff = _handoff([link], warnings, Clock(), budget=1 << 30)
    calls = [0]

    def sink(applied: Any, state: Any) -> None:
        calls[0] += 1
        link.broken = 100 <= calls[0] < 200
        link.ack()
        handoff.record(applied, state)

    world = run_workload(requests=60, seed=4, sink=sink)
    handoff.close(world.state)
    assert len(warnings) == 1 and "the hand-off failed (RuntimeError('socket gone mad'))" \
        in warnings[0]
    starts = [m for m in link.messages if m[0] == Message.START]
    assert len(starts) == 2 and starts[1][3] > 0  # resumed with the loss counted
    assert handoff.stats.events_lost == starts[1][3] and handoff.stats.outages == 1
    assert link.messages[-1][0] == Message.END and link.messages[-1][1] == len(world.applied)



def _handed_over(requests: int) -> tuple[list[bytes], Any]:
    """The messages a hand-off sends for a seeded workload of ``requests``
    (Message.START first, Message.END last), and the workload's world."""
    link = FakeLink()
    sent: list[bytes] = []
    take = link.send

    def keep(message: bytes) -> bool:
        sent.append(message)
        return take(message)

    link.send = keep  # type: ignore[method-assign]
    handoff = Handoff(lambda: link, budget_bytes=1 << 30, warn=lambda m: None,
                      flush_every_s=0.0, register_atexit=False, io_thread=False)
    world = run_workload(requests=requests, seed=3, sink=handoff.record)
    handoff.close(world.state)
    return sent, world


class _Stalled:
    """The recorder's encoder, its payloads made by ``encode`` (one that stalls)."""

    def __init__(self, encoder: Any, encode: Any) -> None:
        self._encoder, self._encode = encoder, encode

    def __call__(self, item: Any) -> bytes:
        return self._encode(item)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._encoder, name)


def _recorder(directory: Any, *, budget_bytes: int) -> Any:
    """A recorder (``connector.recorder.Recorder``, in this process) writing to ``directory``."""
    from connector.recorder.process import Recorder
    from offload_fsm import Settings

    spec = {"directory": str(directory), "prefix": "run", "world_size": 2,
            "header_config": Settings(offload=default_config()).to_wire(),
            "versions": {"package": "test", "vllm": "", "lmcache": ""},
            "max_file_bytes": 1 << 26, "max_total_bytes": None, "budget_bytes": budget_bytes}
    return Recorder(spec, lambda message: None)

def test_the_recorders_writer_queue_is_bounded_in_the_bytes_its_objects_take(
        tmp_path: Any) -> None:
    """What the recorder queues for its writer are Python objects, 10-15
    times their wire bytes: the queue's bound weighs them so. Measured: the
    memory the recorder holds more once a stalled writer's queue filled is
    within the weight the bound counted for it (what the drain then
    allocates, zlib's state and the file's buffers, is the writer's, not the
    queue's)."""
    import gc
    import tracemalloc


    sent, world = _handed_over(200)
    recorder = _recorder(tmp_path, budget_bytes=1 << 30)
    recorder.handle(sent[0])  # START
    writer = recorder.recorder.writer  # type: ignore[union-attr]
    held = threading.Event()
    release = threading.Event()
    encoder = writer._encoder

    def stalled(item: Any) -> bytes:  # the writer thread, stuck on its disk
        held.set()
        release.wait(30.0)
        return encoder(item)

    writer._encoder = _Stalled(encoder, stalled)
    recorder.handle(sent[1])
    assert held.wait(10.0)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.take_snapshot()
        weighed_before = writer._bytes_in - writer._bytes_out
        for message in sent[2:-1]:
            recorder.handle(message)
        weighed = writer._bytes_in - writer._bytes_out - weighed_before
        queued = writer.queue_len
        gc.collect()
        full = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
        writer._encoder = encoder
        release.set()
    deadline = time.monotonic() + 30.0
    while writer.queue_len and time.monotonic() < deadline:
        time.sleep(0.01)
    held_bytes = sum(stat.size_diff for stat in full.compare_to(base, "filename"))
    assert queued > 50 and held_bytes > 0
    assert held_bytes <= weighed, (held_bytes, weighed)
    recorder._end(len(world.applied), 0.0, None, None)


def test_a_recorder_whose_writer_is_behind_leaves_the_rest_in_its_socket(
        tmp_path: Any) -> None:
    """The writer stalled (a slow disk): once its queue is half full the
    recorder takes nothing more from the socket, so what the engine sends
    waits there unacknowledged (the engine's budget holds it) instead of
    the writer dropping events."""
    import zmq

    from connector.recorder.process import _take_waiting

    sent, world = _handed_over(200)
    recorder = _recorder(tmp_path, budget_bytes=256 << 10)
    recorder.handle(sent[0])  # START
    writer = recorder.recorder.writer  # type: ignore[union-attr]
    release = threading.Event()
    encoder = writer._encoder

    def stalled(item: Any) -> bytes:
        release.wait(30.0)
        return encoder(item)

    writer._encoder = _Stalled(encoder, stalled)
    context = zmq.Context()
    inbound, outbound = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    try:
        inbound.bind(f"ipc://{tmp_path}/in.sock")
        outbound.connect(f"ipc://{tmp_path}/in.sock")
        for message in sent[1:-1]:
            outbound.send(message)
        time.sleep(0.2)  # into the inbound socket
        taken = _take_waiting(inbound, recorder, float("inf"))
        assert 0 < taken < sum(len(m) for m in sent[1:-1])
        assert recorder.writer_busy and writer.items_lost == 0
    finally:
        release.set()
        writer._encoder = encoder
        inbound.close(linger=0)
        outbound.close(linger=0)
        context.term()
    recorder._end(len(world.applied), 0.0, None, None)


def test_each_start_up_failure_names_its_cause_and_its_fix() -> None:
    """The FAILED reply's cause (what repeats: one warning each) and text
    (the directory, the OS's words, the fix) per kind of failure."""
    import errno
    from pathlib import Path

    from connector.recorder.process import cannot_record

    logs = Path("/var/log/lazy")
    for code, fix in [(errno.EROFS, "remount it read-write"), (errno.ENOSPC, "free space"),
                      (errno.EACCES, "give this user write access"),
                      (errno.ENOTDIR, "make it a writable directory")]:
        cause, text = cannot_record(logs, OSError(code, os.strerror(code)))
        assert cause == errno.errorcode[code]
        assert f"the log directory {logs} cannot be written ({os.strerror(code)})" in text
        assert fix in text and "lmcache.mp.lazy_offload_log_" in text
