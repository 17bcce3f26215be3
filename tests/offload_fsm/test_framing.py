from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_fsm.log.framing import (
    HEADER_BYTES,
    MAGIC,
    MAX_PAYLOAD_BYTES,
    Damage,
    DamageKind,
    Record,
    frame,
    scan,
    scan_stream,
)


def _log(payloads: list[bytes]) -> tuple[bytes, list[int]]:
    offsets = []
    out = bytearray()
    for p in payloads:
        offsets.append(len(out))
        out += frame(p)
    return bytes(out), offsets


def _payloads(n: int = 20) -> list[bytes]:
    return [f"event-{i}".encode() * (i % 4 + 1) + bytes([i]) for i in range(n)]


def _records(items: list[Record | Damage]) -> list[Record]:
    return [x for x in items if isinstance(x, Record)]


def _damages(items: list[Record | Damage]) -> list[Damage]:
    return [x for x in items if isinstance(x, Damage)]


def _check_coverage(items: list[Record | Damage], total: int, start: int = 0) -> None:
    """Records and damages tile the input exactly, in order."""
    pos = start
    for x in items:
        assert x.offset == pos
        if isinstance(x, Record):
            pos += HEADER_BYTES + len(x.payload)
        else:
            assert x.length_bytes > 0
            pos += x.length_bytes
    assert pos == start + total


# ------------------------------------------------------------------ frame / scan


def test_frame_layout() -> None:
    rec = frame(b"hello")
    assert rec[:4] == MAGIC
    assert struct.unpack("<I", rec[4:8])[0] == 5
    assert struct.unpack("<I", rec[8:12])[0] == zlib.crc32(b"hello")
    assert rec[12:] == b"hello"
    assert len(frame(b"")) == HEADER_BYTES


def test_frame_rejects_oversized_payload() -> None:
    with pytest.raises(ValueError):
        frame(b"\0" * (MAX_PAYLOAD_BYTES + 1))


def test_roundtrip() -> None:
    payloads = _payloads() + [b""]
    data, offsets = _log(payloads)
    items = list(scan(data))
    assert items == [Record(o, p) for o, p in zip(offsets, payloads, strict=True)]
    assert all(type(r.payload) is bytes for r in _records(items))


def test_roundtrip_memoryview_bytearray_and_start_offset() -> None:
    payloads = _payloads(5)
    data, offsets = _log(payloads)
    for buf in (memoryview(data), bytearray(data)):
        assert _records(list(scan(buf, start_offset=100))) == [
            Record(o + 100, p) for o, p in zip(offsets, payloads, strict=True)
        ]


def test_empty_input() -> None:
    assert list(scan(b"")) == []
    assert list(scan_stream(io.BytesIO(b""))) == []


def test_record_is_frozen_and_hashable() -> None:
    r = next(iter(scan(frame(b"x"))))
    assert r == Record(0, b"x")
    assert hash(r) == hash(Record(0, b"x"))
    with pytest.raises(AttributeError):
        r.offset = 3  # type: ignore[misc]


# ------------------------------------------------------------------ truncation


def test_truncation_at_every_offset() -> None:
    payloads = _payloads(20)
    data, offsets = _log(payloads)
    boundaries = set(offsets) | {len(data)}
    for cut in range(len(data) + 1):
        items = list(scan(data[:cut]))
        _check_coverage(items, cut)
        complete = [
            Record(o, p)
            for o, p in zip(offsets, payloads, strict=True)
            if o + HEADER_BYTES + len(p) <= cut
        ]
        assert _records(items) == complete
        damages = _damages(items)
        if cut in boundaries:
            assert damages == []
        else:
            assert len(damages) == 1
            d = damages[0]
            assert d.is_torn_tail
            last_start = max(o for o in offsets if o < cut)
            assert d.offset == last_start
            assert d.length_bytes == cut - last_start
            expected = (
                DamageKind.SHORT_HEADER
                if cut - last_start < HEADER_BYTES
                else DamageKind.SHORT_PAYLOAD
            )
            assert d.kind is expected
            assert items[-1] is d


# ------------------------------------------------------------------ bit flips


