"""``explain`` through the log's index tells what a replay from event 0 tells:
for requests early, late and absent, for token steps, on a rotated run with
periodic snapshots; and still does when an index is damaged, missing (a torn
last file) or a start snapshot does not restore (with a note)."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from logfiles.segments import segments
from offload_fsm.log.framing import Record, frame, scan
from offload_fsm.log.peek import payload_kind
from offload_fsm.log.records import INDEX, SNAPSHOT
from tests.replay.conftest import record_workload, run_cli


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory, _ = record_workload(tmp_path_factory.mktemp("seek") / "log", requests=150,
                                   seed=4, pool_blocks=64, concurrency=8,
                                   recorder_options={"digest_every": 100,
                                                     "snapshot_every": 120,
                                                     "max_file_bytes": 6 * 1024})
    return directory


def _same(directory: Path, *which: str) -> dict[str, object]:
    code, out, err = run_cli("explain", str(directory), *which, "--json")
    full_code, full_out, _ = run_cli("explain", str(directory), *which, "--json", "--no-index")
    assert (code, json.loads(out)) == (full_code, json.loads(full_out)), which
    return {"data": json.loads(out), "err": err, "code": code}


def test_the_run_has_indexed_segments_in_several_files(run: Path) -> None:
    found = segments(run)
    assert len({s.path for s in found}) >= 3 and len(found) >= 6
    assert all(s.index is not None for s in found)  # a clean close indexes every segment
    assert [s.seq for s in found] == sorted({s.seq for s in found})
    for a, b in zip(found, found[1:], strict=False):
        assert a.end_seq == b.seq and a.index is not None and a.index.end_step == b.first_step


@pytest.mark.parametrize("req_id", ["req-0", "req-40", "req-75", "req-149"])
def test_explain_a_request_through_the_index(run: Path, req_id: str) -> None:
    result = _same(run, "--request", req_id)
    assert result["err"] == "" and result["code"] == 0
    data = result["data"]
    assert isinstance(data, dict) and data["found"]


def test_an_absent_request_or_step_is_a_usage_error_either_way(run: Path) -> None:
    for which in (("--request", "nobody"), ("--at", str(10**6))):
        for index in ((), ("--no-index",)):
            code, out, err = run_cli("explain", str(run), *which, *index)
            assert code == 2 and out == "" and err.startswith("error: "), (which, index)


def test_explain_a_step_through_the_index(run: Path) -> None:
    from replay.runner import replay

    last = replay(run).state.step_index - 1  # the run's last token step
    for step in (0, 7, last // 2, last - 3, last):
        data = _same(run, "--at", str(step))["data"]
        assert isinstance(data, dict) and data["found"]
    code, out, _ = run_cli("explain", str(run), "--at", "7")
    assert code == 0 and out.startswith("token step 7:") and "StepScheduled(" in out


def _copy(run: Path, target: Path) -> list[Path]:
    target.mkdir()
    for path in sorted(run.glob("*.lolog")):
        (target / path.name).write_bytes(path.read_bytes())
    return sorted(target.glob("*.lolog"))


def _frames(path: Path) -> list[Record]:
    return [item for item in scan(path.read_bytes()) if isinstance(item, Record)]


def test_a_damaged_or_missing_index_falls_back_to_decoding(run: Path, tmp_path: Path) -> None:
    files = _copy(run, tmp_path / "copy")
    # The middle file loses its INDEX records; the last is torn (no INDEX, no END).
    middle = files[len(files) // 2]
    middle.write_bytes(b"".join(frame(r.payload) for r in _frames(middle)
                                if payload_kind(r.payload) != INDEX))
    data = files[-1].read_bytes()
    files[-1].write_bytes(data[: len(data) * 2 // 3])
    found = segments(tmp_path / "copy")
    assert any(s.index is None for s in found) and any(s.index is not None for s in found)
    for req_id in ("req-40", "req-75", "req-149"):
        _same(tmp_path / "copy", "--request", req_id)
    _same(tmp_path / "copy", "--at", str(found[-1].seq // 10))


def test_a_snapshot_that_does_not_restore_replays_from_the_beginning(
    run: Path, tmp_path: Path
) -> None:
    files = _copy(run, tmp_path / "copy")
    target = next(s for s in segments(tmp_path / "copy") if s.index is not None
                  and s.offset and s.index.requests and "req-75" in s.index.requests)
    records = _frames(target.path)
    raw = b"".join(frame(r.payload) for r in records)
    at = next(i for i, r in enumerate(records) if r.offset == target.offset)
    assert payload_kind(records[at].payload) == SNAPSHOT
    # A snapshot whose digest no state has: it frames and decodes, it does not restore.
    item = list(msgpack.unpackb(records[at].payload))
    item[3] = "0" * 16
    forged = msgpack.packb(item)
    target.path.write_bytes(raw[: target.offset] + frame(forged)
                            + raw[target.offset + 12 + len(records[at].payload):])
    assert files
    code, out, err = run_cli("explain", str(tmp_path / "copy"), "--request", "req-75", "--json")
    assert "does not restore: replayed from the beginning" in err
    full = run_cli("explain", str(tmp_path / "copy"), "--request", "req-75", "--json",
                "--no-index")
    assert json.loads(out) == json.loads(full[1])


def test_an_old_log_has_no_index_and_says_so() -> None:
    golden = Path(__file__).parents[1] / "data" / "logs" / "v3"
    code, out, err = run_cli("explain", str(golden), "--request", "req-3")
    assert code == 0 and "req-3" in out and "no usable index" in err
