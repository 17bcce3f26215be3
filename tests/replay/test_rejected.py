"""The poison path in the log: a callback whose ``drive`` failed is recorded as
the events that applied plus one REJECTED record, and replay reproduces the
rejection (or reports a divergence when the core would have applied it)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from connector.recorder.recording import EventRecorder
from logfiles.scan import read_log
from offload_fsm.log import records as logformat
from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.records import SCHEMA_VERSION, Header, Rejected
from offload_fsm.machine import drive
from offload_fsm.state import State, new_state
from offload_fsm.testing.synthetic import RecordingWorld, default_config
from offload_fsm.testing.world import FakePool
from offload_fsm.vocabulary.commands import Command
from offload_fsm.vocabulary.config import Policy
from offload_fsm.vocabulary.errors import StepFailed
from offload_fsm.vocabulary.events import (
    CandidateOffered,
    Event,
    HashesRead,
    RequestArrived,
    RequestFinished,
    StepScheduled,
)
from offload_fsm.vocabulary.outcome import Outcome
from replay.runner import replay
from replay.tail import describe
from tests.logrecords import encode_record
from tests.replay.conftest import VERSIONS, run_cli

GOLDEN_V1 = Path(__file__).parents[1] / "data" / "logs" / "v1"
Applied = Sequence[tuple[Event, Outcome]]


def _recorder(directory: Path, **options: Any) -> EventRecorder:
    return EventRecorder(default_config(Policy.FIFO), 2, str(directory), VERSIONS,
                         prefix="run", register_atexit=False, **options)


def _records(directory: Path) -> list[logformat.LogRecord]:
    return [entry.record for entry in read_log(directory)]  # type: ignore[union-attr]


# --------------------------------------------------------------------------
# (a) the record


def test_rejected_round_trips_and_keeps_its_tag() -> None:
    assert logformat.REJECTED == 6
    header = Header(seq=0, wall_time_s=1000.0, schema=SCHEMA_VERSION, config={},
                    policy="FIFO", world_size=1, versions={}, created_s=1000.0)
    record = Rejected(seq=41, wall_time_s=1000.5, event=RequestFinished(req_id="r7", free_blocks=3),
                      reason="request finished twice")
    decoder = LogDecoder()
    assert decoder.decode(encode_record(header, created_s=1000.0)) == header
    assert decoder.decode(encode_record(record, created_s=1000.0)) == record
    assert describe(record) == "seq 41 REJECTED RequestFinished: request finished twice"


def test_a_v1_file_upcasts_unchanged() -> None:
    assert SCHEMA_VERSION >= 2
    item = (logformat.GAP, 5, 250, 3)
    assert logformat.UPCASTERS[1](item) == item


# --------------------------------------------------------------------------
# (b) a recorded rejection, reproduced on replay


@attrs.define(eq=False)
class _ShortHashesWorld(RecordingWorld):
    """Answers every hash read one hash short, which the core rejects. A
    failed callback goes to ``on_rejected(applied, event, reason, state)``,
    as the connector hands a ``StepFailed`` to its recorder."""

    on_rejected: Callable[[Applied, Event, str, State], None] | None = None

    def feed(self, event: Event) -> list[tuple[Event, Outcome]]:
        try:
            applied = drive(self.state, event, self._answer)
        except StepFailed as error:
            assert self.on_rejected is not None
            self.on_rejected(error.applied, error.event, error.reason, self.state)
            raise
        self.applied.extend(applied)
        assert self.sink is not None
        self.sink(applied, self.state)
        return applied

    def _answer(self, command: Command) -> Event | None:
        answer = self.execute(command)
        if isinstance(answer, HashesRead):
            return attrs.evolve(answer, block_hashes=answer.block_hashes[1:])
        return answer


def _record_short_hashes(
    directory: Path, **options: Any
) -> tuple[list[tuple[Event, Outcome]], Event]:
    """FIFO selects on the first token step after four requests finished; that
    step's hash read comes back one hash short. Returns the failed callback's
    applied prefix and event."""
    paced = options.pop("paced", False)
    recorder = _recorder(directory, digest_every=3, **options)
    failed: list[Any] = []

    def sink(applied: Applied, state: State) -> None:
        recorder.record(applied, state)
        writer = recorder.writer
        if paced and writer is not None:  # let the writer keep up, as real steps do
            deadline = time.monotonic() + 5
            while writer.queue_len and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(0.01)

    def on_rejected(applied: Applied, event: Event, reason: str, state: State) -> None:
        failed[:] = [list(applied), event]
        recorder.record_rejected(applied, event, reason, state)

    world = _ShortHashesWorld(state=new_state(default_config(Policy.FIFO), world_size=2),
                              pool=FakePool(40), sink=sink, on_rejected=on_rejected)
    requests = [f"r{i}" for i in range(5)]
    for req_id in requests:
        world.arrive(req_id)
    world.schedule(requests, next_step_blocks=10)
    for req_id in requests[:4]:
        world.finish(req_id)
    try:
        world.schedule(requests[4:], next_step_blocks=2)
    except StepFailed:
        pass  # the core rejected the short hash read
    recorder.close(world.state)
    assert failed, "the short hash read was never rejected"
    return failed[0], failed[1]


def test_a_rejected_answer_is_recorded_after_its_applied_prefix(tmp_path: Path) -> None:
    prefix, event = _record_short_hashes(tmp_path)
    assert type(event) is HashesRead
    assert prefix and type(prefix[0][0]) is StepScheduled
    records = _records(tmp_path)
    inputs = [r for r in records if isinstance(r, logformat.Inputs)]
    rejected = [r for r in records if isinstance(r, Rejected)]
    end = records[-1]
    assert len(rejected) == 1 and rejected[0] is records[-3]
    assert isinstance(records[-2], logformat.Index)  # the last segment's, before END
    assert rejected[0].event == event
    assert "hashes read, expected" in rejected[0].reason
    # The prefix applied, so it is in the INPUTS just before, numbered without a hole.
    last = inputs[-1]
    assert last.events[-len(prefix):] == tuple(e for e, _ in prefix)
    assert rejected[0].seq == last.seq + len(last.events)
    # No digest of the closed state: none after the rejection, none in END.
    assert isinstance(end, logformat.End)
    assert end.events_total == rejected[0].seq + 1 and end.digest == ""
    assert not any(isinstance(r, logformat.Digest) and r.seq >= last.seq for r in records)


def test_verify_reproduces_a_recorded_rejection(tmp_path: Path) -> None:
    _, event = _record_short_hashes(tmp_path)
    result = replay(tmp_path)
    assert result.divergence is None and not result.damage and not result.lost
    assert result.rejection is not None and result.rejection.reproduced is True
    assert result.rejection.reproduced_reason == result.rejection.recorded_reason
    assert result.state is not None and result.state.closed is not None
    assert not result.ok and result.ended_cleanly

    code, out, _ = run_cli("verify", str(tmp_path))
    assert code == 1, out
    seq = result.rejection.seq
    assert f"rejected: event {seq} HashesRead was rejected by the core: " in out
    assert out.rstrip().endswith("(reproduced on replay: yes)")
    assert "replay stopped early" not in out and "OK" not in out

    code, out, _ = run_cli("verify", str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False and data["divergence"] is None
    assert data["rejection"]["seq"] == seq and data["rejection"]["reproduced"] is True
    assert data["events_applied"] == seq


def test_a_rejection_in_a_rotated_run_replays_from_the_whole_run_and_its_last_file(
        tmp_path: Path) -> None:
    _record_short_hashes(tmp_path, max_file_bytes=1, paced=True)  # rotate at every batch
    files = sorted(tmp_path.glob("*.lolog"))
    assert len(files) >= 2
    assert any(isinstance(r, Rejected) for r in _records(files[-1]))
    for target in (tmp_path, files[-1]):  # the last file alone starts from its snapshot
        result = replay(target)
        assert not result.lost and result.divergence is None
        assert result.rejection is not None and result.rejection.reproduced is True


def test_the_analyses_cover_a_run_up_to_its_rejection(tmp_path: Path) -> None:
    _record_short_hashes(tmp_path / "log")
    log = str(tmp_path / "log")
    for argv in (("summary", log), ("explain", log, "--request", "r0"),
                 ("whatif", log, "--policy", "EVICTION_AWARE"),
                 ("timeline", log, "-o", str(tmp_path / "t.html"))):
        code, out, err = run_cli(*argv)
        assert code == 0, (argv, out, err)
        assert "warning: event " in err and "(reproduced on replay: yes)" in err, argv
    assert (tmp_path / "t.html").exists()


def test_a_rejected_observation_has_no_prefix(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path)
    world = RecordingWorld(state=new_state(default_config(Policy.FIFO), world_size=2),
                           pool=FakePool(8), sink=recorder.record, drain_on_failure=False)
    world.arrive("r7")
    event = CandidateOffered(req_id="ghost", start_token=0, end_token=64, block_ids=(0, 1),
                             block_hashes=(1, 2), time_s=0.0)
    try:
        world.feed(event)
    except StepFailed as error:
        assert error.applied == () and error.event == event
        recorder.record_rejected(error.applied, error.event, error.reason, world.state)
    else:
        raise AssertionError("the core accepted a candidate of a request that never arrived")
    recorder.close(world.state)
    assert [type(r).__name__ for r in _records(tmp_path)] == ["Header", "Inputs", "Rejected",
                                                             "Index", "End"]
    code, out, _ = run_cli("verify", str(tmp_path))
    assert code == 1
    (line,) = [line for line in out.splitlines() if line.startswith("rejected:")]
    assert line.startswith(
        "rejected: event 1 CandidateOffered (request 'ghost') was rejected by the core: ")
    assert "never arrived" in line and line.endswith("(reproduced on replay: yes)")


# --------------------------------------------------------------------------
# (c) recorded as rejected, applied on replay


def test_a_rejection_the_core_does_not_reproduce_is_a_divergence(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path)
    world = RecordingWorld(state=new_state(default_config(Policy.FIFO), world_size=2),
                           pool=FakePool(8), sink=recorder.record)
    world.arrive("r1")
    recorder.record_rejected((), RequestArrived(req_id="r2"), "made up", world.state)
    recorder.close(world.state)

    result = replay(tmp_path)
    assert result.divergence is not None
    assert (result.divergence.seq, result.divergence.kind) == (1, "outcome")
    assert result.divergence.detail == "recorded as rejected, but the core applied it"
    assert result.rejection is not None and result.rejection.reproduced is False
    code, out, _ = run_cli("verify", str(tmp_path))
    assert code == 1
    assert "DIVERGED at seq 1 (outcome): recorded as rejected, but the core applied it" in out
    assert ("rejected: event 1 RequestArrived (request 'r2') was rejected by the core: "
            "made up (reproduced on replay: no, the core applied it)") in out


# --------------------------------------------------------------------------
# (d) old logs


def test_the_v1_golden_log_still_verifies_clean() -> None:
    # (recorded before chunk-granularity selection: its header lacks the key,
    # so it replays with the rule off, as it was recorded)
    code, out, err = run_cli("verify", str(GOLDEN_V1))
    assert code == 0, (out, err)
    assert out.endswith("OK: every outcome and digest matches\n")
    records = _records(GOLDEN_V1)
    assert isinstance(records[0], Header) and records[0].schema == 1
