"""verify: clean on recorded runs (incl. the stateful model test's), loud on
an altered decision or digest, a lost event or rotation trouble."""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import msgpack
import pytest
from hypothesis import settings

from connector.recorder.recording import EventRecorder
from offload_fsm.log.framing import Record, frame, scan
from offload_fsm.rules.lifecycle import SHUT_DOWN
from offload_fsm.testing.synthetic import RecordingWorld
from replay import cli, parallel, runner
from replay.runner import replay
from tests.offload_fsm.test_stateful import EvictionAwareMachine, FifoMachine
from tests.replay.conftest import VERSIONS, record_workload


def _rewrite(path: Path, change) -> None:  # type: ignore[no-untyped-def]
    out = []
    for item in scan(path.read_bytes()):
        assert isinstance(item, Record)
        out.append(frame(change(item.payload)))
    path.write_bytes(b"".join(out))


def test_verify_is_clean_on_a_mixed_run(mixed_log: Path) -> None:
    result = replay(mixed_log)
    assert result.ok, (result.divergence, result.damage, result.lost)
    assert result.ended_cleanly and result.digests_checked >= 2
    assert result.events_applied > 1000


def test_an_altered_decision_check_is_the_first_divergence(mixed_log: Path) -> None:
    path = mixed_log / "run-000000.lolog"
    altered = {}

    def change(payload: bytes) -> bytes:
        item = list(msgpack.unpackb(payload))
        if item[0] == 2 and not altered:
            for i in range(4, len(item), 2):
                if item[i]:  # the first non-empty outcome
                    item[i] ^= 1
                    altered["seq"] = item[1] + (i - 4) // 2
                    break
        return msgpack.packb(item)

    _rewrite(path, change)
    result = replay(mixed_log)
    assert result.divergence is not None
    assert result.divergence.kind == "outcome"
    assert result.divergence.seq == altered["seq"]


def test_an_altered_event_diverges_at_the_next_digest_or_outcome(mixed_log: Path) -> None:
    path = mixed_log / "run-000000.lolog"

    def change(payload: bytes) -> bytes:
        item = list(msgpack.unpackb(payload))
        if item[0] == 3 and item[1] == 99:
            item[3] = "0" * 16
        return msgpack.packb(item)

    _rewrite(path, change)
    result = replay(mixed_log)
    assert result.divergence is not None and result.divergence.kind == "digest"
    assert result.divergence.seq == 99


def test_full_outcomes_show_expected_and_got(tmp_path: Path) -> None:
    directory, _ = record_workload(tmp_path, requests=20, seed=1,
                                   recorder_options={"full_outcomes": True,
                                                     "compress_level": 0})  # edited below
    assert replay(directory).ok
    path = directory / "run-000000.lolog"

    def change(payload: bytes) -> bytes:
        item = list(msgpack.unpackb(payload))
        if item[0] == 2:
            for i in range(4, len(item), 2):
                decisions, commands = item[i]
                if decisions:
                    item[i] = [decisions[1:], commands]
                    return msgpack.packb(item)
        return payload

    _rewrite(path, change)
    result = replay(directory)
    assert result.divergence is not None
    assert result.divergence.expected != result.divergence.got


def test_rotation_replays_across_files(tmp_path: Path) -> None:
    directory, world = record_workload(tmp_path, requests=60, seed=2,
                                       recorder_options={"max_file_bytes": 4000})
    assert len(list(directory.glob("*.lolog"))) >= 2  # rotation is asked by the writer thread
    result = replay(directory)
    assert result.ok and result.events_applied == len(world.applied)


def test_a_lost_middle_file_is_reported(tmp_path: Path) -> None:
    directory, _ = record_workload(tmp_path, requests=60, seed=2,
                                   recorder_options={"max_file_bytes": 4000})
    (directory / "run-000001.lolog").unlink()
    result = replay(directory)
    assert result.lost and not result.ok


def test_a_disabled_recorder_records_nothing(tmp_path: Path) -> None:
    recorder = EventRecorder(RecordingWorld.__attrs_attrs__ and _config(), 1, None, VERSIONS)
    assert not recorder.enabled
    recorder.record([], None)  # type: ignore[arg-type]
    recorder.close()


def _config():  # type: ignore[no-untyped-def]
    from offload_fsm.testing.synthetic import default_config

    return default_config()


def _recording(machine_class):  # type: ignore[no-untyped-def]
    """The stateful model test, with every callback recorded and verified at teardown."""

    class Recorded(machine_class):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self._dir = tempfile.TemporaryDirectory()
            self._recorder = EventRecorder(self.world.state.config, self.world.state.world_size,
                                           self._dir.name, VERSIONS, prefix="run",
                                           digest_every=7, register_atexit=False)
            old = self.world
            self.world = RecordingWorld(state=old.state, pool=old.pool,
                                        sink=self._recorder.record)

        def teardown(self) -> None:
            try:
                super().teardown()
                self._recorder.close(self.world.state)
                result = replay(self._dir.name)
                if self.world.state.closed in (None, SHUT_DOWN):
                    assert result.ok, (result.divergence, result.damage, result.lost)
                    assert result.events_applied == len(self.world.applied)
            finally:
                self._dir.cleanup()

    return Recorded


TestRecordedEvictionAware = settings(max_examples=25)(_recording(EvictionAwareMachine)).TestCase
TestRecordedFifo = settings(max_examples=25)(_recording(FifoMachine)).TestCase


