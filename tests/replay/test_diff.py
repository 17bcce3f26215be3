"""replay diff: identical logs, the first altered outcome or input (found
with and without the digest bisection), a what-if re-run, damage, usage."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgpack

from offload_fsm.log.framing import Record, frame, scan
from offload_fsm.log.records import INDEX
from replay.diff import diff_logs
from testkit.logedit import rekeyed
from tests.replay.conftest import record_workload, run_cli


def _copy_altering(source: Path, target: Path, change) -> dict[str, int]:  # type: ignore[no-untyped-def]
    shutil.copytree(source, target)
    path = target / "run-000000.lolog"
    out = []
    altered: dict[str, int] = {}
    for item in scan(path.read_bytes()):
        assert isinstance(item, Record)
        out.append(change(item.payload, altered))
    path.write_bytes(b"".join(map(frame, rekeyed(out))))  # as a recorder would key it
    return altered


def _alter_check_after(threshold: int):  # type: ignore[no-untyped-def]
    def change(payload: bytes, altered: dict[str, int]) -> bytes:
        item = list(msgpack.unpackb(payload))
        if item[0] == 2 and not altered and item[1] >= threshold:
            for i in range(4, len(item), 2):
                if item[i]:
                    item[i] ^= 1
                    altered["seq"] = item[1] + (i - 4) // 2
                    break
        return msgpack.packb(item)
    return change


def test_a_log_is_identical_to_itself(mixed_log: Path) -> None:
    code, out, _ = run_cli("diff", str(mixed_log), str(mixed_log))
    assert code == 0, out
    assert out.startswith("identical:")
    assert "final counters" in out


def test_the_first_altered_outcome_is_found(mixed_log: Path, tmp_path: Path) -> None:
    altered = _copy_altering(mixed_log, tmp_path / "b", _alter_check_after(800))
    for full in (False, True):
        result = diff_logs(mixed_log, tmp_path / "b", full=full, ledgers=False)
        assert not result.identical
        assert (result.kind, result.seq) == ("outcome", altered["seq"])
        assert result.a is not None and result.b is not None
        assert "matches the recorded check" in result.a.outcome
        assert "this code gives" in result.b.outcome
    code, out, _ = run_cli("diff", str(mixed_log), str(tmp_path / "b"))
    assert code == 1
    assert f"DIVERGED at seq {altered['seq']} (outcome)" in out


def test_an_altered_input_is_found(mixed_log: Path, tmp_path: Path) -> None:
    def change(payload: bytes, altered: dict[str, int]) -> bytes:
        item = list(msgpack.unpackb(payload))
        if item[0] == 2 and not altered and item[1] >= 500:
            for i in range(3, len(item), 2):
                if item[i][0] == 4:  # RequestFinished: free_blocks
                    event = list(item[i])
                    event[2] += 1
                    item[i] = event
                    altered["seq"] = item[1] + (i - 3) // 2
                    break
        return msgpack.packb(item)

    altered = _copy_altering(mixed_log, tmp_path / "b", change)
    result = diff_logs(mixed_log, tmp_path / "b", ledgers=False)
    assert (result.kind, result.seq) == ("input", altered["seq"]), result.detail
    assert "free_blocks" in result.detail


def test_two_policies_diverge_and_their_ledgers_differ(tmp_path: Path) -> None:
    from offload_fsm.testing.synthetic import default_config
    from offload_fsm.vocabulary.config import Policy

    logs = []
    for policy in (Policy.EVICTION_AWARE, Policy.FIFO):
        directory, _ = record_workload(tmp_path / policy.value, config=default_config(policy),
                                       requests=40, seed=2, pool_blocks=48, concurrency=6)
        logs.append(str(directory))
    code, out, _ = run_cli("diff", *logs)
    assert code == 1
    assert "DIVERGED at seq" in out
    assert "final counters" in out and "B-A" in out


def test_whatif_out_writes_logs_that_diff_reads(mixed_log: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "whatif"
    code, _, err = run_cli("whatif", str(mixed_log), "--policy", "FIFO", "--out", str(out_dir))
    assert code == 0, err
    for name in ("original", "whatif"):
        assert run_cli("verify", str(out_dir / name))[0] == 0
    assert run_cli("diff", str(out_dir / "original"), str(out_dir / "original"))[0] == 0
    code, out, _ = run_cli("diff", str(out_dir / "original"), str(out_dir / "whatif"))
    assert code == 1
    assert "A " in out and "B " in out and "outcome:" in out


def test_damage_and_usage(mixed_log: Path, tmp_path: Path) -> None:
    shutil.copytree(mixed_log, tmp_path / "b")
    path = tmp_path / "b" / "run-000000.lolog"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert run_cli("diff", str(mixed_log), str(tmp_path / "b"))[0] == 3
    assert run_cli("diff", str(mixed_log), str(tmp_path / "nothing"))[0] == 2


def test_a_long_outcome_is_listed_in_part_with_a_count_of_the_rest() -> None:
    from offload_fsm.log.wire import to_wire
    from offload_fsm.vocabulary.commands import EndSession
    from offload_fsm.vocabulary.decisions import DropCause, OpsDropped
    from replay.diff import OUTCOME_ITEMS_SHOWN, _format_wire

    drops = [to_wire(OpsDropped(req_id=f"r{n}", start_token=0, end_token=256, ops=1,
                                tokens=256, cause=DropCause.SHUTDOWN, block_id=-1))
             for n in range(40)]
    ends = [to_wire(EndSession(req_id=f"r{n}")) for n in range(3)]
    text = _format_wire((drops, ends))
    assert text.count("OpsDropped(") == OUTCOME_ITEMS_SHOWN
    assert f"... {43 - OUTCOME_ITEMS_SHOWN} more (40 decisions and 3 commands in all)" in text
    assert "EndSession" not in text
    short = _format_wire((drops[:2], ends[:1]))
    assert short.count("OpsDropped(") == 2 and "EndSession" in short and "more" not in short


def test_leading_segments_with_equal_keys_are_not_read(tmp_path: Path) -> None:
    from logfiles.segments import segments
    from replay.diff import equal_segments, scan_digests

    a, world = record_workload(tmp_path / "a", requests=120, seed=5, pool_blocks=64,
                               concurrency=8, recorder_options={
                                   "digest_every": 100, "compress_level": 0,
                                   "snapshot_every": 200})
    late = len(world.applied) - 150
    altered = _copy_altering(a, tmp_path / "b", _alter_check_after(late))
    skip_a, skip_b = equal_segments(segments(a), segments(tmp_path / "b"))
    assert len(skip_a) == len(skip_b) >= 3
    skipped_to = max(skip_a.values())
    assert skipped_to <= altered["seq"]  # the altered segment is read
    assert min(c.first_seq for c in scan_digests(a, skip=skip_a).chunks) == skipped_to
    from replay import diff

    skips_used: list[object] = []
    original = diff.scan_digests

    def spying(path: object, prefix: object = None, skip: object = None) -> object:
        skips_used.append(skip)
        return original(path, prefix, skip)  # type: ignore[arg-type]

    diff.scan_digests = spying  # type: ignore[assignment]
    try:
        result = diff_logs(a, tmp_path / "b", ledgers=False)
    finally:
        diff.scan_digests = original
    assert skips_used == [skip_a, skip_b]  # diff itself leaves the equal segments unread
    assert (result.kind, result.seq) == ("outcome", altered["seq"])
    assert result.walked_from >= skipped_to
    assert diff_logs(a, a, ledgers=False).identical
    # A segment keyed differently on one side ends the shared prefix there.
    shutil.copytree(a, tmp_path / "c")
    path, indexes = tmp_path / "c" / "run-000000.lolog", 0
    payloads = [r.payload for r in scan(path.read_bytes()) if isinstance(r, Record)]
    for at, payload in enumerate(payloads):
        item = list(msgpack.unpackb(payload))
        if item[0] == INDEX:
            indexes += 1
            if indexes == 2:
                item[7] ^= 1
                payloads[at] = msgpack.packb(item)
    path.write_bytes(b"".join(map(frame, payloads)))
    assert len(equal_segments(segments(a), segments(tmp_path / "c"))[0]) == 1
    assert len(equal_segments(segments(a), segments(a))[0]) == len(segments(a))


def test_damage_inside_segments_that_would_be_skipped_is_still_reported(tmp_path: Path) -> None:
    from logfiles.segments import segments
    from replay.diff import equal_segments

    a, _ = record_workload(tmp_path / "a", requests=120, seed=5, pool_blocks=64, concurrency=8,
                           recorder_options={"snapshot_every": 200})  # batched: compact forms
    shutil.copytree(a, tmp_path / "b")
    path = tmp_path / "b" / "run-000000.lolog"
    starts = [s.offset for s in segments(a)]
    data = bytearray(path.read_bytes())
    data[(starts[1] + starts[2]) // 2] ^= 0xFF  # inside the second segment's batches
    path.write_bytes(bytes(data))
    assert len(equal_segments(segments(a), segments(tmp_path / "b"))[0]) >= 2  # its INDEX is intact
    result = diff_logs(a, tmp_path / "b", ledgers=False)
    assert result.damage, "a damaged frame must be reported even where segments match"
    assert run_cli("diff", str(a), str(tmp_path / "b"))[0] == 3


def test_a_snapshot_whose_seq_does_not_read_is_damage_not_a_crash(tmp_path: Path) -> None:
    from offload_fsm.log.records import SNAPSHOT
    from replay.digests import scan_digests

    golden = Path(__file__).resolve().parents[1] / "data" / "logs" / "v6" / "golden-000000.lolog"
    payloads = [item.payload for item in scan(golden.read_bytes()) if isinstance(item, Record)]
    at = next(n for n, payload in enumerate(payloads) if payload[1] == SNAPSHOT)
    envelope = msgpack.unpackb(payloads[at], raw=True, strict_map_key=False)
    payloads[at] = msgpack.packb([envelope[0], "not a seq", *envelope[2:]])
    path = tmp_path / "odd.lolog"
    path.write_bytes(b"".join(map(frame, payloads)))
    scanned = scan_digests(path)
    assert scanned.damage[0].endswith(": a snapshot whose seq does not read")
    assert len(scanned.damage) > 1 and all(
        "a record after damage in its segment" in line for line in scanned.damage[1:])
    assert scanned.header is not None and scanned.digests  # the other segments still count