def test_single_bit_flip_in_payload_or_crc_is_detected() -> None:
    payloads = _payloads(6)
    data, offsets = _log(payloads)
    victim = 2
    start = offsets[victim]
    end = start + HEADER_BYTES + len(payloads[victim])
    for byte in range(start + 8, end):  # CRC field and payload
        for bit in range(8):
            bad = bytearray(data)
            bad[byte] ^= 1 << bit
            items = list(scan(bytes(bad)))
            _check_coverage(items, len(data))
            expected = [
                Record(o, p)
                for i, (o, p) in enumerate(zip(offsets, payloads, strict=True))
                if i != victim
            ]
            assert _records(items) == expected
            assert _damages(items) == [
                Damage(start, DamageKind.CRC_MISMATCH, end - start, _damages(items)[0].detail)
            ]


def test_bit_flip_in_header_is_detected_and_rest_recovered() -> None:
    payloads = _payloads(6)
    data, offsets = _log(payloads)
    victim = 3
    start = offsets[victim]
    for byte in range(start, start + 8):  # magic and length fields
        for bit in range(8):
            bad = bytearray(data)
            bad[byte] ^= 1 << bit
            items = list(scan(bytes(bad)))
            _check_coverage(items, len(data))
            recs = _records(items)
            assert recs == [
                Record(o, p)
                for i, (o, p) in enumerate(zip(offsets, payloads, strict=True))
                if i != victim
            ]
            (d,) = _damages(items)
            assert d.offset == start
            assert d.length_bytes == HEADER_BYTES + len(payloads[victim])
            assert d.kind in (
                DamageKind.BAD_MAGIC,
                DamageKind.BAD_LENGTH,
                DamageKind.CRC_MISMATCH,
            )
            if byte < start + 4:
                assert d.kind is DamageKind.BAD_MAGIC


def test_bad_length_over_maximum() -> None:
    data, offsets = _log([b"a", b"b", b"c"])
    bad = bytearray(data)
    struct.pack_into("<I", bad, offsets[1] + 4, MAX_PAYLOAD_BYTES + 1)
    items = list(scan(bytes(bad)))
    assert _records(items) == [Record(offsets[0], b"a"), Record(offsets[2], b"c")]
    (d,) = _damages(items)
    assert d.kind is DamageKind.BAD_LENGTH
    assert (d.offset, d.length_bytes) == (offsets[1], offsets[2] - offsets[1])


def test_length_past_end_followed_by_valid_records_is_bad_length() -> None:
    data, offsets = _log([b"a", b"b", b"c"])
    bad = bytearray(data)
    struct.pack_into("<I", bad, offsets[1] + 4, 1000)  # runs past the end
    items = list(scan(bytes(bad)))
    assert _records(items) == [Record(offsets[0], b"a"), Record(offsets[2], b"c")]
    (d,) = _damages(items)
    assert d.kind is DamageKind.BAD_LENGTH


# ------------------------------------------------------------------ garbage


@pytest.mark.parametrize(
    "garbage",
    [b"\x00", b"xyz", b"L", b"LOF", b"LOF1", b"LOF1\x05\x00\x00\x00", b"\xff" * 100, MAGIC * 7],
)
def test_garbage_between_records_is_skipped(garbage: bytes) -> None:
    payloads = _payloads(6)
    a, _ = _log(payloads[:3])
    b, _ = _log(payloads[3:])
    data = a + garbage + b
    items = list(scan(data))
    _check_coverage(items, len(data))
    recs = _records(items)
    assert [r.payload for r in recs] == payloads
    assert recs[3].offset == len(a) + len(garbage)
    (d,) = _damages(items)
    assert d.offset == len(a)
    assert d.length_bytes == len(garbage)
    assert not d.is_torn_tail


def test_garbage_at_start_and_trailing_garbage() -> None:
    body, _ = _log([b"one", b"two"])
    data = b"junk" + body + b"zz"
    items = list(scan(data))
    _check_coverage(items, len(data))
    assert [r.payload for r in _records(items)] == [b"one", b"two"]
    d1, d2 = _damages(items)
    assert (d1.offset, d1.length_bytes, d1.kind) == (0, 4, DamageKind.BAD_MAGIC)
    assert (d2.offset, d2.length_bytes, d2.kind) == (4 + len(body), 2, DamageKind.BAD_MAGIC)


