"""The one scan: framing damage and decoding damage as ``LogDamage``, a
too-new schema ending the file, a missing header named, a run read file
by file, and a file read from a segment's snapshot."""

from __future__ import annotations

from pathlib import Path

import attrs
import msgpack

from logfiles.scan import Entry, LogDamage, frames, read_file, read_log
from offload_fsm.log.framing import Record, frame
from offload_fsm.log.names import file_name
from offload_fsm.log.records import SCHEMA_VERSION, Header, Snapshot, encode_header

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "logs" / "v6" / "golden-000000.lolog"


def _header(**changes: object) -> bytes:
    header = next(entry.record for entry in read_file(GOLDEN) if isinstance(entry, Entry))
    assert isinstance(header, Header)
    return encode_header(attrs.evolve(header, **changes))


def _kinds(items: list[Entry | LogDamage]) -> list[str]:
    return [item.kind if isinstance(item, LogDamage) else type(item.record).__name__
            for item in items]


def test_framing_damage_is_reported_with_its_file_and_the_scan_goes_on(tmp_path: Path) -> None:
    path = tmp_path / "x.lolog"
    first, second = frame(_header()), frame(_header(seq=5))
    broken = bytearray(first)
    broken[-1] ^= 0xFF  # the CRC no longer matches
    path.write_bytes(bytes(broken) + second)
    items = list(frames(path))
    assert isinstance(items[0], LogDamage) and items[0].path == str(path)
    assert items[0].offset == 0 and items[0].kind == "crc_mismatch"
    assert isinstance(items[-1], Record) and items[-1].offset == len(first)
    assert _kinds(list(read_file(path))) == ["crc_mismatch", "Header"]


def test_payloads_that_do_not_decode_are_damage_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "x.lolog"
    path.write_bytes(frame(_header()) + frame(b"\xc1") + frame(msgpack.packb([99, 0, 0]))
                     + frame(_header(seq=1)))
    items = list(read_file(path))
    assert _kinds(items) == ["Header", "undecodable", "unknown_tag", "Header"]
    damage = items[1]
    assert isinstance(damage, LogDamage) and damage.length_bytes == 1 + 12
    assert damage.describe().startswith(f"{path}@{len(frame(_header()))}: undecodable (13 bytes)")


def test_nothing_after_a_too_new_header_is_read(tmp_path: Path) -> None:
    path = tmp_path / "x.lolog"
    path.write_bytes(frame(_header(schema=SCHEMA_VERSION + 1)) + frame(_header()))
    assert _kinds(list(read_file(path))) == ["schema_too_new"]


def test_a_file_that_does_not_start_with_a_header_says_so(tmp_path: Path) -> None:
    path = tmp_path / "x.lolog"
    golden = GOLDEN.read_bytes()
    header_bytes = len(frame(_header()))
    assert golden[:header_bytes] == frame(_header())
    path.write_bytes(golden[header_bytes:])
    items = list(read_file(path))
    assert isinstance(items[0], LogDamage) and items[0].kind == "missing_header"
    assert all(isinstance(item, Entry) for item in items[1:])


def test_a_run_is_read_file_by_file_in_number_order(tmp_path: Path) -> None:
    for seqno in (10, 9):
        (tmp_path / file_name("run", seqno)).write_bytes(frame(_header(seq=seqno)))
    entries = [item for item in read_log(tmp_path) if isinstance(item, Entry)]
    assert [(Path(e.path).name, e.record.seq) for e in entries] == [
        ("run-000009.lolog", 9), ("run-000010.lolog", 10)]


def test_reading_from_a_snapshot_gives_the_header_then_the_records_from_there() -> None:
    whole = [item for item in read_file(GOLDEN) if isinstance(item, Entry)]
    snapshots = [e.offset for e in whole if type(e.record) is Snapshot]
    assert len(snapshots) == 2
    for start in snapshots:
        seeked = list(read_file(GOLDEN, start_offset=start))
        assert type(seeked[0]) is Entry and type(seeked[0].record) is Header
        assert seeked[1:] == [e for e in whole if e.offset >= start]
