"""The writer's fold (``connector.recording``): the writer thread folds the
events it encodes and takes the periodic digests and the snapshots from its
own state, so the scheduler thread never walks the whole state for them;
the fold is checked against the live run, and when it is lost (events that
never reached the writer) the scheduler thread takes the next snapshot and
the fold restarts from it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from connector import recording
from connector.recording import EventRecorder
from offload_fsm.testing.synthetic import default_config, run_workload
from replay.runner import replay
from testkit.pacing import paced
from tests.replay.conftest import VERSIONS


def _recorder(directory: Path, **options: Any) -> EventRecorder:
    return EventRecorder(default_config(), 2, str(directory), VERSIONS, prefix="run",
                         register_atexit=False, **options)


def test_digests_and_snapshots_come_from_the_writers_fold(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path, digest_every=10, snapshot_every=200)
    world = run_workload(requests=80, seed=4, sink=recorder.record)
    recorder.close(world.state)
    assert recorder.snapshots >= 3 and recorder.snapshots_here == 0
    result = replay(tmp_path)
    assert result.ok, (result.divergence, result.lost, result.damage)
    assert result.digests_checked >= 2 and result.snapshots_checked == recorder.snapshots
    assert result.events_applied == len(world.applied)


def test_a_live_state_changed_outside_step_shows_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The fold cannot see a change the shell made to the live state behind
    the core's back; the digest request's summary does: the fold stops with a
    warning, the next digest is the live state's, and replay reports it."""
    recorder = _recorder(tmp_path, digest_every=5, snapshot_every=0)
    calls = [0]

    def sink(applied: Sequence[Any], state: Any) -> None:
        calls[0] += 1
        if calls[0] == 40:
            first = next(iter(state.counters))
            state.counters[first] += 1  # not through step: the bug this guards against
        paced(recorder)(applied, state)

    with caplog.at_level(logging.WARNING, logger=recording.__name__):
        world = run_workload(requests=40, seed=2, sink=sink)
        recorder.close(world.state)
    assert any("differs from the live one" in r.getMessage() for r in caplog.records)
    result = replay(tmp_path)
    assert result.divergence is not None and result.divergence.kind == "digest"


def test_a_fold_that_lost_events_restarts_from_a_snapshot_taken_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The writer stalls, the queue overflows and drops events (a GAP): the
    fold misses them, so the next snapshot is taken on the scheduler thread,
    the fold restarts from it, and later snapshots come from the fold again;
    replay restarts at that snapshot and checks every digest after it."""
    stalled, release = threading.Event(), threading.Event()
    encode = recording.encode_compact_inputs
    calls = [0]

    def slow_encode(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 3:
            stalled.set()
            release.wait(10.0)
        return encode(*args, **kwargs)

    monkeypatch.setattr(recording, "encode_compact_inputs", slow_encode)
    recorder = _recorder(tmp_path, digest_every=10, snapshot_every=100, queue_max_items=16)
    steps = [0]

    def sink(applied: Sequence[Any], state: Any) -> None:
        steps[0] += 1
        if stalled.is_set() and not release.is_set():
            recorder.record(applied, state)  # the writer is stuck: the queue fills
            writer = recorder.writer
            assert writer is not None
            if writer.items_lost:
                release.set()
            return
        paced(recorder)(applied, state)

    writer = recorder.writer
    assert writer is not None
    with caplog.at_level(logging.WARNING, logger=recording.__name__):
        world = run_workload(requests=80, seed=4, sink=sink)
        recorder.close(world.state)
    # Lost events are a GAP, not a disagreement: the fold stops without a warning,
    # and nothing was asked of it that it could not give.
    assert not [r for r in caplog.records if "fold" in r.getMessage()]
    assert writer.encode_errors == 0
    writer_lost = recorder.snapshots_here
    assert writer_lost >= 1 and recorder.snapshots > writer_lost
    result = replay(tmp_path)
    assert result.lost and result.divergence is None and not result.damage
    assert result.snapshots_loaded and result.digests_checked >= 2


def test_a_fold_that_decides_differently_warns_and_hands_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """The writer's fold of one event decides something else than the live run
    did (a determinism bug, forced here): a warning names the event, and the
    digests and the next snapshot are taken from the live state, which replay
    then checks as usual."""
    from offload_fsm import refold
    from offload_fsm.vocabulary.outcome import NO_OUTCOME

    real_step = refold.step
    calls = [0]

    def step(state: Any, event: Any) -> Any:
        outcome = real_step(state, event)
        calls[0] += 1
        if calls[0] >= 200 and outcome is not NO_OUTCOME and calls[0] < 10_000:
            calls[0] = 10_000  # once
            return NO_OUTCOME
        return outcome

    monkeypatch.setattr(refold, "step", step)  # the writer's fold (the live run calls machine's)
    recorder = _recorder(tmp_path, digest_every=10, snapshot_every=150)
    with caplog.at_level(logging.WARNING, logger=recording.__name__):
        world = run_workload(requests=80, seed=4, sink=paced(recorder))
        recorder.close(world.state)
    assert calls[0] > 10_000
    assert any("in the writer's fold" in r.getMessage() for r in caplog.records)
    assert recorder.snapshots_here >= 1
    result = replay(tmp_path)
    assert result.ok, (result.divergence, result.lost, result.damage)
    assert result.events_applied == len(world.applied)


def test_the_fold_pauses_before_every_event(tmp_path: Path) -> None:
    """The writer's fold is its long stretch of Python: it reaches the
    writer's GIL hand-off (``EventLogWriter.pause_point``) before each event,
    and from the writer thread only."""
    recorder = _recorder(tmp_path, digest_every=10, snapshot_every=0)
    encoder, writer = recorder._encoder, recorder.writer
    assert encoder is not None and writer is not None
    assert encoder.pause == writer.pause_point
    threads: list[int] = []
    encoder.pause = lambda: threads.append(threading.get_ident())
    world = run_workload(requests=30, seed=5, sink=recorder.record)
    recorder.close(world.state)
    assert len(threads) == len(world.applied)
    assert set(threads) == {writer._thread.ident}
    assert replay(tmp_path).ok
