"""Reader: torn tails at every offset, bit flips, unknown tags, too-new schemas."""

from __future__ import annotations

from pathlib import Path

import msgpack

from logfiles.scan import Entry, LogDamage, read_file, read_log
from offload_fsm.log.framing import Record, frame, scan
from offload_fsm.log.records import SCHEMA_VERSION, Inputs
from replay.runner import replay


def _boundaries(data: bytes) -> list[int]:
    ends = []
    for item in scan(data):
        assert isinstance(item, Record)
        ends.append(item.offset + 12 + len(item.payload))
    return ends


def test_truncation_at_every_offset_recovers_every_complete_record(
    small_log: Path, tmp_path: Path
) -> None:
    data = small_log.read_bytes()
    ends = _boundaries(data)
    assert len(ends) > 5
    whole = [e.record for e in read_file(small_log) if isinstance(e, Entry)]
    cut_file = tmp_path / "cut.lolog"
    for cut in range(len(data)):
        cut_file.write_bytes(data[:cut])
        items = list(read_file(cut_file))
        entries = [i.record for i in items if isinstance(i, Entry)]
        damage = [i for i in items if isinstance(i, LogDamage)]
        complete = sum(1 for end in ends if end <= cut)
        assert entries == whole[:complete], cut
        if cut in (0, *ends):
            assert damage == [], cut
        else:
            assert len(damage) == 1 and damage[0].is_torn_tail, (cut, damage)
            assert damage[0].offset == max((e for e in ends if e <= cut), default=0)


def test_torn_tail_replays_up_to_the_tear(small_log: Path) -> None:
    data = small_log.read_bytes()
    small_log.write_bytes(data[:-7])
    result = replay(small_log)
    assert result.divergence is None
    assert [d.kind for d in result.damage] == ["short_payload"]
    assert result.events_applied > 0 and not result.ended_cleanly


def test_a_bit_flip_is_detected_and_skipped(small_log: Path) -> None:
    data = bytearray(small_log.read_bytes())
    ends = _boundaries(bytes(data))
    target = ends[3] + 20  # inside the payload of the fifth record
    data[target] ^= 0x10
    small_log.write_bytes(bytes(data))
    items = list(read_file(small_log))
    damage = [i for i in items if isinstance(i, LogDamage)]
    assert (damage[0].offset, damage[0].kind) == (ends[3], "crc_mismatch")
    assert damage[0].length_bytes == ends[4] - ends[3]
    # Later records of its segment that refer to what the lost one sent
    # (schema 4 compact forms) are reported too, never decoded against a guess.
    assert all(d.kind == "undecodable" and "lost to damage" in d.detail for d in damage[1:])
    assert sum(isinstance(i, Entry) for i in items) + len(damage) == len(ends)


def _write(path: Path, payloads: list[bytes]) -> Path:
    path.write_bytes(b"".join(frame(p) for p in payloads))
    return path


def _header(schema: int = SCHEMA_VERSION) -> bytes:
    return msgpack.packb([1, 0, 1000.0, {
        "schema": schema, "config": {}, "policy": "FIFO", "world_size": 1, "versions": {},
        "created_s": 1000.0}])


def test_unknown_tag_is_reported_and_skipped(tmp_path: Path) -> None:
    log = _write(tmp_path / "x-000000.lolog", [
        _header(), msgpack.packb([2, 0, 5, [99, "what"], 0]),
        msgpack.packb([2, 0, 6, [1, "r"], 0]),
    ])
    items = list(read_log(log))
    assert [i.kind for i in items if isinstance(i, LogDamage)] == ["unknown_tag"]
    damaged = next(i for i in items if isinstance(i, LogDamage))
    assert damaged.offset == 12 + len(_header())
    assert isinstance(items[-1], Entry) and isinstance(items[-1].record, Inputs)


def test_schema_too_new_stops_the_file(tmp_path: Path) -> None:
    log = _write(tmp_path / "x-000000.lolog", [
        _header(SCHEMA_VERSION + 1), msgpack.packb([2, 0, 5, [1, "r"], 0])])
    items = list(read_log(log))
    assert len(items) == 1 and isinstance(items[0], LogDamage)
    assert items[0].kind == "schema_too_new" and items[0].offset == 0


def test_missing_header_is_reported(tmp_path: Path) -> None:
    log = _write(tmp_path / "x-000000.lolog", [msgpack.packb([2, 0, 5, [1, "r"], 0])])
    kinds = [i.kind for i in read_log(log) if isinstance(i, LogDamage)]
    assert kinds == ["missing_header"]