def test_the_engine_index_names_the_files_and_is_reported(tmp_path: Path) -> None:
    """Several engines (data parallelism) sharing one log directory: each
    engine's files carry its index, and replay says which engine a file is."""
    import io
    import json

    from offload_fsm.testing.synthetic import run_workload
    from replay.cli import main

    recorder = EventRecorder(_config(), 1, str(tmp_path), VERSIONS, engine_index=3,
                             register_atexit=False)
    world = run_workload(requests=8, seed=1, world_size=1, sink=recorder.record)
    recorder.close(world.state)
    (path,) = tmp_path.glob("*.lolog")
    assert "-engine3-" in path.name
    out = io.StringIO()
    assert main(["verify", str(path)], out=out, err=io.StringIO()) == 0
    assert out.getvalue().startswith("engine 3, ")
    out = io.StringIO()
    main(["verify", "--json", str(path)], out=out, err=io.StringIO())
    assert json.loads(out.getvalue())["engine_index"] == 3


def _damage_first_snapshot(path: Path) -> None:
    """Replace the state of ``path``'s first snapshot with bytes that do not
    inflate, framed with a valid CRC (a writer bug, not a torn disk)."""
    from offload_fsm.log.peek import payload_kind
    from offload_fsm.log.records import SNAPSHOT

    out, done = [], False
    for item in scan(path.read_bytes()):
        assert isinstance(item, Record)
        payload = item.payload
        if not done and payload_kind(payload) == SNAPSHOT:
            fields = list(msgpack.unpackb(payload))
            assert isinstance(fields[4], bytes)  # deflated
            fields[4] = b"not a zlib stream"
            payload, done = msgpack.packb(fields), True
        out.append(frame(payload))
    assert done
    path.write_bytes(b"".join(out))


def test_a_snapshot_that_does_not_decode_is_reported_where_it_is_used(tmp_path: Path) -> None:
    from replay.cli import main
    from replay.parallel import replay_parallel

    directory, world = record_workload(tmp_path, requests=60, seed=2,
                                       recorder_options={"max_file_bytes": 4000})
    files = sorted(directory.glob("*.lolog"))
    assert len(files) >= 3
    _damage_first_snapshot(files[1])
    folded = replay(directory)  # folding passes it: its digest matches the folded state
    assert folded.ok and folded.events_applied == len(world.applied)
    checked = replay(directory, check_snapshots=True)
    assert not checked.ok and checked.events_applied == len(world.applied)
    assert [p for p in checked.lost if "does not decode" in p] == checked.lost
    parallel = replay_parallel(directory, workers=1)  # each file from its own snapshot
    assert any("does not decode" in problem for problem in parallel.lost)
    (directory / files[0].name).unlink()  # the run now starts at the damaged snapshot
    alone = replay(directory)
    assert any("does not decode" in problem for problem in alone.lost)
    assert alone.header is not None  # folding restarted at the next snapshot, a file on
    assert alone.snapshots_loaded and alone.snapshots_loaded[0] > alone.header.seq
    assert main(["verify", str(directory), "--snapshots"]) == 3


def test_replay_commands_run_with_young_collections_spaced_and_restore_them(
        mixed_log: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    before = gc.get_threshold()
    with pytest.raises(RuntimeError), runner.spaced_collections():
        seen.append(gc.get_threshold()[0])
        raise RuntimeError
    assert gc.get_threshold() == before and seen == [runner.YOUNG_COLLECTION_ALLOCATIONS]

    def command(*_args: object) -> int:
        seen.append(gc.get_threshold()[0])
        return 0

    monkeypatch.setitem(cli._COMMANDS, "verify", command)
    assert cli.main(["verify", str(mixed_log)]) == 0
    unit = parallel._replay_unit
    monkeypatch.setattr(parallel, "_replay_unit",
                        lambda *args: (command(), unit(*args))[1])
    part = parallel._replay_file((str(mixed_log / "run-000000.lolog"), 0, -1, ""))
    assert part.result.ok and gc.get_threshold() == before
    assert seen[1:] == [runner.YOUNG_COLLECTION_ALLOCATIONS] * 2


def _cli(*argv: str) -> tuple[int, str, str]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_a_directory_several_engines_share_verifies_and_sums_per_run(tmp_path: Path) -> None:
    """Two engines' runs in one directory: verify and summary report each
    run (with its engine) and the total, instead of refusing the directory."""
    import json

    from offload_fsm.testing.synthetic import default_config, run_workload

    for engine in (0, 1):
        recorder = EventRecorder(default_config(), 2, str(tmp_path), VERSIONS,
                                 prefix=f"run-engine{engine}", engine_index=engine,
                                 register_atexit=False)
        world = run_workload(requests=20 + 10 * engine, seed=engine, sink=recorder.record)
        recorder.close(world.state)
    code, out, _ = _cli("verify", str(tmp_path))
    assert code == 0, out
    assert out.count("OK: every outcome and digest matches") == 2
    assert "== total: 2 runs (engines 0, 1)" in out and "2 of 2 OK" in out
    code, out, _ = _cli("verify", str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] and set(data["runs"]) == {"run-engine0", "run-engine1"}
    assert {run["engine_index"] for run in data["runs"].values()} == {0, 1}
    code, out, _ = _cli("summary", str(tmp_path), "--json")
    data = json.loads(out)
    assert code == 0 and data["total"]["ledger_closes"]
    assert data["total"]["ops"]["admitted"] == sum(
        run["ledger"]["ops"]["admitted"] for run in data["runs"].values())
    code, out, _ = _cli("verify", str(tmp_path), "--prefix", "run-engine1")
    assert code == 0 and "engine 1" in out and "total" not in out
