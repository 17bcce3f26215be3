"""The writer thread's fold (``connector.recording``): periodic snapshots and
digests are taken from it, never from the live state on the scheduler
thread, and they equal the live state's; after a GAP it has none to give (a
periodic snapshot repeats the segment's INDEX, a DIGEST carries no digest)
until a snapshot of the live state seeds it again; a writer that falls
behind stops folding, and the scheduler thread takes the next snapshot."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest

import connector.recording as recording
from offload_fsm import snapshot
from offload_fsm.codec import state_digest
from offload_fsm.logformat import DIGEST, GAP, HEADER, INDEX, INPUTS, SNAPSHOT
from offload_fsm.testing.synthetic import default_config, run_workload
from replay.runner import replay
from tests.replay.conftest import VERSIONS, record_workload


def test_the_scheduler_thread_digests_the_live_state_only_for_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    walks: list[tuple[str, str]] = []
    real_digest, real_wire = recording.state_digest, snapshot.to_wire

    def digest(state: Any) -> str:
        walks.append(("digest", threading.current_thread().name))
        return real_digest(state)

    def to_wire(state: Any) -> Any:
        walks.append(("snapshot", threading.current_thread().name))
        return real_wire(state)

    monkeypatch.setattr(recording, "state_digest", digest)
    monkeypatch.setattr(snapshot, "to_wire", to_wire)
    directory, _ = record_workload(tmp_path / "log", requests=120, seed=5, pool_blocks=64,
                                   concurrency=8,
                                   recorder_options={"snapshot_every": 400, "digest_every": 100})
    on_main = [kind for kind, thread in walks if thread == threading.main_thread().name]
    on_writer = [kind for kind, thread in walks if thread != threading.main_thread().name]
    monkeypatch.undo()
    assert on_main == ["digest"]  # the END's
    assert on_writer.count("snapshot") >= 2 and on_writer.count("digest") >= 4
    result = replay(directory)
    assert result.ok and result.ended_cleanly
    assert result.snapshots_checked >= 2 and result.digests_checked >= 2


def _payload(data: bytes) -> tuple[Any, ...]:
    return tuple(msgpack.unpackb(data, raw=False, strict_map_key=False))


def test_after_a_gap_the_fold_gives_nothing_until_the_live_state_seeds_it() -> None:
    config = default_config()
    steps: list[tuple[list[Any], Any]] = []
    run_workload(config=config, world_size=2, requests=40, seed=2, pool_blocks=48,
                 concurrency=6, sink=lambda applied, state: steps.append(
                     (list(applied), (state_digest(state), snapshot.to_wire(state),
                                      state.step_index))))
    encode = recording._Encoder(config, 2, VERSIONS, 100, False, "", compress_level=0)
    encode((HEADER,))
    seq = 0

    def feed(first: int, last: int) -> None:
        nonlocal seq
        for applied, _ in steps[first:last]:
            encode((INPUTS, seq, 0.0, applied))
            seq += len(applied)

    third = len(steps) // 3
    feed(0, third)
    live_digest = steps[third - 1][1][0]
    assert _payload(encode((DIGEST, seq - 1, 0.0, None)))[3] == live_digest
    snap = _payload(encode((SNAPSHOT, seq, 0.0, None, None, 0, True)))
    assert snap[0] == SNAPSHOT and snap[3] == live_digest

    feed(third, 2 * third)
    encode((GAP, 5))  # the writer lost events: the fold missed them
    assert _payload(encode((DIGEST, seq - 1, 0.0, None)))[3] == ""
    assert _payload(encode((SNAPSHOT, seq, 0.0, None, None, 0, True)))[0] == INDEX

    digest, wire, step_index = steps[2 * third - 1][1]  # a rotation's live snapshot
    assert _payload(encode((SNAPSHOT, seq, 0.0, digest, wire, step_index, False)))[3] == digest
    feed(2 * third, len(steps))
    snap = _payload(encode((SNAPSHOT, seq, 0.0, None, None, 0, True)))
    assert snap[0] == SNAPSHOT and snap[3] == steps[-1][1][0]


def test_a_writer_behind_stops_folding_and_the_live_state_is_snapshotted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(recording, "FOLD_BACKLOG_ITEMS", -1)  # always behind
    directory, world = record_workload(tmp_path / "log", requests=120, seed=5, pool_blocks=64,
                                       concurrency=8, recorder_options={"snapshot_every": 400})
    result = replay(directory)
    assert result.ok and result.ended_cleanly and result.snapshots_checked >= 2
    assert result.events_applied == len(world.applied)


def test_the_fold_stops_when_the_writer_is_behind() -> None:
    config = default_config()
    steps: list[list[Any]] = []
    run_workload(config=config, world_size=2, requests=10, seed=2, pool_blocks=48,
                 concurrency=4, sink=lambda applied, state: steps.append(list(applied)))
    encode = recording._Encoder(config, 2, VERSIONS, 100, False, "", compress_level=0)
    encode((HEADER,))
    encode((INPUTS, 0, 0.0, steps[0]))
    assert encode.folding
    encode.backlog = lambda: recording.FOLD_BACKLOG_ITEMS + 1
    encode((INPUTS, len(steps[0]), 0.0, steps[1]))
    assert not encode.folding