def test_crc_mismatch_then_torn_tail_is_one_damage_to_end() -> None:
    data, offsets = _log([b"a", b"bb", b"ccc"])
    bad = bytearray(data[:-1])
    bad[offsets[1] + HEADER_BYTES] ^= 0x01
    items = list(scan(bytes(bad)))
    _check_coverage(items, len(bad))
    assert _records(items) == [Record(0, b"a")]
    (d,) = _damages(items)
    assert d.kind is DamageKind.CRC_MISMATCH
    assert d.offset == offsets[1]


# ------------------------------------------------------------------ streaming


def _stream_cases() -> list[bytes]:
    payloads = _payloads(20)
    data, offsets = _log(payloads)
    flipped = bytearray(data)
    flipped[offsets[5] + 14] ^= 0x10
    cases = [
        data,
        data[:-3],
        data[: offsets[7] + 5],
        bytes(flipped),
        data[: offsets[4]] + b"garbage-LOF1-garbage" + data[offsets[4] :],
        b"LOF" + data + b"LO",
        data + MAGIC + struct.pack("<II", 10_000, 0) + b"partial",
    ]
    return cases


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 13, 64, 1 << 20])
def test_scan_stream_equals_scan(chunk: int) -> None:
    for data in _stream_cases():
        assert list(scan_stream(io.BytesIO(data), chunk_bytes=chunk)) == list(scan(data))


def test_scan_stream_over_file(tmp_path: Path) -> None:
    data = _stream_cases()[4]
    path = tmp_path / "log.lolog"
    path.write_bytes(data)
    with open(path, "rb") as f:
        assert list(scan_stream(f, chunk_bytes=4)) == list(scan(data))


def test_scan_stream_rejects_bad_chunk_size() -> None:
    with pytest.raises(ValueError):
        list(scan_stream(io.BytesIO(b""), chunk_bytes=0))


# ------------------------------------------------------------------ property


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    payloads=st.lists(st.binary(max_size=64), min_size=1, max_size=25),
    data=st.data(),
)
def test_arbitrary_corruption_of_one_region(payloads: list[bytes], data: st.DataObject) -> None:
    """Every record not overlapping the corrupted region is recovered.

    Caveat encoded below: bytes of a *damaged* record can by themselves form a
    frame that validates (e.g. a payload that embeds a whole frame, or a
    header whose original payload reappears right after a deletion).  Such a
    "spurious" record is indistinguishable from a real one, so it is reported,
    and it may shadow an intact record it overlaps.  The property checks that
    spurious records only ever come from the damaged zone and that an intact
    record is missing only if such a record overlaps it.
    """
    log, offsets = _log(payloads)
    start = data.draw(st.integers(0, len(log) - 1), label="start")
    length = data.draw(st.integers(1, min(64, len(log) - start)), label="length")
    mode = data.draw(st.sampled_from(["overwrite", "insert", "delete"]), label="mode")
    if mode == "overwrite":
        noise = data.draw(st.binary(min_size=length, max_size=length), label="noise")
        bad = log[:start] + noise + log[start + length :]
    elif mode == "insert":
        noise = data.draw(st.binary(min_size=1, max_size=64), label="noise")
        bad = log[:start] + noise + log[start:]
        length = 0
    else:
        noise = b""
        bad = log[:start] + log[start + length :]
    shift = len(noise) - length
    items = list(scan(bad))
    _check_coverage(items, len(bad))

    # Originals, in the coordinates of ``bad``: intact ones and the damaged zone.
    intact: set[tuple[int, bytes]] = set()
    zone_lo, zone_hi = start, start + len(noise)
    for off, p in zip(offsets, payloads, strict=True):
        end = off + HEADER_BYTES + len(p)
        if end <= start:
            intact.add((off, p))
        elif off >= start + length:
            intact.add((off + shift, p))
        else:
            zone_lo, zone_hi = min(zone_lo, off), max(zone_hi, end + shift)

    got = [(r.offset, r.payload) for r in _records(items)]
    spurious = [(o, p) for o, p in got if (o, p) not in intact]
    for o, p in spurious:
        assert o < zone_hi and o + HEADER_BYTES + len(p) > zone_lo, (o, p)
    for o, p in intact - set(got):
        assert any(
            so < o + HEADER_BYTES + len(p) and o < so + HEADER_BYTES + len(sp)
            for so, sp in spurious
        ), (o, p)
    assert list(scan_stream(io.BytesIO(bad), chunk_bytes=7)) == items
