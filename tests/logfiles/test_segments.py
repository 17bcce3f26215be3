"""A run's segments from one CRC-only pass: where each starts, which INDEX
is trusted, and damage handed back rather than raised."""

from __future__ import annotations

from pathlib import Path

from logfiles.scan import LogDamage
from logfiles.segments import segments
from offload_fsm.log.framing import Record, frame, scan
from offload_fsm.log.peek import payload_kind
from offload_fsm.log.records import INDEX

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "logs" / "v6" / "golden-000000.lolog"


def test_the_golden_runs_segments_chain_and_are_indexed() -> None:
    found = segments(GOLDEN)
    assert [s.offset for s in found] == [0, 82444, 218015]  # the header, then two snapshots
    assert found[0].seq == 0 and found[0].first_step == 0 and not found[0].digest
    assert all(len(s.digest) == 16 for s in found[1:])
    assert [s.end_seq for s in found[:-1]] == [s.seq for s in found[1:]]
    assert all(s.index is not None for s in found)


def test_a_damaged_index_leaves_its_segment_unindexed_and_is_reported(tmp_path: Path) -> None:
    data = GOLDEN.read_bytes()
    indexes = [item for item in scan(data)
               if isinstance(item, Record) and payload_kind(item.payload) == INDEX]
    target = indexes[1].offset + len(frame(indexes[1].payload)) - 1
    broken = bytearray(data)
    broken[target] ^= 0xFF  # the second INDEX's CRC no longer matches
    path = tmp_path / "x.lolog"
    path.write_bytes(bytes(broken))
    damage: list[LogDamage] = []
    found = segments(path, damage=damage)
    assert [s.index is not None for s in found] == [True, False, True]
    assert [(d.offset, d.kind) for d in damage] == [(indexes[1].offset, "crc_mismatch")]
