"""Replay reads hostile input safely: random bytes, truncations, bit flips,
huge lengths and zip bombs end in a clean exit (3 for damage, with a
message), within a time and memory bound. The reader never trusts a length
or a compressed size it reads: inflation is capped by the record's size and
a global limit (``log.decode.inflate_bound``), and resynchronising after
damage spends CRC work in proportion to the file (``log.framing``)."""

from __future__ import annotations

import io
import resource
import struct
import time
import zlib
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_fsm.log.framing import HEADER_BYTES, MAGIC, MAX_PAYLOAD_BYTES, frame, scan
from offload_fsm.log.records import SNAPSHOT
from offload_fsm.log.wire import packb
from replay import cli

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "logs" / "v6" / "golden-000000.lolog"
_REAL = GOLDEN.read_bytes()
_RECORD_STARTS = [item.offset for item in scan(_REAL) if hasattr(item, "payload")]


def _verify(tmp_path: Path, data: bytes, name: str = "run-000000.lolog") -> tuple[int, str]:
    path = tmp_path / name
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(["verify", str(path)])
    return code, err.getvalue()


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@st.composite
def hostile(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "truncated", "flipped", "huge length", "spliced"]))
    if kind == "random":
        return draw(st.binary(max_size=4096))
    data = bytearray(_REAL)
    if kind == "truncated":
        return bytes(data[:draw(st.integers(0, len(data) - 1))])
    if kind == "flipped":
        for _ in range(draw(st.integers(1, 16))):
            bit = draw(st.integers(0, len(data) * 8 - 1))
            data[bit // 8] ^= 1 << (bit % 8)
        return bytes(data)
    start = draw(st.sampled_from(_RECORD_STARTS))
    if kind == "huge length":  # a record's length field, lied about
        length = draw(st.sampled_from([MAX_PAYLOAD_BYTES, MAX_PAYLOAD_BYTES + 1, 2**32 - 1,
                                       len(data) * 4]))
        data[start + 4 : start + 8] = struct.pack("<I", length)
        return bytes(data)
    junk = draw(st.binary(min_size=1, max_size=64))  # a record's bytes replaced by junk
    return bytes(data[:start] + junk + data[start + len(junk):])


@settings(max_examples=60, deadline=10_000, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.data_too_large])
@given(data=hostile())
def test_every_hostile_log_ends_in_a_clean_exit(tmp_path_factory: pytest.TempPathFactory,
                                                data: bytes) -> None:
    before = _max_rss_mib()
    started = time.perf_counter()
    code, err = _verify(tmp_path_factory.mktemp("hostile"), data)
    assert time.perf_counter() - started < 10
    assert _max_rss_mib() - before < 256
    assert code in (0, 1, 3)  # a truncation at a record's end is a log without END
    if code == 3:
        assert err.strip(), "exit 3 without a message"


def _bomb_file() -> bytes:
    """A file that starts later in its run (header at event 100), so replay
    must restore its state from the SNAPSHOT after the header: a zip bomb."""
    import attrs

    from offload_fsm.log.decode import LogDecoder
    from offload_fsm.log.records import encode_header

    header = LogDecoder().decode(next(iter(scan(_REAL))).payload)  # type: ignore[union-attr]
    later = encode_header(attrs.evolve(header, seq=100))  # type: ignore[arg-type]
    deflate, zeros = zlib.compressobj(9), bytes(1 << 20)
    bomb = b"".join(deflate.compress(zeros) for _ in range(300)) + deflate.flush()
    return frame(later) + frame(packb((SNAPSHOT, 100, 0, "0" * 16, bomb)))  # 300 MiB


def test_a_zip_bomb_snapshot_is_refused_without_inflating_it(tmp_path: Path) -> None:
    bomb = _bomb_file()
    before = _max_rss_mib()
    code, err = _verify(tmp_path, bomb)
    assert _max_rss_mib() - before < 200
    assert code == 3 and "inflates past" in err


def test_resynchronising_through_many_false_magics_costs_in_proportion_to_the_file(
        tmp_path: Path) -> None:
    """Every 16 bytes a magic whose header claims 16 MiB: before the budget,
    each candidate cost a CRC over the 16 MiB after it."""
    fake = MAGIC + struct.pack("<II", MAX_PAYLOAD_BYTES, 0) + b"\0" * (16 - HEADER_BYTES)
    data = _REAL[:_RECORD_STARTS[1]] + fake * ((32 << 20) // 16) + _REAL[_RECORD_STARTS[1]:]
    started = time.perf_counter()
    code, err = _verify(tmp_path, data)
    assert time.perf_counter() - started < 30
    assert code == 3 and "damage" in err
